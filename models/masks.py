"""Which keys each query may attend to, and the masked attention scores: shared by the XLA
attention (models/attention.py) and the CPU-tuned one (models/cpu_tuning.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    causal: bool,
    sliding_window: int | None = None,
    q_offset: int = 0,
) -> jax.Array:
    """Boolean `[batch, q_len, kv_len]`: same segment (and causal / in window). The
    queries sit at positions `q_offset ..` of the sequence, the keys at `0 ..`."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    q_pos = q_offset + jnp.arange(q_segment_ids.shape[1])[:, None]
    k_pos = jnp.arange(kv_segment_ids.shape[1])[None, :]
    if causal:
        mask &= (k_pos <= q_pos)[None]
    if sliding_window is not None:
        mask &= (q_pos - k_pos < sliding_window)[None]
        if not causal:
            mask &= (k_pos - q_pos < sliding_window)[None]
    return mask


def softcapped(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), Gemma 2's cap on attention scores and output logits; x if cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def masked_scores(qg, k, mask, scale, softcap=None):
    """Masked f32 scores [b, kv_heads, groups, s, t] of grouped q [b, s, kv_heads, groups, d];
    `softcap`: `softcapped` first (Gemma 2)."""
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    scores = softcapped(scores, softcap)
    return jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
