"""Attention of one sequence block to another, and the merge of partial results:
the building blocks of ring attention (``ring_attention``) and chunked attention
(``chunked``).

A block is a (q chunk, kv chunk) pair of equal length. Its compute is the
Pallas flash kernels on GPU/TPU (their forward, dQ and dK/dV calls with
separate q-side and kv-side segment ids: the Triton / Mosaic TPU kernels of
``flash_attention``, or on Hopper with ``gpu_kernel='mosaic'`` those of
``flash_mgpu``) or an XLA block on CPU; all return
the block's output and log-sum-exp, so partial results over disjoint key sets
merge exactly. A pair is ``diagonal`` when q and kv are the same chunk (causal
mask inside it); off-diagonal pairs that are computed are fully visible, unless a
causal sliding window (``BlockConfig.window``) reaches back only part of the way:
then a pair is computed at its *distance* (how many chunks the kv chunk lies before
the q chunk, in sequence order) with the window mask shifted by that many chunk
lengths, and pairs beyond the window's reach are skipped. The distance is a Python
int where the pairs are static (chunked attention) and a traced one in the ring,
where it depends on the shard and the step; there a ``lax.switch`` picks among the
few distances a window can reach (``window_reach``).

Chunks are read with dynamic slices of a shard's buffers and results
accumulated with dynamic_update_slice, which XLA does in place: no
split/concatenate copies and no select over whole chunks, so per-device memory
is a fixed number of shard-sized buffers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxtrain.pallas_kernels.flash_attention import (
    BlockSizes,
    FlashConfig,
    flash_config,
    flash_dkv_call,
    flash_dq_call,
    flash_fused_bwd_call,
    flash_fwd_call,
    from_kernel_layout,
    matmul_precision,
    resolve_block_sizes,
    to_kernel_layout,
)

__all__ = [
    "BlockConfig",
    "block_bwd",
    "block_fwd",
    "bwd_pairs",
    "chunk",
    "empty_output",
    "flash_block_config",
    "fwd_pairs",
    "merge",
    "mgpu_block_config",
    "put",
    "softmax_delta",
    "with_sinks",
    "zero_grads",
]

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Static description of the blocks one attention call computes (hashable)."""

    backend: str  # cpu -> XLA block; tpu/gpu -> flash kernels
    scale: float
    chunk: int  # chunk length (q and kv)
    q_heads: int
    kv_heads: int
    head_dim: int
    block_sizes: BlockSizes | None
    interpret: bool
    use_flash: bool  # False: XLA block (CPU default)
    softcap: float | None = None  # logit cap c: scores -> c * tanh(scores / c) before the mask
    window: int | None = None  # causal sliding window, in sequence order (see the module doc)
    gpu_kernel: str = "triton"  # flash blocks on GPU: 'triton' or 'mosaic' (flash_mgpu, Hopper)
    v_head_dim: int | None = None  # v's head dim where it differs from q/k's (MLA); None: head_dim

    @property
    def window_reach(self) -> int:
        """The farthest chunk distance at which a query still sees a key (0 without a window:
        unused then). Distance d holds pairs d * chunk - (chunk - 1) positions apart at the
        closest, visible while that is under the window."""
        if self.window is None:
            return 0
        return -(-(self.window + self.chunk - 1) // self.chunk) - 1


# ----------------------------------------------------------------------------
# XLA blocks (materialised chunk x chunk scores).
# ----------------------------------------------------------------------------


def _xla_scores(spec: BlockConfig, q, k, q_seg, k_seg, diagonal, distance=0):
    """(masked scores [b, kv, g, q, t] f32, the softcap's derivative or None), as the flash
    kernels' ``_scores``; ``distance``: the static chunk distance (windowed pairs)."""
    b, c, h, d = q.shape
    g = spec.q_heads // spec.kv_heads
    qg = q.reshape(b, c, spec.kv_heads, g, d)
    s = (
        jnp.einsum(
            "bqkgd,btkd->bkgqt",
            qg,
            k,
            preferred_element_type=jnp.float32,
            precision=matmul_precision(q.dtype),
        )
        * spec.scale
    )
    dcap = None
    if spec.softcap is not None:
        t = jnp.tanh(s / spec.softcap)
        s, dcap = spec.softcap * t, 1.0 - t * t
    mask = None
    qpos = jnp.arange(c)[:, None] + distance * spec.chunk
    kpos = jnp.arange(k.shape[1])[None, :]
    if diagonal:
        mask = (qpos >= kpos)[None, None, None]
    if spec.window is not None:
        inside = (kpos > qpos - spec.window)[None, None, None]
        mask = inside if mask is None else mask & inside
    if q_seg is not None:
        seg = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        mask = seg if mask is None else mask & seg
    return (s if mask is None else jnp.where(mask, s, _NEG_INF)), dcap


def _xla_fwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, distance=0):
    s, _ = _xla_scores(spec, q, k, q_seg, k_seg, diagonal, distance)  # [b, kv, g, q, t]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = (
        jnp.einsum("bkgqt,btkd->bqkgd", p, v.astype(jnp.float32), precision=matmul_precision(q.dtype))
        / jnp.moveaxis(jnp.where(l > 0, l, 1.0), -2, 1)[..., 0][..., None]
    )
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)[..., 0]
    b, c = q.shape[:2]
    return o.reshape(b, c, spec.q_heads, v.shape[-1]), lse.reshape(b, spec.q_heads, c)


