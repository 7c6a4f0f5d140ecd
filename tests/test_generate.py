"""KV-cache generation (models/generation.py).

Oracles: transformers' own greedy `generate` on the tiny HF checkpoints
(tests/assets/make_hf_generations.py), and our model's full no-cache forward pass.
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain import models, sharding
from jaxtrain.models import generation as gen
from jaxtrain.models import hf

ASSETS = Path(__file__).parent / "assets" / "hf"
HF_GENERATIONS = sorted(p.name for p in ASSETS.iterdir() if (p / "generate_expected.npy").is_file())
LOGIT_ATOL = 1e-5  # f32: cached decode vs full forward; we see about 1e-6 (different op order)

DENSE = models.ModelConfig(
    vocab_size=97,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    mlp_dim=64,
    init_std=0.2,  # logits of order 1, so a wrong key or position shows far above LOGIT_ATOL
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_original_max_position=8,
)
CONFIGS = {
    "dense-gqa-llama3": DENSE,
    # 3 layers: a dense prefix, then a group [dense, MoE]: both stacks and MoEGroup.
    "moe-dropless": dataclasses.replace(
        DENSE,
        n_layers=3,
        moe=models.MoEConfig(num_experts=4, top_k=2, first_dense_layers=1, every=2, dispatch="dropless"),
    ),
    # MQA, window 3 < prompt 5: the cache is a 3-slot ring and the prefill keeps the last 3.
    "window-mqa": dataclasses.replace(DENSE, n_kv_heads=1, sliding_window=3),
    # OLMo 2's post-norms and whole-projection QK-norm, Qwen2's biases: through the cache too
    "post-norm-qk-bias": dataclasses.replace(
        DENSE, norm_placement="post", qk_norm="projection", qkv_bias=True
    ),
    # Qwen3.5's layers: gated DeltaNet (its conv window and state in the cache) between gated,
    # partially rotated full-attention layers with (1 + w) norms
    "hybrid-deltanet": dataclasses.replace(
        DENSE,
        n_layers=4,
        layer_types=("linear_attention", "full_attention"),
        linear_attention=models.LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8
        ),
        attention_output_gate=True,
        partial_rotary_factor=0.5,
        qk_norm="head",
        norm_scale_offset=1.0,
    ),
}
PROMPT = np.random.default_rng(0).integers(0, 97, size=(2, 5)).astype(np.int32)
LENGTHS = np.array([5, 2], np.int32)  # right-padded: row 1's last 3 tokens are padding
STEPS = 6


@functools.cache
def build(name):
    return models.Transformer(CONFIGS[name], rngs=nnx.Rngs(0))


_prefill = nnx.jit(gen.prefill, static_argnums=3)
_decode = nnx.jit(gen.decode_step)
_forward = nnx.jit(lambda model, tokens: model(tokens))


def greedy_chain(model, tokens, lengths, steps):
    """Greedy by hand with prefill + decode_step: (tokens [b, P + steps], logits [b, steps, V])."""
    cache_len = gen.cache_length(model.cfg, tokens.shape[1] + steps)
    logits, cache = _prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), cache_len)
    out = np.zeros((tokens.shape[0], tokens.shape[1] + steps), np.int32)
    for i, n in enumerate(lengths):
        out[i, :n] = tokens[i, :n]
    all_logits = []
    for t in range(steps):
        all_logits.append(np.asarray(logits))
        tok = np.argmax(all_logits[-1], axis=-1).astype(np.int32)
        out[np.arange(len(lengths)), lengths + t] = tok
        logits, cache = _decode(model, jnp.asarray(tok), jnp.asarray(lengths + t), cache)
    return out, np.stack(all_logits, axis=1)


# --- transformers as the oracle ---------------------------------------------------------


@pytest.mark.parametrize("name", HF_GENERATIONS)
def test_greedy_matches_transformers_token_for_token(name):
    prompt = np.load(ASSETS / name / "generate_prompt.npy")
    expected = np.load(ASSETS / name / "generate_expected.npy")
    model = models.from_hf(ASSETS / name)
    out = models.generate(model, prompt, max_new_tokens=expected.shape[1] - prompt.shape[1])
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_hf_assets_cover_the_issue():
    assert {"llama_gqa_rope_llama3", "mistral_sliding_window", "mixtral_moe"} <= set(HF_GENERATIONS)
    expected = np.load(ASSETS / "mistral_sliding_window" / "generate_expected.npy")
    window = hf.config_from_hf(hf.read_hf_config(ASSETS / "mistral_sliding_window")).sliding_window
    assert expected.shape[1] > 4 * window  # prompt + new: more than 4 windows


def test_mistral_window_changes_the_generation():
    """The Mistral oracle has teeth: without its window the same weights generate otherwise."""
    d = ASSETS / "mistral_sliding_window"
    prompt, expected = np.load(d / "generate_prompt.npy"), np.load(d / "generate_expected.npy")
    unwindowed = models.from_hf(d, sliding_window=None)
    out = np.asarray(models.generate(unwindowed, prompt, max_new_tokens=expected.shape[1] - prompt.shape[1]))
    assert not np.array_equal(out, expected)


# --- the cache against a full forward pass ----------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_logits_equal_full_forward_at_every_step(name):
    model = build(name)
    out, logits = greedy_chain(model, PROMPT, LENGTHS, STEPS)
    full = np.asarray(_forward(model, jnp.asarray(out)))  # causal: position j sees only tokens <= j
    for i, n in enumerate(LENGTHS):
        expected = full[i, n - 1 : n - 1 + STEPS]
        np.testing.assert_allclose(logits[i], expected, rtol=0, atol=LOGIT_ATOL, err_msg=f"row {i}")
    # The jitted while loop emits what the step-by-step chain chose (fill past row 1's end: 0).
    loop = models.generate(model, PROMPT, max_new_tokens=STEPS, prompt_lengths=LENGTHS)
    np.testing.assert_array_equal(np.asarray(loop), out)


def test_window_cache_is_a_ring_of_window_slots():
    model = build("window-mqa")
    _, cache = _prefill(model, jnp.asarray(PROMPT), jnp.asarray(LENGTHS), gen.cache_length(model.cfg, 11))
    assert cache.k.shape == (2, 2, 1, 3, 8)  # [layers, batch, kv_heads, window, head_dim]
    # Row 0 (5 tokens) keeps positions 2, 3, 4 in slots 2, 0, 1; row 1 (2 tokens) holds 0, 1.
    np.testing.assert_array_equal(np.asarray(cache.positions), [[3, 4, 2], [0, 1, -1]])


@pytest.mark.parametrize("name", CONFIGS)
def test_stream_yields_what_generate_returns(name):
    """Step by step (the CLI's streaming path) = the jitted while loop: greedy, sampled,
    per-row lengths, and an EOS that ends the loop early (fill after it)."""
    model = build(name)
    greedy = np.asarray(models.generate(model, PROMPT, max_new_tokens=STEPS, prompt_lengths=LENGTHS))
    eos = int(greedy[0, 5 + 1])
    for kw in (
        dict(),
        dict(temperature=1.0, top_k=20, top_p=0.9, seed=3),
        dict(eos_id=eos),
        dict(temperature=0.7, seed=5, eos_id=eos),
    ):
        kw = dict(max_new_tokens=STEPS, prompt_lengths=LENGTHS, **kw)
        expected = np.asarray(models.generate(model, PROMPT, **kw))
        steps = list(gen.stream(model, PROMPT, **kw))
        assert 1 <= len(steps) <= STEPS and all(s.shape == (2,) and s.dtype == np.int32 for s in steps)
        fill = kw.get("eos_id", 0)
        out = np.full(expected.shape, fill, np.int32)
        for i, n in enumerate(LENGTHS):
            out[i, :n] = PROMPT[i, :n]
            out[i, n : n + len(steps)] = [s[i] for s in steps]
        np.testing.assert_array_equal(out, expected, err_msg=str(kw))
    assert len(list(gen.stream(model, PROMPT[:1], max_new_tokens=STEPS, eos_id=eos))) == 2  # stops at EOS


def test_stream_checks_its_arguments_at_the_call():
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.stream(build("dense-gqa-llama3"), PROMPT, max_new_tokens=0)


# --- meshes -----------------------------------------------------------------------------


def _sharded(model, mesh, rules):
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    axes = models.logical_axes(state)
    params = jax.device_put(params, sharding.tree_shardings(axes, rules, mesh, shapes=params))
    return models.merge(graphdef, state, params)


@pytest.mark.parametrize("name", ["dense-gqa-llama3", "moe-dropless", "hybrid-deltanet"])
def test_tensor2_data2_equals_one_device(name):
    model = build(name)
    kw = dict(max_new_tokens=STEPS, prompt_lengths=LENGTHS)
    sampled = dict(temperature=1.0, top_k=20, seed=3)
    alone = [np.asarray(models.generate(model, PROMPT, **kw, **s)) for s in ({}, sampled)]
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.FSDP_TENSOR):
        sharded = _sharded(model, mesh, sharding.FSDP_TENSOR)
        on_mesh = [np.asarray(models.generate(sharded, PROMPT, **kw, **s)) for s in ({}, sampled)]
        _, cache = _prefill(sharded, jnp.asarray(PROMPT), jnp.asarray(LENGTHS), 11)
    np.testing.assert_array_equal(on_mesh[0], alone[0])
    np.testing.assert_array_equal(on_mesh[1], alone[1])
    # The cache's logical axes put batch over data and kv heads over tensor.
    assert cache.k.sharding.spec == P(None, "data", "tensor")
    assert cache.positions.sharding.spec == P("data")
    if cache.state is not None:  # DeltaNet: batch over data, key-head groups over tensor
        assert cache.conv.sharding.spec == P(None, "data", None, "tensor")
        assert cache.state.sharding.spec == P(None, "data", "tensor")


def test_generation_traces_again_under_other_axis_rules():
    """jit's cache does not key on the axis rules in context, which `constrain` reads while
    tracing: generation passes them as a static argument, so the same shapes under another
    table compile again (and agree with one device), instead of reusing the first table's."""
    model = build("dense-gqa-llama3")
    kw = dict(max_new_tokens=STEPS, prompt_lengths=LENGTHS)
    alone = np.asarray(models.generate(model, PROMPT, **kw))
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    other = sharding.vocab_parallel_head(sharding.FSDP_TENSOR)  # a table no other test generates under
    sizes = []
    for rules in (sharding.FSDP_TENSOR, other, sharding.FSDP_TENSOR):
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            out = models.generate(_sharded(model, mesh, rules), PROMPT, **kw)
        np.testing.assert_array_equal(np.asarray(out), alone)
        sizes.append(gen._generate._cache_size())
    assert sizes[1] == sizes[0] + 1 and sizes[2] == sizes[1]  # traced again for the new table only


# --- sampling ---------------------------------------------------------------------------


def _allowed(logits, temperature, top_k=None, top_p=None):
    """Boolean [..., V]: the tokens top-k then top-p allow, from f64 probabilities."""
    z = logits.astype(np.float64) / temperature
    allowed = np.ones(z.shape, bool)
    if top_k is not None:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        allowed &= z >= kth
    if top_p is not None:
        z = np.where(allowed, z, -np.inf)
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1)
        ranked = np.take_along_axis(probs, order, axis=-1)
        keep_ranked = np.cumsum(ranked, axis=-1) - ranked < top_p
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
        allowed &= keep
    return allowed


