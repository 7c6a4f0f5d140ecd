"""The inputs of the gated delta rule as its jnp references (models/gated_deltanet.py) and its
Pallas kernels (gated_delta.py) both take them: checked, in float32, key heads repeated over
value heads, q scaled; the initial state; where each token continues its document. One
definition, so the kernels and the references cannot drift apart; jax and numpy only, as the
kernel room requires."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["CHUNK_SIZE", "L2_NORM_EPS", "continues", "initial_state", "l2_normalize", "prepare"]

CHUNK_SIZE = 64  # flash-linear-attention's and transformers' chunk
L2_NORM_EPS = 1e-6  # transformers' l2norm (as the fla kernels): x * rsqrt(sum(x^2) + eps)


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' and fla's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel):
    """Checked, float32, key heads repeated over value heads, q scaled by dk ** -0.5."""
    if q.shape != k.shape or q.ndim != 4:
        raise ValueError(f"q {q.shape} and k {k.shape}: expected equal [batch, seq, k_heads, dk]")
    if v.ndim != 4 or v.shape[:2] != k.shape[:2] or v.shape[2] % k.shape[2]:
        raise ValueError(f"v {v.shape}: expected [batch, seq, v_heads (a multiple of {k.shape[2]}), dv]")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g {g.shape} and beta {beta.shape}: expected {v.shape[:3]}")
    groups = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(x, groups, axis=2).astype(jnp.float32) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def initial_state(initial_state, q, v):
    shape = (v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state {initial_state.shape}: expected [batch, v_heads, dk, dv] {shape}")
    return initial_state.astype(jnp.float32)


def continues(segment_ids, shape):
    """[batch, seq]: 1 where the token continues the previous token's document (the first
    token continues the initial state), 0 at a document's first token."""
    if segment_ids is None:
        return jnp.ones(shape, jnp.float32)
    if segment_ids.shape != shape:
        raise ValueError(f"segment_ids {segment_ids.shape}: expected [batch, seq] {shape}")
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    return jnp.concatenate([jnp.ones((shape[0], 1), bool), same], axis=1).astype(jnp.float32)