def _xla_bwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, lse, do, delta, distance=0):
    b, c, h, d = q.shape
    g = spec.q_heads // spec.kv_heads
    prec = matmul_precision(q.dtype)
    s, dcap = _xla_scores(spec, q, k, q_seg, k_seg, diagonal, distance)
    lse_g = lse.reshape(b, spec.kv_heads, g, c)[..., None]
    p = jnp.exp(s - lse_g)  # [b, kv, g, q, t]
    dog = do.astype(jnp.float32).reshape(b, c, spec.kv_heads, g, v.shape[-1])
    dv = jnp.einsum("bkgqt,bqkgd->btkd", p, dog, precision=prec)
    dp = jnp.einsum("bqkgd,btkd->bkgqt", dog, v.astype(jnp.float32), precision=prec)
    ds = p * (dp - delta.reshape(b, spec.kv_heads, g, c)[..., None]) * spec.scale
    if dcap is not None:
        ds = ds * dcap
    dq = jnp.einsum("bkgqt,btkd->bqkgd", ds, k.astype(jnp.float32), precision=prec)
    dk = jnp.einsum(
        "bkgqt,bqkgd->btkd", ds, q.astype(jnp.float32).reshape(b, c, spec.kv_heads, g, d), precision=prec
    )
    return dq.reshape(q.shape), dk, dv


# ----------------------------------------------------------------------------
# Flash blocks (the Pallas kernels on one chunk pair).
# ----------------------------------------------------------------------------


def flash_block_config(spec: BlockConfig, diagonal: bool, dtype, distance: int = 0) -> FlashConfig:
    """The flash kernels' configuration for one chunk pair: no padding (the chunk
    must be a multiple of every block), causal inside diagonal pairs only, the window
    shifted by ``distance`` chunks (``FlashConfig.q_offset``).
    ValueError when the chunk does not fit (blocks, or TPU VMEM)."""
    dims = (spec.head_dim, spec.v_head_dim or spec.head_dim)
    blocks = resolve_block_sizes(spec.block_sizes, spec.backend, spec.chunk, max(dims), dtype)
    for b in blocks.as_tuple():
        if spec.chunk % b:
            raise ValueError(
                f"ring attention chunk length {spec.chunk} (seq / (context shards"
                f" * chunks per shard)) must be a multiple of the flash block {b}"
            )
    return flash_config(
        backend=spec.backend,
        seq_pad=spec.chunk,
        blocks=blocks,
        dtype=dtype,
        softcap=spec.softcap,
        v_head_dim=spec.v_head_dim,
        **_pair_geometry(spec, diagonal, distance),
    )


def _pair_geometry(spec: BlockConfig, diagonal: bool, distance: int) -> dict:
    """What both kernel families' configs take of one chunk pair: causal inside diagonal pairs
    only, the window shifted by ``distance`` chunks (q_offset), one unpadded chunk each side."""
    return dict(
        interpret=spec.interpret,
        causal=diagonal,
        window=spec.window,
        scale=spec.scale,
        seq_len=spec.chunk,
        head_dim=spec.head_dim,
        q_heads=spec.q_heads,
        kv_heads=spec.kv_heads,
        q_offset=distance * spec.chunk,
    )


def _flash_fwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, distance=0):
    cfg = flash_block_config(spec, diagonal, q.dtype, distance)
    qk, kk, vk = (to_kernel_layout(x, cfg) for x in (q, k, v))
    ok, lse = flash_fwd_call(qk, kk, vk, q_seg, k_seg, cfg)
    o = from_kernel_layout(ok, cfg, cfg.q_heads)
    return o, lse.reshape(q.shape[0], cfg.q_heads, cfg.seq_pad)


