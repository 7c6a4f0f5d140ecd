"""QK-clip (Kimi K2's MuonClip; `optimizer.qk_clip.tau`): after the optimizer's update, every
attention head whose largest pre-softmax logit in the step's forward pass exceeded tau gets
its query and key weights scaled so that, for the same inputs, that logit would be tau.

With g = tau / max_logit for a head over tau (1 for the others):
  * multi-head attention (a key head per query head): the head's query weights (wq[:, h, :]
    and its bias) and key weights (wk[:, h, :], bias) by sqrt(g) each: the logit q.k by g;
  * grouped KV heads (a key head shared by several query heads): the query head's weights by
    g, the keys untouched (the other query heads sharing them may be under tau).
Multi-head latent attention (MLA: the no-RoPE parts by sqrt(g), the RoPE query by g, the
shared RoPE key untouched) is not implemented here.

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


def clip(params: dict, max_logits: dict, tau: float, cfg: ModelConfig) -> dict:
    """`params` with every recorded attention module's heads clipped (module docstring)."""
    grouped = cfg.n_kv_heads != cfg.n_heads
    out = dict(params)
    for stack, by_path in max_logits.items():
        out[stack] = _replaced(out[stack], by_path, tau, grouped)
    return out


def _replaced(tree: dict, by_path: dict, tau: float, grouped: bool) -> dict:
    tree = dict(tree)
    for path, logits in by_path.items():
        keys = path.split("/")
        node = tree
        for k in keys[:-1]:  # copy the dicts on the way down, so the input is left as it was
            node[k] = dict(node[k])
            node = node[k]
        node[keys[-1]] = clip_attention(node[keys[-1]], logits, tau, grouped)
    return tree
