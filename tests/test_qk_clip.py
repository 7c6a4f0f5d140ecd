"""QK-clip (optimizer.qk_clip.tau; models/logit_stats.py, jaxtrain/trainer/qk_clip.py) against
hand-computed cases: the recorded per-head maxima against loops over the logits, the clip of
given weights by given maxima written out, and one training step against the same step
without clipping, scaled by the maxima a naive jnp forward pass (tests/reference_llama.py's
pieces) finds."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.models import logit_stats
from jaxtrain.trainer import qk_clip
from jaxtrain.trainer.batches import batch_to_device
from tests import reference_llama as reference
from tests.conftest import program_on_mesh, tiny_config
from tests.corpora import chatml_token_dirs
from tests.reference_llama import apply_rope, rms_norm


def test_max_logits_equal_loops_over_the_allowed_pairs():
    rng = np.random.default_rng(0)
    b, s, h, kv, d, window, scale = 2, 7, 4, 2, 3, 3, 0.7
    q, k = rng.normal(size=(b, s, h, d)), rng.normal(size=(b, s, kv, d))
    segments = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0]])
    got = logit_stats.max_logits(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k, jnp.float32),
        scale=scale,
        segment_ids=segments,
        window=window,
    )
    want = np.full(h, -np.inf)
    for r, head, i, j in itertools.product(range(b), range(h), range(s), range(s)):
        if j <= i and i - j < window and segments[r, i] == segments[r, j]:
            want[head] = max(want[head], scale * q[r, i, head] @ k[r, j, head // (h // kv)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("grouped", [False, True])
def test_clip_scales_the_heads_over_tau_by_hand(grouped):
    wq = np.arange(1, 1 + 2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)  # [layers, d, heads, hd]
    wk = wq + 100
    bq = np.ones((2, 2, 2), np.float32)
    logits = np.array([[4.0, 1.0], [2.0, 8.0]])  # layer 0 head 0 and layer 1 head 1 over tau
    out = qk_clip.clip_attention({"wq": wq, "wk": wk, "bq": bq, "wv": wq}, jnp.asarray(logits), 2.0, grouped)
    g = np.array([[0.5, 1.0], [1.0, 0.25]])  # tau / max_logit where over tau (2.0 is not over)
    q_factor = g if grouped else np.sqrt(g)
    k_factor = np.ones_like(g) if grouped else np.sqrt(g)
    np.testing.assert_allclose(out["wq"], wq * q_factor[:, None, :, None], rtol=1e-7)
    np.testing.assert_allclose(out["bq"], bq * q_factor[:, :, None], rtol=1e-7)
    np.testing.assert_allclose(out["wk"], wk * k_factor[:, None, :, None], rtol=1e-7)
    assert out["wv"] is wq  # values untouched


def test_latent_attention_clip_by_hand():
    """MLA (Kimi K2's split): per head, the no-RoPE query and key columns by sqrt(g), the RoPE
    query column by g, the values and the shared RoPE key (wkv_a) untouched; written out for
    1 layer, 2 heads, nope = rope = v = 1, tau 2, maxima 8 and 1 (g = 0.25 and 1)."""
    wq_b = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], np.float32)  # [layers, q_lora 1, heads, nope + rope]
    wkv_b = np.array([[[[5.0, 6.0], [7.0, 8.0]]]], np.float32)  # [layers, kv_lora 1, heads, nope + v]
    wkv_a = np.array([[[9.0, 10.0]]], np.float32)  # [layers, d 1, kv_lora 1 + rope 1]
    params = {"wq_b": wq_b, "wkv_b": wkv_b, "wkv_a": wkv_a}
    out = qk_clip.clip_latent_attention(params, jnp.asarray([[8.0, 1.0]]), 2.0, nope=1)
    # head 0: g = 2 / 8 = 0.25, sqrt(g) = 0.5; head 1 (1 < 2) untouched
    np.testing.assert_allclose(out["wq_b"], [[[[0.5, 0.5], [3.0, 4.0]]]], rtol=1e-7)
    np.testing.assert_allclose(out["wkv_b"], [[[[2.5, 6.0], [7.0, 8.0]]]], rtol=1e-7)
    assert out["wkv_a"] is wkv_a
    # the head's logit for a latent c = 1 and RoPE key r = 1 (no rotation at position 0):
    # before 1*5 + 2*1 = 7, after 0.5*2.5 + 0.5*1 = 1.75 = 0.25 * 7
    before = wq_b[0, 0, 0, 0] * wkv_b[0, 0, 0, 0] + wq_b[0, 0, 0, 1]
    after = out["wq_b"][0, 0, 0, 0] * out["wkv_b"][0, 0, 0, 0] + out["wq_b"][0, 0, 0, 1]
    assert before == 7.0 and float(after) == 1.75
    # a plain query projection (q_lora_rank null) is clipped the same way
    maxima = jnp.asarray([[8.0, 1.0]])
    plain = qk_clip.clip_latent_attention({"wq": wq_b, "wkv_b": wkv_b}, maxima, 2.0, nope=1)
    np.testing.assert_allclose(plain["wq"], out["wq_b"], rtol=1e-7)


def test_latent_attention_records_its_logits_with_yarns_scale():
    """LatentAttention's recorded maxima: loops over its own q and k times (nope + rope)^-0.5
    x mscale^2, mscale = 0.1 x 0.5 x ln 4 + 1 (YaRN's, rope_mscale_all_dim 0.5)."""
    from flax import nnx

    from jaxtrain.models.mla import LatentAttention

    cfg = tiny_config(
        None,
        MLA,
        "model.n_kv_heads=4",
        "model.rope_scaling=yarn",
        "model.rope_scaling_factor=4",
        "model.rope_mscale_all_dim=0.5",
        "model.init_std=0.3",
    ).model
    layer = LatentAttention(cfg, rngs=nnx.Rngs(0))
    s = 5
    x = jax.random.normal(jax.random.key(1), (1, s, cfg.d_model))
    positions, segments = jnp.arange(s)[None], jnp.ones((1, s), jnp.int32)
    with logit_stats.recording(), logit_stats.collecting() as seen:
        layer(x, positions, segments)
    [(module, got)] = seen
    assert module is layer
    q, k, _ = (np.asarray(t, np.float64) for t in layer.project(x, positions))
    scale = (8 + 4) ** -0.5 * (0.1 * 0.5 * np.log(4) + 1) ** 2
    want = [max(scale * q[0, i, h] @ k[0, j, h] for i in range(s) for j in range(i + 1)) for h in range(4)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def stack(cfg) -> str:
    return "moe_blocks" if cfg.moe is not None else "blocks"


def reference_max_logits(params, tokens, cfg, segment_ids=None, positions=None):
    """[layers, heads] largest visible logit of each head: tests/reference_llama.py's naive
    forward (its windows, sinks and query/key norms), with the scores' maxima read per layer.
    An MoE model has one layer here: its logits come before its experts."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s)) if positions is None else jnp.asarray(positions)
    segment_ids = np.ones((b, s), np.int32) if segment_ids is None else np.asarray(segment_ids)
    mask = reference.causal_mask(segment_ids)
    x, out = params["embedding"][tokens], []
    assert cfg.moe is None or cfg.n_layers == 1
    for kind, p in reference.layers(params, cfg, stack(cfg)):
        x = reference.block(p, x, positions, mask, cfg, kind, maxima=out, attention_only=cfg.moe is not None)
    return np.asarray(jnp.stack(out))


def attention_by_layer(params, cfg) -> list[dict]:
    """Each layer's attention parameters, in model order (over a pattern's stacks too)."""
    return [p["attn"] for _, p in reference.layers(params, cfg, stack(cfg))]


MLA = "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 8}"


def reference_mla_max_logits(params, tokens, cfg):
    """[layers, heads] largest causal logit of each latent attention head: a naive MLA forward
    (queries through the normed q latent, keys as the up-projected no-RoPE part joined to the
    one shared RoPE key, the latents' norms at eps 1e-6)."""
    m = cfg.mla
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    causal = np.tril(np.ones((s, s), bool))
    x = params["embedding"][tokens]
    out = []
    for layer in range(cfg.n_layers):
        p = jax.tree.map(lambda a: a[layer], params["blocks"])
        a = p["attn"]
        hn = rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)
        q = jnp.einsum("bsr,rhk->bshk", rms_norm(hn @ a["wq_a"], a["q_norm"]["scale"], 1e-6), a["wq_b"])
        ckv = hn @ a["wkv_a"]
        latent = rms_norm(ckv[..., : m.kv_lora_rank], a["kv_norm"]["scale"], 1e-6)
        k_rope = apply_rope(ckv[:, :, None, m.kv_lora_rank :], positions, cfg.rope_theta)
        kv = jnp.einsum("bsr,rhk->bshk", latent, a["wkv_b"])
        k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
        n = m.qk_nope_head_dim
        q = jnp.concatenate([q[..., :n], apply_rope(q[..., n:], positions, cfg.rope_theta)], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], m.qk_rope_head_dim))], -1)
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(n + m.qk_rope_head_dim)
        out.append(jnp.max(jnp.where(causal, scores, -jnp.inf), axis=(0, 2, 3)))
        attn = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1), v)
        x = x + jnp.einsum("bqhk,hkd->bqd", attn, a["wo"])
        hn = rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
        gate = hn @ p["mlp"]["w_gate"]
        x = x + (gate * jax.nn.sigmoid(gate) * (hn @ p["mlp"]["w_up"])) @ p["mlp"]["w_down"]
    return np.asarray(jnp.stack(out))