def _flash_bwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, lse, do, delta, distance=0):
    """dQ, dK, dV in f32 (they are accumulated over blocks); dK/dV summed over GQA groups."""
    cfg = flash_block_config(spec, diagonal, q.dtype, distance)
    g = cfg.group
    batch = q.shape[0]
    qk, kk, vk, dok = (to_kernel_layout(x, cfg) for x in (q, k, v, do.astype(q.dtype)))
    args = (qk, kk, vk, dok, lse, delta, q_seg, k_seg, cfg)
    if cfg.fused_bwd:  # one kernel, 5 matmuls per block instead of 3 + 4 (BlockSizes.fused_bwd)
        dq, dk, dv = flash_fused_bwd_call(*args, out_dtype=jnp.float32, dq_dtype=jnp.float32)
    else:
        dq = flash_dq_call(*args, out_dtype=jnp.float32)
        dk, dv = flash_dkv_call(*args, out_dtype=jnp.float32)
    dq = from_kernel_layout(dq, cfg, cfg.q_heads)
    dk = from_kernel_layout(dk, cfg, cfg.q_heads)
    dv = from_kernel_layout(dv, cfg, cfg.q_heads)
    if g > 1:
        dk = dk.reshape(batch, cfg.seq_pad, cfg.kv_heads, g, -1).sum(axis=3)
        dv = dv.reshape(batch, cfg.seq_pad, cfg.kv_heads, g, -1).sum(axis=3)
    return dq, dk, dv


def mgpu_block_config(spec: BlockConfig, diagonal: bool, distance: int = 0):
    """The Hopper kernels' configuration for one chunk pair (as ``flash_block_config``):
    ValueError when the chunk is not a multiple of their tile (``flash_mgpu.seq_tile``)."""
    from jaxtrain.pallas_kernels.flash_mgpu import mgpu_config, seq_tile

    tile = seq_tile(spec.head_dim)
    if spec.chunk % tile:
        raise ValueError(
            f"ring attention chunk length {spec.chunk} (seq / (context shards * chunks per shard))"
            f" must be a multiple of {tile}, the Hopper flash kernel's tile (gpu_kernel='mosaic')"
        )
    return mgpu_config(**_pair_geometry(spec, diagonal, distance))


def _segments(q_seg, k_seg):
    return None if q_seg is None else (q_seg, k_seg)


def _mgpu_fwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, distance=0):
    from jaxtrain.pallas_kernels.flash_mgpu import mgpu_fwd

    return mgpu_fwd(q, k, v, _segments(q_seg, k_seg), mgpu_block_config(spec, diagonal, distance))


def _mgpu_bwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, lse, do, delta, distance=0):
    """dQ, dK, dV (dK/dV summed over the GQA group inside the kernel) in f32 for the ring's
    accumulators; the kernels write them in q's dtype."""
    from jaxtrain.pallas_kernels.flash_mgpu import mgpu_bwd

    cfg = mgpu_block_config(spec, diagonal, distance)
    grads = mgpu_bwd(q, k, v, _segments(q_seg, k_seg), lse, delta, do.astype(q.dtype), cfg)
    return tuple(g.astype(jnp.float32) for g in grads)


def _block_fns(spec: BlockConfig):
    """(forward, backward) of one block: XLA, or the flash kernels of ``spec.gpu_kernel``'s
    family."""
    if not spec.use_flash:
        return _xla_fwd, _xla_bwd
    if spec.gpu_kernel == "mosaic":
        return _mgpu_fwd, _mgpu_bwd
    return _flash_fwd, _flash_bwd


# ----------------------------------------------------------------------------
# Block compute, merge, and accumulation over chunk pairs.
# ----------------------------------------------------------------------------


def _at_distance(spec: BlockConfig, diagonal, distance, compute, skip):
    """compute(static distance) for a pair ``distance`` chunks apart, skip() where the window
    cannot reach; a ``lax.switch`` over the reachable distances when ``distance`` is traced."""
    if spec.window is None or diagonal:
        return compute(0)
    reach = spec.window_reach
    if isinstance(distance, int):
        return compute(distance) if 1 <= distance <= reach else skip()
    branches = [skip] + [lambda d=d: compute(d) for d in range(1, reach + 1)]
    return lax.switch(jnp.where((distance >= 1) & (distance <= reach), distance, 0), branches)


def block_fwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, distance=0):
    """(out [b, c, h, d], lse [b, h, c] f32) of q attending to k, v (one chunk each), the kv
    chunk ``distance`` chunks before q's (used by a window only)."""
    fn = _block_fns(spec)[0]
    b, c = q.shape[:2]
    o_dtype = q.dtype if spec.use_flash else jnp.float32  # as the block's own output
    o_shape = (b, c, spec.q_heads, v.shape[-1])
    nothing = lambda: (jnp.zeros(o_shape, o_dtype), jnp.full((b, spec.q_heads, c), _NEG_INF, jnp.float32))
    return _at_distance(
        spec, diagonal, distance, lambda d: fn(spec, q, k, v, q_seg, k_seg, diagonal, d), nothing
    )


def block_bwd(spec: BlockConfig, q, k, v, q_seg, k_seg, diagonal, lse, do, delta, distance=0):
    """(dq, dk, dv) f32 of one block, given the full (merged) lse and delta of its queries."""
    fn = _block_fns(spec)[1]
    nothing = lambda: tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    return _at_distance(
        spec,
        diagonal,
        distance,
        lambda d: fn(spec, q, k, v, q_seg, k_seg, diagonal, lse, do, delta, d),
        nothing,
    )


