"""The NNX transformer against an independent naive jnp Llama (tests/reference_llama.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models
from tests.reference_llama import forward as reference_forward

SMALL = models.ModelConfig(
    vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96, rope_theta=500.0
)
F32_TOL = dict(rtol=2e-5, atol=2e-5)  # f32, different op order than the reference


def build(cfg, seed=0):
    model = models.Transformer(cfg, rngs=nnx.Rngs(seed))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def tokens(b=2, s=24, vocab=97, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, s), 0, vocab)


@pytest.mark.parametrize("kv_heads,tie", [(4, False), (2, True), (1, False)], ids=["mha", "gqa-tied", "mqa"])
def test_logits_match_reference(kv_heads, tie):
    cfg = dataclasses.replace(SMALL, n_kv_heads=kv_heads, tie_embeddings=tie)
    model, params = build(cfg)
    tok = tokens()
    np.testing.assert_allclose(model(tok), reference_forward(params, tok, cfg), **F32_TOL)


@pytest.mark.composes("dense+sinks", "sinks+qk_norm", "sinks+final_softcap", "qk_norm+final_softcap")
def test_sinks_qk_norm_layer_pattern_and_softcap_match_the_reference():
    """A dense model with every layer feature at once (GPT-OSS's sinks, Qwen3's query/key norms,
    Gemma's local/global pattern and final softcap) on packed rows against the naive forward;
    sinks and norm scales drawn at random (they start at 0 and 1, which would hide a scale
    applied twice or a sink dropped)."""
    cfg = dataclasses.replace(
        SMALL,
        n_layers=4,
        attention_sinks=True,
        qk_norm="head",
        attention_pattern=("local", "global"),
        sliding_window=5,
        final_softcap=0.2,  # the tiny model's logits are a few tenths: this one bends them
    )
    model, params = build(cfg)
    rng = np.random.default_rng(0)
    for group in params["blocks"].values():
        attn = group["attn"]
        attn["sinks"] = jnp.asarray(rng.normal(size=attn["sinks"].shape), jnp.float32)
        for norm in ("q_norm", "k_norm"):
            shape = attn[norm]["scale"].shape
            attn[norm]["scale"] = jnp.asarray(1 + 0.5 * rng.normal(size=shape), jnp.float32)
    nnx.update(model, params)
    tok = tokens(b=2, s=16)
    segments = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
    positions = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
    got = model(tok, positions=positions, segment_ids=segments)
    want = reference_forward(params, tok, cfg, positions=positions, segment_ids=segments)
    np.testing.assert_allclose(got, want, **F32_TOL)
    uncapped = reference_forward(
        params, tok, dataclasses.replace(cfg, final_softcap=None), positions=positions, segment_ids=segments
    )
    assert np.abs(np.asarray(uncapped) - np.asarray(want)).max() > 0.05  # the cap matters here


def test_param_count_matches_built_model():
    for cfg in (SMALL, dataclasses.replace(SMALL, tie_embeddings=True, head_dim=8)):
        _, params = build(cfg)
        assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()


def test_causal_future_tokens_do_not_change_past_logits():
    model, _ = build(SMALL)
    tok = tokens(b=1, s=16)
    changed = tok.at[:, 10:].set((tok[:, 10:] + 1) % SMALL.vocab_size)
    a, b = model(tok), model(changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], **F32_TOL)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_packed_segments_equal_separate_documents():
    """Two documents packed in one row (segment ids, positions restarting) give the
    same logits as each document alone."""
    model, _ = build(SMALL)
    doc_a, doc_b = tokens(b=1, s=10, seed=2), tokens(b=1, s=14, seed=3)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    seg = jnp.array([[1] * 10 + [2] * 14])
    pos = jnp.array([list(range(10)) + list(range(14))])
    out = model(packed, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(out[:, :10], model(doc_a), **F32_TOL)
    np.testing.assert_allclose(out[:, 10:], model(doc_b), **F32_TOL)


@pytest.mark.composes("dense+remat")
def test_remat_and_unrolled_layers_change_nothing():
    tok = tokens()
    _, params = build(SMALL)

    def loss_and_grad(cfg):
        model, _ = build(cfg)
        gd, state = nnx.split(model)

        def loss(p):
            return jnp.mean(models.merge(gd, state, p)(tok) ** 2)

        return jax.value_and_grad(loss)(params)

    base_loss, base_grads = loss_and_grad(SMALL)
    for variant in (dict(remat="full"), dict(remat="save_matmuls"), dict(scan_layers=False)):
        loss, grads = loss_and_grad(dataclasses.replace(SMALL, **variant))
        np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, base_grads)


REMAT_VARIANTS = [dict(remat=p) for p in models.config.REMAT_POLICIES if p not in ("none", "custom")] + [
    dict(remat="custom"),  # nothing named: recompute all
    dict(remat="custom", remat_custom={"qkv_proj": "offload", "context": "device", "mlp_out": "recompute"}),
    dict(remat="custom", remat_custom={"layer_input": "offload", "mlp_in": "offload", "out_proj": "device"}),
]
REMAT_MOE = dataclasses.replace(
    SMALL,
    n_layers=2,
    moe=models.MoEConfig(num_experts=4, top_k=2, first_dense_layers=1, num_shared_experts=1),
)


def _also_on_moe(variant) -> bool:
    """The name-based policies that keep or offload run on REMAT_MOE too."""
    return variant["remat"] in ("minimal", "offload_matmuls", "save_except_mlp_in") or bool(
        variant.get("remat_custom")
    )


@functools.cache
def _remat_loss_and_grads(cfg):
    tok = tokens()
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))  # same parameters whatever the policy
    gd, state = nnx.split(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss = lambda p: jnp.mean(models.merge(gd, state, p)(tok) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.composes("dense+remat")
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(v, marks=pytest.mark.composes("moe+remat")) if _also_on_moe(v) else v
        for v in REMAT_VARIANTS
    ],
    ids=lambda v: "-".join(map(str, v.values())),
)
def test_every_remat_policy_gives_the_gradients_of_none(variant):
    """Named activation checkpoints: whatever a policy keeps, offloads or recomputes, the
    f32 loss and gradients equal those without remat (1e-6); dense layers for every
    policy, a dense + MoE stack for the name-based ones that keep or offload."""
    bases = [SMALL, REMAT_MOE] if _also_on_moe(variant) else [SMALL]
    for base in bases:
        base_loss, base_grads = _remat_loss_and_grads(base)
        loss, grads = _remat_loss_and_grads(dataclasses.replace(base, **variant))
        np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), grads, base_grads)


def test_remat_policy_table_matches_the_config_names():
    from jaxtrain.models.transformer import remat_policy

    for name in models.config.REMAT_POLICIES:
        cfg = dataclasses.replace(SMALL, remat=name)
        assert (remat_policy(cfg) is None) == (name == "none")


@pytest.mark.parametrize(
    "custom,match",
    [
        ({"qkv": "offload"}, "model.remat_custom.qkv: unknown checkpoint name"),
        ({"qkv_proj": "host"}, "model.remat_custom.qkv_proj='host': expected one of"),
    ],
)
def test_remat_custom_bad_names_are_config_errors(custom, match):
    from jaxtrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.remat=custom"] + [f"model.remat_custom.{k}={v}" for k, v in custom.items()])
    with pytest.raises(ConfigError, match="expected model.remat=custom"):
        load_config(None, ["model.remat=full", "model.remat_custom.qkv_proj=offload"])


@pytest.mark.composes("dense+bf16")
def test_bf16_compute_close_to_f32():
    model32, params = build(SMALL)
    model16, _ = build(dataclasses.replace(SMALL, compute_dtype="bfloat16"))
    tok = tokens()
    out16 = model16(tok)
    assert out16.dtype == jnp.bfloat16
    # bf16 has an 8-bit mantissa: 2e-2 relative to the logit scale.
    scale = float(jnp.max(jnp.abs(model32(tok))))
    assert float(jnp.max(jnp.abs(out16.astype(jnp.float32) - model32(tok)))) <= 2e-2 * scale


def test_every_parameter_has_logical_axes():
    _, state = models.abstract_model(lambda: models.Transformer(SMALL, rngs=nnx.Rngs(0)))
    axes = models.logical_axes(state)
    shapes = nnx.to_pure_dict(state)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes = jax.tree.leaves(shapes)
    assert len(flat_axes) == len(flat_shapes)
    for ax, x in zip(flat_axes, flat_shapes):
        assert len(ax) == len(x.shape) and all(isinstance(a, str) for a in ax)
    assert axes["blocks"]["attn"]["wq"] == ("layers", "embed", "heads", "head_dim")


@pytest.mark.parametrize(
    "field,value",
    [
        ("n_kv_heads", 3),
        ("d_model", 66),
        ("remat", "some"),
        ("attention_impl", "cuda"),
        ("compute_dtype", "int8"),
    ],
)
def test_bad_model_config_names_the_key(field, value):
    with pytest.raises(ValueError, match=f"model.{field}" if field != "d_model" else "model.d_model"):
        dataclasses.replace(SMALL, **{field: value}).validate()


def test_tokens_must_be_2d():
    model, _ = build(SMALL)
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((4,), jnp.int32))
