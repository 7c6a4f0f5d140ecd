"""Plain-jnp attention: the oracle for the Pallas kernels and the statement of their semantics.

It materialises the full [batch, heads, seq, seq] score matrix, so use it for
tests and small shapes only.

Semantics (shared with ``pallas_kernels.flash_attention``):

* Layout ``[batch, seq, heads, head_dim]`` for q, k and v (as in
  ``jax.nn.dot_product_attention``). k and v may have fewer heads than q
  (GQA / MQA): query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.
* ``scores = softmax_scale * q @ k^T`` with ``softmax_scale`` defaulting to
  ``1 / sqrt(head_dim)``; query i may attend to key j iff every enabled rule holds:
    - ``causal``: ``j <= i``;
    - ``segment_ids`` ([batch, seq] ints): ``segment_ids[i] == segment_ids[j]``;
    - ``sliding_window=w`` (w >= 1): causal: ``i - w < j`` (so at most the last w
      keys, the query itself included); non-causal: ``|i - j| < w`` (a symmetric
      local band of 2w - 1 keys).
  Every query may attend to itself, so no row is ever fully masked.
* ``softcap=c`` (c > 0, Gemma 2's attention-logit softcapping): the scaled scores become
  ``c * tanh(scores / c)`` before the mask.
* v may have a head dim of its own (MLA): the output has v's head dim.
* ``sinks`` ([q_heads], GPT-OSS): each head's logit joins its softmax denominator as one
  more column with no value (exp(sink - max) added to the sum; a sink of 0 still adds).
* Softmax and accumulation in float32; the output has q's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["attention", "attention_mask"]


def attention_mask(
    seq_len: int, *, causal: bool = False, segment_ids=None, sliding_window: int | None = None
):
    """Boolean mask ``[batch or 1, 1, seq, seq]`` (True = may attend), or None if nothing is masked."""
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if causal:
        mask = _and(mask, j <= i)
    if sliding_window is not None:
        mask = _and(mask, j > i - sliding_window)
        if not causal:
            mask = _and(mask, j < i + sliding_window)
    if mask is not None:
        mask = mask[None, None]
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        mask = _and(mask, (seg[:, :, None] == seg[:, None, :])[:, None])
    return mask


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """Reference attention; same arguments and semantics as ``flash_attention``."""
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    group = q_heads // kv_heads
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=hi)
    scores = scores * softmax_scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = attention_mask(seq, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    if sinks is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None], (*scores.shape[:3], 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, vf, precision=hi)
    return out.astype(q.dtype)