def one_step(*overrides):
    """(initial params, the first batch, params after one step, metrics)."""
    cfg = tiny_config(
        None,
        "model.d_model=32",
        "model.mlp_dim=64",
        "model.vocab_size=64",
        "model.init_std=0.3",  # logits of a few units, so that some heads are over tau
        "train.seq_len=16",
        "train.loss_chunk=0",
        "optimizer.warmup_steps=0",
        *overrides,
    )
    with program_on_mesh(cfg) as (program, state, data):
        initial = jax.device_get(state.params)
        batch = next(data)
        state, metrics = program.step(state, batch_to_device(batch, program.batch_sharding))
        return cfg, initial, batch, jax.device_get(state.params), jax.device_get(metrics)


def tau_between_heads(logits) -> float:
    """A tau in the widest gap between two heads' maxima in the middle half of them: about half
    the heads over it, and none so close that a 16-bit rounding of its maximum crosses it."""
    v = np.sort(np.ravel(logits))
    i = max(range(v.size // 4, 3 * v.size // 4), key=lambda i: v[i + 1] - v[i])
    return float((v[i] + v[i + 1]) / 2)


_MHA = "model.n_kv_heads=4"
_MOE = "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 32}"
# (overrides, the recorded maxima's tolerance against the float32 reference, the pairs)
_CLIP_CASES = {
    "mha": ((_MHA,), 1e-5, ()),
    "gqa-microbatches-fsdp": (("model.n_kv_heads=2", "train.microbatches=2", "mesh.fsdp=2"), 1e-5, ("fsdp",)),
    "sinks-pattern-softcap": (
        (_MHA, "model.attention_sinks=true", "model.attention_pattern=[local,global]",
         "model.sliding_window=6", "model.final_softcap=2.0"),
        1e-5,
        ("sinks", "attention_pattern", "final_softcap"),
    ),
    "moe": ((_MHA, "model.n_layers=1", _MOE), 1e-5, ("moe",)),
    # 16-bit compute records the maxima of 16-bit queries and keys (bf16: 8 bits of mantissa)
    "bf16": ((_MHA, "model.compute_dtype=bfloat16"), 2e-2, ("bf16",)),
    "fp16": ((_MHA, "model.compute_dtype=float16"), 5e-3, ("fp16",)),
    "fp8": ((_MHA, "model.fp8=true"), 5e-2, ("fp8",)),
    "state16": ((_MHA, "optimizer.state_dtype=bfloat16"), 1e-5, ("state_16bit",)),
}  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(k, id=k, marks=pytest.mark.composes(*(f"{f}+qk_clip" for f in pairs)))
        for k, (_, _, pairs) in _CLIP_CASES.items()
    ],
)
@pytest.mark.composes("lm+qk_clip", "dense+qk_clip", "adamw+qk_clip")
def test_a_step_clips_the_heads_the_forward_pass_found_over_tau(case):
    overrides, rtol, _ = _CLIP_CASES[case]
    cfg, initial, batch, plain, _ = one_step(*overrides)
    logits = reference_max_logits(initial, batch["inputs"], cfg.model)
    tau = tau_between_heads(logits)
    assert (logits > tau).any() and (logits < tau).any()
    _, _, _, clipped, metrics = one_step(*overrides, f"optimizer.qk_clip.tau={tau}")
    assert_clipped(cfg, logits, tau, plain, clipped, metrics, rtol)


