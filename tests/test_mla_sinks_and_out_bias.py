"""Latent attention (`model.mla`, models/mla.py) with `model.attention_sinks` and
`model.attention_out_bias` (GPT-OSS's features on MLA): the parameters exist, the forward
pass uses them, and the latent KV-cache decode (models/generation.py) does too.

Oracles: float64 numpy written here for the layer (softmax with one sink logit per head in the
denominator and no value, then the output projection plus its bias), from the layer's own
projected q, k, v (`project`, checked against transformers' DeepseekV3Attention in
tests/test_hf.py); the full forward pass for the decode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models
from jaxtrain.models import MLAConfig, Transformer
from jaxtrain.models.generation import decode_step, prefill
from jaxtrain.models.hf import HFConversionError, hf_config
from jaxtrain.models.mla import LatentAttention
from jaxtrain.trainer.optimizer import muon_labels
from tests.conftest import tiny_config

MLA = MLAConfig(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
# f32 against float64 numpy over a few dozen terms; measured ~1e-7 when written
LAYER_ATOL = 1e-5
DECODE_ATOL = 1e-5  # as tests/test_deepseek.py's latent-cache decode


def mla_config(**extra):
    """A tiny dense MLA model (d_model 32, 4 heads, 2 layers) with sinks and the output bias."""
    cfg = tiny_config(
        None, "model.d_model=32", "model.mlp_dim=48", "model.vocab_size=64", "model.n_kv_heads=4"
    )
    model = dataclasses.replace(cfg.model, mla=MLA, attention_sinks=True, attention_out_bias=True, **extra)
    model.validate()
    return model


def with_random_sinks_and_bias(module, seed=0):
    """Sinks ~ N(1, 1) and biases ~ N(0, 1) (both initialise to 0, which would hide a dropped bias)."""
    rng = np.random.default_rng(seed)
    module.sinks[...] = jnp.asarray(1.0 + rng.normal(size=module.sinks[...].shape), jnp.float32)
    module.bo[...] = jnp.asarray(rng.normal(size=module.bo[...].shape), jnp.float32)


def sink_attention_np(q, k, v, sinks, visible, scale):
    """q, k [b, s, H, dqk], v [b, s, H, dv], sinks [H], visible [b, s, s] -> [b, s, H, dv]:
    softmax over (visible scores, the head's sink), the sink's share dropped."""
    x = np.einsum("bshd,bthd->bhst", q, k) * scale
    x = np.where(visible[:, None], x, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (*x.shape[:-1], 1))
    both = np.concatenate([x, sink], axis=-1)
    e = np.exp(both - both.max(axis=-1, keepdims=True))
    p = (e / e.sum(axis=-1, keepdims=True))[..., :-1]
    return np.einsum("bhst,bthd->bshd", p, v)


@pytest.mark.composes("mla+sinks")
def test_latent_attention_with_sinks_and_out_bias_equals_numpy():
    cfg = mla_config()
    attn = LatentAttention(cfg, rngs=nnx.Rngs(0))
    assert attn.sinks[...].shape == (cfg.n_heads,) and attn.bo[...].shape == (cfg.d_model,)
    with_random_sinks_and_bias(attn)
    b, s = 2, 8
    x = jax.random.normal(jax.random.key(1), (b, s, cfg.d_model), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment_ids = jnp.asarray([[1] * 5 + [2] * 3, [1] * 8], jnp.int32)  # row 0 packs two documents
    got = np.asarray(attn(x, positions, segment_ids))

    q, k, v = (np.asarray(t, np.float64) for t in attn.project(x, positions))
    seg = np.asarray(segment_ids)
    visible = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((s, s), bool))[None]
    scale = (MLA.qk_nope_head_dim + MLA.qk_rope_head_dim) ** -0.5
    out = sink_attention_np(q, k, v, np.asarray(attn.sinks[...], np.float64), visible, scale)
    wo, bo = (np.asarray(w, np.float64) for w in (attn.wo[...], attn.bo[...]))
    want = np.einsum("bshv,hvd->bsd", out, wo) + bo
    np.testing.assert_allclose(got, want, atol=LAYER_ATOL)
    # the sinks and the bias matter here (the check above could not pass without them)
    plain = np.einsum(
        "bshv,hvd->bsd", sink_attention_np(q, k, v, np.full(cfg.n_heads, -np.inf), visible, scale), wo
    )
    assert np.max(np.abs(want - bo - plain)) > 100 * LAYER_ATOL and np.max(np.abs(bo)) > 0.1


def test_param_count_labels_and_the_hf_export_refusal():
    """param_count counts the sinks and the bias; both are AdamW's under Muon and never
    decayed; DeepseekV3ForCausalLM has neither, so the export refuses them by name."""
    cfg = mla_config()
    _, state = models.abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(state))) == cfg.param_count()
    labels = muon_labels(models.logical_axes(state))["blocks"]["attn"]
    assert labels["sinks"] == labels["bo"] == "adamw"
    ds = dataclasses.replace(
        cfg,
        moe=models.MoEConfig(num_experts=4, top_k=2, expert_mlp_dim=16, scoring="sigmoid", score_bias=True),
    )
    with pytest.raises(HFConversionError, match="model.attention_sinks .*model.attention_out_bias"):
        hf_config(ds)


@pytest.mark.composes("mla+sinks")
def test_latent_cache_decode_with_sinks_and_out_bias_equals_the_full_forward():
    """Prefill, then decode with the up-projections absorbed (the sinks over the H query heads
    of the one latent key/value head): every position's logits equal the full forward's."""
    cfg = mla_config()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    with_random_sinks_and_bias(model.blocks.attn)
    b, n, p = 2, 10, 4
    tokens = jax.random.randint(jax.random.key(2), (b, n), 0, cfg.vocab_size)
    full = np.asarray(model(tokens))
    logits, cache = prefill(model, tokens[:, :p], jnp.full((b,), p, jnp.int32), n)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, *args: decode_step(nnx.merge(graphdef, state), *args))
    steps = [logits]
    for t in range(p, n - 1):
        logits, cache = step(state, tokens[:, t], jnp.full((b,), t, jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.stack(steps, axis=1), full[:, p - 1 : n - 1], atol=DECODE_ATOL)