@pytest.mark.parametrize(
    "top_k, top_p", [(5, None), (None, 0.3), (12, 0.5)], ids=["top_k", "top_p", "top_k+top_p"]
)
def test_filtered_sampling_never_leaves_the_allowed_set(top_k, top_p):
    model = build("dense-gqa-llama3")
    prompt = np.random.default_rng(1).integers(0, 97, size=(4, 3)).astype(np.int32)
    temperature, steps, beyond_top3 = 1.5, 6, 0
    for seed in range(20):
        out = np.asarray(
            models.generate(
                model,
                prompt,
                max_new_tokens=steps,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
            )
        )
        logits = np.asarray(_forward(model, jnp.asarray(out)))[:, 2 : 2 + steps]  # predict 3 .. 3 + steps
        new = out[:, 3:]
        allowed = _allowed(logits, temperature, top_k, top_p)
        assert np.take_along_axis(allowed, new[..., None], axis=-1).all(), f"seed {seed}"
        beyond_top3 += np.sum(~np.take_along_axis(_allowed(logits, temperature, 3), new[..., None], axis=-1))
    # Not degenerate: the allowed sets are small yet draws are not all near-greedy.
    assert allowed.sum(-1).max() < 40
    assert beyond_top3 > 0


def test_unfiltered_sampling_leaves_a_top_k_set():
    """The check above has teeth: without top_k the same draws often fall outside the top 5."""
    model = build("dense-gqa-llama3")
    prompt = np.random.default_rng(1).integers(0, 97, size=(4, 3)).astype(np.int32)
    out = np.asarray(models.generate(model, prompt, max_new_tokens=6, temperature=1.5, seed=0))
    logits = np.asarray(_forward(model, jnp.asarray(out)))[:, 2:8]
    inside = np.take_along_axis(_allowed(logits, 1.5, 5), out[:, 3:, None], axis=-1)
    assert not inside.all()