def merge(o, lse, o_b, lse_b):
    """Combine two normalised partial attentions over disjoint key sets."""
    new = jnp.logaddexp(lse, lse_b)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)
    w = lambda l: jnp.moveaxis(jnp.exp(l - ref), 1, 2)[..., None]  # [b, c, h, 1]
    return o * w(lse) + o_b.astype(jnp.float32) * w(lse_b), new


# A pair is (q chunk index, kv chunk index, diagonal); an index is a Python int
# or a traced int32 scalar (the ring picks some by the step's relation). ``distance``
# (qi, ki) -> how many chunks kv chunk ki lies before q chunk qi in sequence order (an
# int or traced); only a window reads it.


def chunk(x, idx, size, axis=1):
    """Chunk ``idx`` of length ``size`` along ``axis`` (None passes through)."""
    if x is None:
        return None
    if isinstance(idx, int):
        return lax.slice_in_dim(x, idx * size, (idx + 1) * size, axis=axis)
    return lax.dynamic_slice_in_dim(x, idx * size, size, axis=axis)


def put(acc, idx, size, val, axis=1):
    """``acc`` with chunk ``idx`` replaced by ``val`` (in place for XLA)."""
    if isinstance(idx, int):
        idx = jnp.int32(idx)
    return lax.dynamic_update_slice_in_dim(acc, val.astype(acc.dtype), idx * size, axis=axis)


def _no_distance(qi, ki):
    return 0


def fwd_pairs(block: BlockConfig, pairs, c, q, seg, kv, acc, distance=_no_distance):
    """Attend q's chunks to kv = (k, v, kv segment ids)'s chunks for each (q chunk,
    kv chunk, diagonal) pair, merging into acc = (o f32, lse) in place."""
    ks, vs, ksegs = kv
    o, lse = acc
    for qi, ki, diagonal in pairs:
        o_b, lse_b = block_fwd(
            block,
            chunk(q, qi, c),
            chunk(ks, ki, c),
            chunk(vs, ki, c),
            chunk(seg, qi, c),
            chunk(ksegs, ki, c),
            diagonal,
            distance(qi, ki),
        )
        o_a, lse_a = merge(chunk(o, qi, c), chunk(lse, qi, c, axis=2), o_b, lse_b)
        o, lse = put(o, qi, c, o_a), put(lse, qi, c, lse_a, axis=2)
    return o, lse


def bwd_pairs(block: BlockConfig, pairs, c, q, seg, kv, lse, do, delta, grads, distance=_no_distance):
    """The backward of fwd_pairs: adds each pair's dQ to its q chunk and dK/dV to its
    kv chunk of grads = (dq, dk, dv) f32, in place."""
    ks, vs, ksegs = kv
    dq, dk, dv = grads
    for qi, ki, diagonal in pairs:
        gq, gk, gv = block_bwd(
            block,
            chunk(q, qi, c),
            chunk(ks, ki, c),
            chunk(vs, ki, c),
            chunk(seg, qi, c),
            chunk(ksegs, ki, c),
            diagonal,
            chunk(lse, qi, c, axis=2),
            chunk(do, qi, c),
            chunk(delta, qi, c, axis=2),
            distance(qi, ki),
        )
        dq = put(dq, qi, c, chunk(dq, qi, c) + gq)
        dk = put(dk, ki, c, chunk(dk, ki, c) + gk)
        dv = put(dv, ki, c, chunk(dv, ki, c) + gv)
    return dq, dk, dv


def empty_output(q, v_head_dim=None):
    """(o, lse) accumulators before any key: zeros and -inf (o with ``v_head_dim``, None: q's)."""
    b, L, h, d = q.shape
    d = d if v_head_dim is None else v_head_dim
    return jnp.zeros((b, L, h, d), jnp.float32), jnp.full((b, h, L), _NEG_INF, jnp.float32)


def with_sinks(o, lse, sinks):
    """(o, lse) [b, L, h, d] f32 / [b, h, L] of a softmax over every key, with each head's sink
    logit ([h]) added to the denominator: lse' = logaddexp(lse, sink), o' = o exp(lse - lse')
    (a query that saw no key: lse' = sink, o' = 0). The backward then runs on (o', lse') as
    usual, and the sinks' gradient is ``flash_attention.sink_grad``."""
    if sinks is None:
        return o, lse
    new = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
    return o * jnp.moveaxis(jnp.exp(lse - new), 1, 2)[..., None], new


def zero_grads(q, k, v):
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))


def softmax_delta(o, do):
    """rowsum(dO * O) per query, [b, h, L] f32: the softmax backward's correction term."""
    return jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