def assert_clipped(cfg, logits, tau, plain, clipped, metrics, rtol):
    """The logged maximum is the reference's; the step with QK-clip is the plain step with each
    head's query and key weights scaled by the reference's maxima (over tau), nothing else."""
    # the logged maximum is the forward pass's (f32: the reference's op order differs)
    np.testing.assert_allclose(metrics["attention/max_logit"], logits.max(), rtol=rtol)
    g = np.where(logits > tau, tau / logits, 1.0)
    grouped = cfg.model.n_kv_heads != cfg.model.n_heads
    q_factor = g if grouped else np.sqrt(g)
    layers_plain, layers_clipped = (
        attention_by_layer(plain, cfg.model),
        attention_by_layer(clipped, cfg.model),
    )
    tol = max(rtol, 2e-5)  # a clip by a 16-bit maximum
    for layer, (a_plain, a_clipped) in enumerate(zip(layers_plain, layers_clipped, strict=True)):
        want_q = a_plain["wq"] * q_factor[layer][None, :, None]
        np.testing.assert_allclose(a_clipped["wq"], want_q, rtol=tol, err_msg=f"layer {layer} wq")
        if grouped:  # a key head serves several query heads: left as the update made it
            np.testing.assert_array_equal(a_clipped["wk"], a_plain["wk"])
        else:
            want_k = a_plain["wk"] * np.sqrt(g[layer])[None, :, None]
            np.testing.assert_allclose(a_clipped["wk"], want_k, rtol=tol, err_msg=f"layer {layer} wk")
    # everything else is the unclipped step's (the clip comes after the update)
    rest = lambda p: [
        v
        for path, v in jax.tree_util.tree_flatten_with_path(p)[0]
        if "'wq'" not in str(path) and "'wk'" not in str(path)
    ]
    for a, b in zip(rest(clipped), rest(plain), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.composes("chat+qk_clip")
def test_a_step_on_packed_chat_rows_clips_by_each_documents_own_logits(tmp_path_factory):
    """Chat data packed in windows (several conversations to a row, positions restarting at
    each): the maxima are over each document's own keys, as the reference masks them."""
    dirs = chatml_token_dirs(tmp_path_factory.mktemp("qk_clip_chat"))
    overrides = (
        _MHA, "model.vocab_size=320", "data.source=tokens", f"data.paths=[{dirs['chat']}]",
        "data.packing=windows", "train.seq_len=64",
    )  # fmt: skip
    cfg, initial, batch, plain, _ = one_step(*overrides)
    assert any(len(set(row) - {0}) > 1 for row in np.asarray(batch["segment_ids"]))  # rows pack documents
    logits = reference_max_logits(
        initial, batch["inputs"], cfg.model, batch["segment_ids"], batch["positions"]
    )
    unmasked = reference_max_logits(initial, batch["inputs"], cfg.model)
    assert not np.allclose(logits, unmasked)  # the documents' boundaries matter here
    tau = tau_between_heads(logits)
    _, _, _, clipped, metrics = one_step(*overrides, f"optimizer.qk_clip.tau={tau}")
    assert_clipped(cfg, logits, tau, plain, clipped, metrics, 1e-5)


@pytest.mark.composes("mla+qk_clip", "muon+qk_clip", "dense+mla")
def test_a_step_clips_the_latent_attention_heads_over_tau():
    """MLA with Muon (MuonClip as Kimi K2 trains): the step's recorded maxima against the
    naive MLA forward, then the clip of the unclipped step's weights by them (no-RoPE query
    and key parts sqrt(g), RoPE query g)."""
    overrides = ("model.n_kv_heads=4", MLA, "optimizer.name=muon")
    cfg, initial, batch, plain, _ = one_step(*overrides)
    logits = reference_mla_max_logits(initial, batch["inputs"], cfg.model)
    tau = float(np.median(logits))
    assert (logits > tau).any() and (logits < tau).any()
    _, _, _, clipped, metrics = one_step(*overrides, f"optimizer.qk_clip.tau={tau}")
    np.testing.assert_allclose(metrics["attention/max_logit"], logits.max(), rtol=1e-5)
    g = np.where(logits > tau, tau / logits, 1.0)[:, None, :, None]  # [layers, 1, heads, 1]
    nope = cfg.model.mla.qk_nope_head_dim
    a_plain, a_clipped = plain["blocks"]["attn"], clipped["blocks"]["attn"]
    q_factor = np.concatenate([np.sqrt(g).repeat(nope, -1), g.repeat(4, -1)], axis=-1)
    kv_factor = np.concatenate([np.sqrt(g).repeat(nope, -1), np.ones_like(g).repeat(8, -1)], axis=-1)
    np.testing.assert_allclose(a_clipped["wq_b"], a_plain["wq_b"] * q_factor, rtol=2e-5)
    np.testing.assert_allclose(a_clipped["wkv_b"], a_plain["wkv_b"] * kv_factor, rtol=2e-5)
    rest = lambda p: [
        v
        for path, v in jax.tree_util.tree_flatten_with_path(p)[0]
        if "'wq_b'" not in str(path) and "'wkv_b'" not in str(path)
    ]
    for a, b in zip(rest(clipped), rest(plain), strict=True):  # wkv_a (the RoPE key) among them
        np.testing.assert_array_equal(a, b)


def test_the_cli_logs_the_largest_logit(tmp_path):
    """`jaxtrain train ... optimizer.qk_clip.tau=...` writes attention/max_logit every step."""
    import json
    import os

    from jaxtrain.cli import main
    from tests.conftest import REPO

    code = main(
        [
            "train",
            os.path.join(REPO, "configs", "tiny.yaml"),
            f"output_dir={tmp_path}",
            "train.steps=2",
            "mesh.data=8",  # the test process's 8 devices
            "model.d_model=32",
            "model.mlp_dim=64",
            "train.seq_len=16",
            "optimizer.name=muon",
            "optimizer.qk_clip.tau=0.5",
            "logging.progress=false",
            "logging.tensorboard=false",
        ]
    )
    assert code in (0, None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logits = [r["attention/max_logit"] for r in records if "loss" in r]
    assert len(logits) == 2 and all(x > 0 for x in logits), records


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.qk_norm=head",), "model.qk_norm='head'"),
        (("model.lora={rank: 2, targets: [wq]}",), "model.lora"),
    ],
)
def test_qk_clip_refuses_what_it_cannot_clip(overrides, message):
    with pytest.raises(ConfigError) as e:
        tiny_config(None, "optimizer.qk_clip.tau=50", *overrides)
    assert message in str(e.value) and "optimizer.qk_clip.tau=50" in str(e.value)