def test_temperature_zero_is_greedy_and_seeds_reproduce():
    model = build("dense-gqa-llama3")
    kw = dict(max_new_tokens=STEPS, prompt_lengths=LENGTHS)
    greedy = np.asarray(models.generate(model, PROMPT, **kw))
    zero = np.asarray(models.generate(model, PROMPT, temperature=0.0, top_k=5, top_p=0.5, seed=7, **kw))
    np.testing.assert_array_equal(zero, greedy)
    draw = lambda seed: np.asarray(models.generate(model, PROMPT, temperature=1.0, seed=seed, **kw))
    np.testing.assert_array_equal(draw(1), draw(1))
    assert not np.array_equal(draw(1), draw(2))


# --- EOS and per-row prompt lengths -------------------------------------------------------


def test_eos_stops_a_row_and_fills_it():
    model = build("dense-gqa-llama3")
    greedy = np.asarray(models.generate(model, PROMPT, max_new_tokens=STEPS))
    eos = int(greedy[0, 5 + 2])  # row 0's third new token
    out = np.asarray(models.generate(model, PROMPT, max_new_tokens=STEPS, eos_id=eos))
    expected = greedy.copy()
    for row in expected:
        hits = np.flatnonzero(row[5:] == eos)
        if hits.size:
            row[5 + hits[0] :] = eos
    np.testing.assert_array_equal(out, expected)
    assert (out[0, 5 + 2 :] == eos).all()


