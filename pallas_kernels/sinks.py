"""The gradient of attention sinks (GPT-OSS: one learned logit per head in every softmax's
denominator, with no value), shared by the flash kernels (flash_attention.py, flash_mgpu.py)
and the blockwise paths (ring, chunked): its own module so that neither kernel imports the
other."""

from __future__ import annotations

import jax.numpy as jnp


def sink_grad(sinks, lse, delta):
    """d loss / d sinks [heads] from the LSE (sinks included) and delta = rowsum(dO * O),
    both [batch, heads, seq] (padded queries: LSE +inf). The sink is one more softmax column
    with no value, so its dP is 0 and its dS is P_sink * (0 - delta), P_sink = exp(sink - LSE)."""
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
