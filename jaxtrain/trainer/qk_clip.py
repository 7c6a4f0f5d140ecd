"""QK-clip (Kimi K2's MuonClip; `optimizer.qk_clip.tau`): after the optimizer's update, every
attention head whose largest pre-softmax logit in the step's forward pass exceeded tau gets
its query and key weights scaled so that, for the same inputs, that logit would be tau.

With g = tau / max_logit for a head over tau (1 for the others):
  * multi-head attention (a key head per query head): the head's query weights (wq[:, h, :]
    and its bias) and key weights (wk[:, h, :], bias) by sqrt(g) each: the logit q.k by g;
  * grouped KV heads (a key head shared by several query heads): the query head's weights by
    g, the keys untouched (the other query heads sharing them may be under tau);
  * multi-head latent attention (models/mla.py; as the Kimi K2 report does): the head's
    no-RoPE query part (wq or wq_b [..., :nope]) and no-RoPE key part (wkv_b [..., :nope])
    by sqrt(g) each, its RoPE query part (wq or wq_b [..., nope:]) by g; the RoPE key, one
    for all heads (wkv_a's last columns), and the values (wkv_b [..., nope:]) untouched.
    A head's logit, q_nope.k_nope + q_rope.k_rope, is then scaled by g whatever the mix.

The maxima come from the model (models/logit_stats.py: `attention_max_logit`, {stack: {module
path: [layers, heads]}}), so each layer's heads are clipped by their own logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.config import ModelConfig


def head_factors(max_logits: jax.Array, tau: float) -> jax.Array:
    """g per head: tau / max_logit where that exceeds tau, else 1 (float32)."""
    m = max_logits.astype(jnp.float32)
    return jnp.where(m > tau, tau / jnp.maximum(m, tau), 1.0)


def clip_attention(attn: dict, max_logits: jax.Array, tau: float, grouped: bool) -> dict:
    """One stacked attention module's parameters ({wq [layers, d, heads, hd], wk, bq ...}) with
    its heads clipped by `max_logits` [layers, heads] (module docstring)."""
    g = head_factors(max_logits, tau)
    q_factor, k_factor = (g, None) if grouped else (jnp.sqrt(g), jnp.sqrt(g))
    out = dict(attn)

    def scaled(name: str, factor, head_axis: int):
        w = attn[name]
        shape = [1] * w.ndim
        shape[0], shape[head_axis] = factor.shape
        return (w.astype(jnp.float32) * factor.reshape(shape)).astype(w.dtype)

    out["wq"] = scaled("wq", q_factor, 2)  # [layers, d, heads, hd]
    if "bq" in attn:
        out["bq"] = scaled("bq", q_factor, 1)  # [layers, heads, hd]
    if k_factor is not None:
        out["wk"] = scaled("wk", k_factor, 2)
        if "bk" in attn:
            out["bk"] = scaled("bk", k_factor, 1)
    return out


def clip_latent_attention(attn: dict, max_logits: jax.Array, tau: float, nope: int) -> dict:
    """One stacked latent attention module's parameters ({wq [layers, d, heads, nope + rope]
    or wq_b [layers, q_lora, heads, nope + rope], wkv_b [layers, kv_lora, heads, nope + v],
    ...}) with its heads clipped by `max_logits` [layers, heads] (module docstring)."""
    g = head_factors(max_logits, tau)
    out = dict(attn)

    def scaled(name: str, nope_factor, rest_factor):
        """w [layers, in, heads, width] with each head's first `nope` columns times
        nope_factor [layers, heads], the rest times rest_factor."""
        w = attn[name]
        factor = jnp.where(jnp.arange(w.shape[-1]) < nope, nope_factor[..., None], rest_factor[..., None])
        return (w.astype(jnp.float32) * factor[:, None]).astype(w.dtype)

    query = "wq" if "wq" in attn else "wq_b"
    out[query] = scaled(query, jnp.sqrt(g), g)
    out["wkv_b"] = scaled("wkv_b", jnp.sqrt(g), jnp.ones_like(g))
    return out


def clip(params: dict, max_logits: dict, tau: float, cfg: ModelConfig) -> dict:
    """`params` with every recorded attention module's heads clipped (module docstring)."""
    if cfg.mla is not None:
        nope = cfg.mla.qk_nope_head_dim
        clip_module = lambda attn, logits: clip_latent_attention(attn, logits, tau, nope)
    else:
        grouped = cfg.n_kv_heads != cfg.n_heads
        clip_module = lambda attn, logits: clip_attention(attn, logits, tau, grouped)
    out = dict(params)
    for stack, by_path in max_logits.items():
        out[stack] = _replaced(out[stack], by_path, clip_module)
    return out


def _replaced(tree: dict, by_path: dict, clip_module) -> dict:
    tree = dict(tree)
    for path, logits in by_path.items():
        keys = path.split("/")
        node = tree
        for k in keys[:-1]:  # copy the dicts on the way down, so the input is left as it was
            node[k] = dict(node[k])
            node = node[k]
        node[keys[-1]] = clip_module(node[keys[-1]], logits)
    return tree