def test_rows_of_different_lengths_equal_each_row_alone():
    model = build("dense-gqa-llama3")
    lengths = np.array([5, 2], np.int32)
    out = np.asarray(models.generate(model, PROMPT, max_new_tokens=STEPS, prompt_lengths=lengths, eos_id=7))
    junk = PROMPT.copy()
    junk[1, 2:] = (junk[1, 2:] + 11) % 97  # what the padding holds never matters
    again = np.asarray(models.generate(model, junk, max_new_tokens=STEPS, prompt_lengths=lengths, eos_id=7))
    np.testing.assert_array_equal(again, out)
    for i, n in enumerate(lengths):
        alone = np.asarray(models.generate(model, PROMPT[i : i + 1, :n], max_new_tokens=STEPS, eos_id=7))
        np.testing.assert_array_equal(out[i, : n + STEPS], alone[0])
        assert (out[i, n + STEPS :] == 7).all()  # past the row's end: fill (eos_id)


# --- the door -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, tokens, match",
    [
        (dict(), PROMPT[0], "tokens"),
        (dict(), PROMPT.astype(np.float32), "tokens"),
        (dict(), PROMPT + 97, "tokens"),
        (dict(max_new_tokens=0), PROMPT, "max_new_tokens"),
        (dict(temperature=-1.0), PROMPT, "temperature"),
        (dict(top_k=0), PROMPT, "top_k"),
        (dict(top_k=98), PROMPT, "top_k"),
        (dict(top_p=0.0), PROMPT, "top_p"),
        (dict(top_p=1.5), PROMPT, "top_p"),
        (dict(seed=1.5), PROMPT, "seed"),
        (dict(eos_id=97), PROMPT, "eos_id"),
        (dict(prompt_lengths=[5]), PROMPT, "prompt_lengths"),
        (dict(prompt_lengths=[5, 0]), PROMPT, "prompt_lengths"),
        (dict(prompt_lengths=[6, 2]), PROMPT, "prompt_lengths"),
        (dict(prompt_lengths=[[5, 2]]), PROMPT, "prompt_lengths"),
    ],
)
def test_bad_arguments_are_named(kwargs, tokens, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        models.generate(build("dense-gqa-llama3"), tokens, **kwargs)


def test_not_a_model_is_named():
    with pytest.raises(ValueError, match="model"):
        models.generate(object(), PROMPT, max_new_tokens=2)


def test_package_exports_the_readme_names():
    assert models.from_hf is hf.from_hf and models.to_hf is hf.to_hf and models.generate is gen.generate


def test_prefill_runs_the_hopper_kernel_and_decode_goes_on_from_its_cache(monkeypatch):
    """`attention_impl: pallas_mosaic`: the prefill attends with the Hopper flash kernel (its
    interpreter here), the one-token decode steps with XLA over the cache, as for every impl
    (a 128-row kernel tile would hold one query). Oracle: the same weights with XLA attention:
    the prefill's and the next steps' logits, and the cache, within bf16's tolerance (layer 0's
    K/V, computed before any attention, exactly)."""
    from jaxtrain.pallas_kernels import flash_mgpu

    traced = []  # the kernel's entry point, as the prefill traces it
    kernel = flash_mgpu.flash_attention_mgpu
    monkeypatch.setattr(
        flash_mgpu, "flash_attention_mgpu", lambda *a, **k: traced.append(1) or kernel(*a, **k)
    )
    base = dataclasses.replace(DENSE, head_dim=64, compute_dtype="bfloat16")
    models_ = {
        impl: models.Transformer(dataclasses.replace(base, attention_impl=impl), rngs=nnx.Rngs(0))
        for impl in ("xla", "pallas_mosaic")
    }
    cache_len = gen.cache_length(base, PROMPT.shape[1] + 2)
    got = {}
    for impl, model in models_.items():
        logits, cache = _prefill(model, jnp.asarray(PROMPT), jnp.asarray(LENGTHS), cache_len)
        steps = [logits]
        for t, tok in enumerate(([3, 7], [11, 13])):
            logits, cache = _decode(model, jnp.asarray(tok, jnp.int32), jnp.asarray(LENGTHS + t), cache)
            steps.append(logits)
        got[impl] = (np.stack([np.asarray(x, np.float32) for x in steps]), cache)
    assert traced, "the prefill did not run the Hopper kernel"
    (ref, ref_cache), (out, cache) = got["xla"], got["pallas_mosaic"]
    assert np.max(np.abs(out - ref)) <= 2e-2 * np.max(np.abs(ref)), np.max(np.abs(out - ref))
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        if jnp.issubdtype(a.dtype, jnp.integer):  # the positions the slots hold
            np.testing.assert_array_equal(a, b)
        else:  # layer 0's K/V exactly; later layers' through bf16 attention outputs
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_array_equal(a[0], b[0])
            assert np.max(np.abs(a - b)) <= 2e-2 * np.max(np.abs(b)), np.max(np.abs(a - b))
