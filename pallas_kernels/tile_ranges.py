"""Which key blocks a query tile visits, and which query blocks a key tile visits, in the flash
kernels: the block skipping for causal masks, sliding windows and padding, written once for the
Triton/Mosaic TPU kernels (flash_attention.py), the Hopper kernels (flash_mgpu.py) and their cost
estimates.

``cfg`` is any object with ``causal``, ``window`` (int or None), ``seq_len`` (valid length) and
``q_offset`` (the position of query 0 relative to key 0): both kernels' configs have them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["JNP_OPS", "PY_OPS", "Ops", "position_mask", "ranges_for_kv_tile", "ranges_for_q_tile"]


@dataclasses.dataclass(frozen=True)
class Ops:
    div: Any
    max: Any
    min: Any


# Non-negative integer arithmetic on traced scalars (inside kernels) or on
# Python ints (cost estimates), so both use the same range formulas.
JNP_OPS = Ops(div=lax.div, max=jnp.maximum, min=jnp.minimum)
PY_OPS = Ops(div=lambda a, b: a // b, max=max, min=min)


def ranges_for_q_tile(cfg, q0, bq: int, bk: int, ops: Ops = JNP_OPS):
    """For the query tile [q0, q0+bq): kv block ranges (lo, full_lo, full_hi, hi).

    Blocks in [lo, hi) hold at least one allowed (query, key) pair (segments
    aside; blocks of only padded keys are excluded); blocks in [full_lo, full_hi)
    need no position mask at all.
    """
    q0 = q0 + cfg.q_offset  # positions from here on
    cdiv = lambda a, b: ops.div(a + (b - 1), b)
    n_valid = -(-cfg.seq_len // bk)
    w = cfg.window
    # Last allowed key of the tile's last query, first allowed key of its first query.
    if cfg.causal:
        hi = ops.min(cdiv(q0 + bq, bk), n_valid)
    elif w is not None:
        hi = ops.min(cdiv(q0 + bq - 1 + w, bk), n_valid)
    else:
        hi = n_valid
    lo = ops.div(ops.max(q0 - w + 1, 0), bk) if w is not None else 0 * q0
    # Fully allowed blocks: every key <= every query (causal), inside the window
    # for every query, and no padded key.
    full_hi = cfg.seq_len // bk
    if cfg.causal:
        full_hi = ops.min(ops.div(q0 + 1, bk), full_hi)
    elif w is not None:
        full_hi = ops.min(ops.div(q0 + w, bk), full_hi)
    full_lo = cdiv(ops.max(q0 + bq - w, 0), bk) if w is not None else 0 * q0
    full_lo = ops.min(ops.max(full_lo, lo), hi)
    full_hi = ops.min(ops.max(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def ranges_for_kv_tile(cfg, k0, bk: int, bq: int, ops: Ops = JNP_OPS):
    """For the key tile [k0, k0+bk): query block ranges (lo, full_lo, full_hi, hi)."""
    cdiv = lambda a, b: ops.div(ops.max(a, 0) + (b - 1), b)  # of a query index, never < 0
    n_valid = -(-cfg.seq_len // bq)
    w = cfg.window
    # The key's position less the queries' offset: query index i sits at position i + offset.
    k0 = k0 - cfg.q_offset
    # First query that may see a key of this tile, last one.
    if cfg.causal:
        lo = ops.div(ops.max(k0, 0), bq)
    elif w is not None:
        lo = ops.div(ops.max(k0 - w + 1, 0), bq)
    else:
        lo = 0 * k0
    if w is not None:
        hi = ops.min(cdiv(k0 + bk - 1 + w, bq), n_valid)
    else:
        hi = n_valid + 0 * k0
    # Fully allowed q blocks. Padded queries need no mask here: their dO is 0 and
    # their LSE is +inf, so they contribute exactly 0 to dK and dV.
    if cfg.causal:
        full_lo = cdiv(k0 + bk - 1, bq)
    elif w is not None:
        full_lo = cdiv(k0 + bk - w, bq)
    else:
        full_lo = lo
    full_hi = ops.div(ops.max(k0 + w, 0), bq) if w is not None else hi
    full_lo = ops.min(ops.max(full_lo, lo), hi)
    full_hi = ops.min(ops.max(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


def position_mask(cfg, qpos, kpos):
    """Causal / window / key-padding mask of a tile, from its query and key positions (arrays of
    the tile's shape, in whichever layout the kernel keeps; ``cfg`` also needs ``seq_pad``);
    None where every pair is allowed. Used on the edge blocks the ranges above call masked."""
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if cfg.causal:
        mask = _and(mask, kpos <= qpos)
    if cfg.window is not None:
        mask = _and(mask, kpos > qpos - cfg.window)
        if not cfg.causal:
            mask = _and(mask, kpos < qpos + cfg.window)
    if cfg.seq_pad != cfg.seq_len:
        mask = _and(mask, kpos < cfg.seq_len)
    return mask
