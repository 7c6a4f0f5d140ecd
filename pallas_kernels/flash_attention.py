"""FlashAttention forward and backward as Pallas kernels: one source for Mosaic TPU and Triton.

The kernel bodies below are written once. What differs per backend is only the
plumbing around them: default block sizes, ``compiler_params`` (Mosaic TPU
``dimension_semantics``/VMEM limit, Triton ``num_warps``/``num_stages``), the
buffering of whole-sequence blocks, and how ``[batch, seq, heads, head_dim]``
arrays are viewed by the BlockSpecs. Three decisions make a single source work:

* The reduction over the other sequence (KV in the forward and dq kernels, Q in
  the dk/dv kernel) is a loop *inside* the kernel with data-dependent bounds, so
  Triton (whose grid programs run in parallel) and Mosaic (sequential grid)
  both see an embarrassingly parallel grid over (batch, head, block) (the fused
  backward's dQ is the one cross-tile sum; see below). Blocks
  that are entirely masked (causal, sliding window, padding) are never visited;
  blocks that are entirely unmasked skip the position mask.
* The whole K/V (or Q/dO) sequence of one head is a single block. On Triton this
  is just a base pointer; on TPU it is DMA'd to VMEM once per head (single
  buffered), which caps the sequence length per shard by VMEM (checked at the
  door, see ``_check_tpu_vmem``); longer sequences belong to context parallelism.
* Softmax statistics are 2-D: ``[rows, 1]`` columns in the forward and dQ
  kernels, ``[1, cols]`` rows in the dK/dV kernel (which works on transposed
  ``[kv, q]`` tiles so it needs no column). Per-position vectors (LSE, delta,
  segment ids) are stored lane-dense as ``[..., seq/blk, 1, blk]`` and turned
  into columns with a 2-D transpose in-kernel; a ``[..., seq, 1]`` array would
  be padded 128x in TPU HBM.

The forward saves the log-sum-exp (float32, per query); the backward
recomputes probabilities blockwise, either in one fused kernel or in two (dQ,
and dK/dV), always per query head with dK/dV summed over GQA groups in XLA.
Per visited block the forward does 2 matmuls (S, PV); the split backward 3 + 4
(S and dP computed in both kernels), the fused one 5 (S, dP, dV, dK, dQ): 9 vs
7 in all. The fused kernel tiles like dK/dV and adds each block's dQ into a
whole-sequence f32 sum: resident in VMEM along an in-order ("arbitrary") tile
axis on TPU, float atomics into HBM on Triton. ``BlockSizes.fused_bwd``
chooses; by default fused on TPU/CPU, split on GPU (see ``flash_config``). No
``seq x seq`` array exists in HBM in either direction. Semantics are those of
``pallas_kernels.reference.attention``.

Array layout seen by the kernels: ``[B, S, H*D]`` (a free reshape of
``[B, S, H, D]``) on GPU/CPU; ``[B, H, S, D]`` on TPU, whose HBM tiling covers
the two minor dims so a per-head tile of ``[B, S, H, D]`` is not contiguous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels.mesh_utils import device_kind, kernel_backend
from jaxtrain.pallas_kernels.remat_names import ATTENTION_RESIDUALS
from jaxtrain.pallas_kernels.sinks import sink_grad
from jaxtrain.pallas_kernels.tile_ranges import PY_OPS, position_mask, ranges_for_kv_tile, ranges_for_q_tile

__all__ = [
    "KERNEL_MATMULS",
    "BlockSizes",
    "FlashConfig",
    "check_gpu_kernel",
    "check_sinks",
    "check_softcap",
    "check_window",
    "cost_estimates",
    "declared_costs",
    "default_block_sizes",
    "flash_attention",
    "flash_config",
    "flash_dkv_call",
    "flash_dq_call",
    "flash_fused_bwd_call",
    "flash_fwd_call",
    "from_kernel_layout",
    "matmul_precision",
    "resolve_block_sizes",
    "sink_grad",
    "to_kernel_layout",
]

# Finite stand-in for -inf: keeps exp() and max() free of inf - inf = NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# The GPU kernel family: this file's Triton kernels (any GPU), or the Hopper (sm90) kernels of
# flash_mgpu.py written for Pallas' Mosaic GPU backend (wgmma, TMA, warp specialisation).
GPU_KERNELS = ("triton", "mosaic")
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# TPU blocks carry the sequence on the lane axis in some operands (LSE rows,
# segment-id rows), hence multiples of 128 rather than 8.
_TPU_BLOCK_UNIT = 128
_TRITON_MIN_BLOCK = 16  # tl.dot needs every dim >= 16
# VMEM per TensorCore by TPU device_kind (jax._src.tpu_info); unknown kinds get 64 MiB.
TPU_VMEM_BYTES = {
    "TPU v4": 16 << 20,
    "TPU v5": 64 << 20,
    "TPU v5p": 64 << 20,
    "TPU v5 lite": 128 << 20,
    "TPU v5e": 128 << 20,
    "TPU v6 lite": 128 << 20,
    "TPU v6e": 128 << 20,
}
TPU_DEFAULT_VMEM_BYTES = 64 << 20
TPU_VMEM_USABLE = 0.85  # fraction of VMEM the kernels may plan for


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes along the sequence, per kernel.

    Each kernel has a grid over tiles of one sequence and a loop over blocks of
    the other: forward and dQ tile the queries and loop over keys; dK/dV tiles
    the keys and loops over queries. Backward sizes left as None take the
    forward's (block_q for query sizes, block_kv for key sizes).
    TPU: multiples of 128. Triton: powers of two >= 16. Blocks larger than the
    (padded) sequence are reduced to fit; the sequence is padded to a multiple
    of every block.
    """

    block_q: int
    block_kv: int
    block_q_dkv: int | None = None  # query loop step of the dK/dV kernel
    block_kv_dkv: int | None = None  # key tile of the dK/dV kernel
    block_q_dq: int | None = None  # query tile of the dQ kernel
    block_kv_dq: int | None = None  # key loop step of the dQ kernel
    # Backward as one fused kernel (5 seq^2 matmuls, on the dK/dV tiles) instead
    # of the dQ and dK/dV kernels (3 + 4, S and dP computed twice). None: the
    # backend's default (see ``flash_config``). Not a tile size, but it rides
    # along with them so every path that takes block sizes can choose it.
    fused_bwd: bool | None = None

    def resolved(self) -> BlockSizes:
        q, kv = self.block_q, self.block_kv
        pick = lambda x, d: d if x is None else x
        return BlockSizes(
            q,
            kv,
            pick(self.block_q_dkv, q),
            pick(self.block_kv_dkv, kv),
            pick(self.block_q_dq, q),
            pick(self.block_kv_dq, kv),
            self.fused_bwd,
        )

    def as_tuple(self) -> tuple[int | None, ...]:
        """The six tile sizes (not ``fused_bwd``)."""
        return tuple(getattr(self, name) for name in _BLOCK_FIELDS)

    def for_kernel(self, kind: str) -> tuple[int, int]:
        """(query block, key block) of kernel 'fwd', 'dq', 'dkv' or 'fused' (the dK/dV tiles)."""
        if kind == "fwd":
            return self.block_q, self.block_kv
        if kind == "dq":
            return self.block_q_dq, self.block_kv_dq
        return self.block_q_dkv, self.block_kv_dkv


_BLOCK_FIELDS = ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")


def default_block_sizes(backend: str, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
    """Default tiles per backend (before clamping to the sequence length)."""
    if backend == "tpu":
        # Large tiles amortise the per-step overhead; VMEM use stays a few MiB.
        return BlockSizes(512, 512, 512, 512, 512, 512)
    if backend == "gpu":
        # H100: 232448 B opt-in shared memory per block, and Triton keeps
        # num_stages copies of the streamed K/V (or Q/dO) blocks. Shapes follow
        # Triton's fused-attention tutorial (large tile, small loop step in the
        # backward); all of these compile for sm_90a up to head_dim 256.
        if jnp.dtype(dtype).itemsize > 2 or head_dim > 128:
            # f32 tiles take twice the shared memory/registers; with the bf16 tiles
            # the f32 backward took about 75 s to compile (deviceless, head_dim 128).
            return BlockSizes(64, 32, 32, 64, 64, 32)
        if head_dim <= 64:
            return BlockSizes(128, 128, 64, 128, 128, 64)
        # measured on an H100 (benchmarks/flash_tune.py, B4 S4096 H32/8 D128 causal): dK/dV
        # tiles of 128 keys looping over 64 queries, dQ tiles of 128 queries looping over 64
        # keys ran fwd+bwd at 283 TFLOP/s (70% of cuDNN) against 175 for 32-wide loop steps
        return BlockSizes(128, 64, 64, 128, 128, 64)
    # CPU interpret mode: small blocks so that tests exercise multi-block loops.
    return BlockSizes(128, 128, 128, 128, 128, 128)


# ----------------------------------------------------------------------------
# Static configuration (hashable: it is a nondiff argument of the custom_vjp).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Everything static about one set of kernel calls; build it with ``flash_config``.

    Public so that other attention paths (ring and chunked attention's blocks)
    can call the kernels on sequence blocks of their own.
    """

    backend: str  # "tpu" | "gpu" | "cpu" (which defaults/params to use)
    interpret: bool
    causal: bool
    window: int | None
    scale: float
    seq_len: int  # valid length (before padding)
    seq_pad: int  # padded length, a multiple of every block size
    head_dim: int  # head_dim seen by the kernel (padded to pow2 on GPU)
    q_heads: int
    kv_heads: int
    blocks: BlockSizes
    head_major: bool  # kernel arrays are [B, H, S, D] (else [B, S, H*D])
    vmem_limit: int | None  # TPU only
    fused_bwd: bool = False  # resolved blocks.fused_bwd: one backward kernel (see flash_fused_bwd_call)
    # Logit softcap c (Gemma 2): scores become c * tanh(scores / c) before the mask; None: none.
    softcap: float | None = None
    # Position of query index 0 relative to key index 0 (the masks compare positions): 0 for
    # one sequence; ring and chunked attention's blocks of a later q chunk against an earlier
    # kv chunk pass the chunks' distance, so that a sliding window sees across chunks.
    q_offset: int = 0
    # Attach a pl.CostEstimate (read from cost_estimates() when built, so that the
    # jit cache of _flash_padded keys on it).
    charge_cost: bool = dataclasses.field(default_factory=lambda: _CHARGE_COST)
    # The value (and output) head dim seen by the kernel when it differs from q/k's
    # (MLA: 128 against 192); None: head_dim.
    v_head_dim: int | None = None

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def dv(self) -> int:
        """The value / output head dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


# ----------------------------------------------------------------------------
# Kernel helpers shared by every kernel and both backends.
# ----------------------------------------------------------------------------


def _dot_nt(a, b, precision):
    """a @ b.T with f32 accumulation."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _dot_nn(a, b, precision):
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def matmul_precision(dtype):
    """Matmul precision for inputs of ``dtype`` (also used by the XLA blocks of ring attention)."""
    # f32 inputs: true f32 matmuls (Triton would otherwise use TF32; Mosaic bf16 passes).
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _position_mask(cfg: FlashConfig, shape, q0, k0, q_axis: int):
    """Causal / window / key-padding mask for a tile whose q positions run along ``q_axis``."""
    qpos = q0 + cfg.q_offset + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kpos = k0 + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return position_mask(cfg, qpos, kpos)


def _scores(cfg: FlashConfig, a, b, precision, q0, k0, *, q_axis: int, masked: bool, segment_mask):
    """(scale * a @ b.T, softcapped, with disallowed entries set to the mask value; the
    softcap's derivative, 1 - tanh^2, or None without a softcap).

    ``q_axis`` says which tile axis holds queries (0: [q, kv] tiles, 1: [kv, q]);
    ``masked`` False skips the position mask for blocks known to be fully allowed. The
    derivative is taken before the mask (a masked entry's probability is exactly 0, and its
    derivative stays finite, so dS there is 0, not 0 * inf).
    """
    s = _dot_nt(a, b, precision) * cfg.scale
    dcap = None
    if cfg.softcap is not None:
        t = jnp.tanh(s * (1.0 / cfg.softcap))
        s, dcap = cfg.softcap * t, 1.0 - t * t
    mask = _position_mask(cfg, s.shape, q0, k0, q_axis) if masked else None
    if segment_mask is not None:
        mask = segment_mask if mask is None else jnp.logical_and(mask, segment_mask)
    return (s if mask is None else jnp.where(mask, s, _MASK_VALUE)), dcap


def _softmax_grad(p, dp, delta, dcap):
    """dS of the scores before the softcap: P * (dP - delta), times the cap's derivative."""
    ds = p * (dp - delta)
    return ds if dcap is None else ds * dcap


def _masked_loops(ranges, body):
    """Runs body(j, carry, masked) over [lo, fl) masked, [fl, fh) unmasked, [fh, hi) masked."""
    lo, fl, fh, hi = ranges

    def run(carry):
        carry = lax.fori_loop(lo, fl, lambda j, c: body(j, c, True), carry)
        carry = lax.fori_loop(fl, fh, lambda j, c: body(j, c, False), carry)
        carry = lax.fori_loop(fh, hi, lambda j, c: body(j, c, True), carry)
        return carry

    return run


# ----------------------------------------------------------------------------
# Kernels. Refs arrive squeezed to 2-D by the BlockSpecs.
# ----------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *rest, cfg: FlashConfig, has_segments: bool, has_sinks: bool = False):
    if has_segments:
        q_seg_ref, kv_seg_ref, *rest = rest
    sink_ref, o_ref, lse_ref = rest if has_sinks else (None, *rest)
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_kv
    q0 = pl.program_id(2) * bq
    q = q_ref[...]
    prec = matmul_precision(q.dtype)
    q_seg = jnp.transpose(q_seg_ref[...]) if has_segments else None  # [bq, 1]

    def body(j, carry, masked):
        m, l, acc = carry
        k0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k0, bk), :]
        v = v_ref[pl.ds(k0, bk), :]
        seg = q_seg == kv_seg_ref[j] if has_segments else None  # [bq, 1] == [1, bk]
        s, _ = _scores(cfg, q, k, prec, q0, k0, q_axis=0, masked=masked, segment_mask=seg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + _dot_nn(p.astype(v.dtype), v, prec)
        return m_new, l, acc

    carry = (
        jnp.full((bq, 1), _MASK_VALUE, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
    )
    ranges = ranges_for_q_tile(cfg, q0, bq, bk)
    m, l, acc = _masked_loops(ranges, body)(carry)
    if has_sinks:
        # The head's sink logit joins the denominator as one more key with no value. A row
        # that saw no key then gets m = sink, l = 1 and output 0 (exp(mask - sink) = 0).
        sink = jnp.transpose(sink_ref[...])  # [1, bq] -> [bq, 1], the head's logit in every row
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        m, l, acc = m_new, alpha * l + jnp.exp(sink - m_new), alpha * acc
    # A row that saw no allowed key keeps m at the mask value (an allowed score is far
    # above it) and summed exp(0) = 1 per masked entry: its output is 0 and its LSE the mask
    # value (ring and chunked attention merge it with weight 0). Only blocks of a q_offset
    # (a window past some rows) and tiles of pure padding have such rows: with q_offset 0
    # every query sees itself.
    empty = m <= _MASK_VALUE
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty, 0.0, acc / l).astype(o_ref.dtype)
    lse_ref[...] = jnp.transpose(jnp.where(empty, _MASK_VALUE, m + jnp.log(l)))  # lane-dense [1, bq]


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, cfg: FlashConfig, has_segments: bool):
    if has_segments:
        q_seg_ref, kv_seg_ref, dq_ref = rest
    else:
        (dq_ref,) = rest
    bq, bk = cfg.blocks.for_kernel("dq")
    q0 = pl.program_id(2) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = jnp.transpose(lse_ref[...])  # [1, bq] -> [bq, 1]
    delta = jnp.transpose(delta_ref[...])  # [1, bq] -> [bq, 1]
    prec = matmul_precision(q.dtype)
    q_seg = jnp.transpose(q_seg_ref[...]) if has_segments else None

    def body(j, dq, masked):
        k0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k0, bk), :]
        v = v_ref[pl.ds(k0, bk), :]
        seg = q_seg == kv_seg_ref[j] if has_segments else None
        s, dcap = _scores(cfg, q, k, prec, q0, k0, q_axis=0, masked=masked, segment_mask=seg)
        p = jnp.exp(s - lse)
        dp = _dot_nt(do, v, prec)
        ds = _softmax_grad(p, dp, delta, dcap)
        return dq + _dot_nn(ds.astype(k.dtype), k, prec)

    dq = jnp.zeros((bq, q.shape[-1]), jnp.float32)
    dq = _masked_loops(ranges_for_q_tile(cfg, q0, bq, bk), body)(dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, cfg: FlashConfig, has_segments: bool):
    """dK, dV for one kv tile of one *query* head, computed transposed ([kv, q] tiles)."""
    if has_segments:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref = rest
    else:
        (dk_ref, dv_ref), q_seg_ref = rest, None
    bq, bk = cfg.blocks.for_kernel("dkv")
    k0 = pl.program_id(2) * bk
    k = k_ref[...]
    v = v_ref[...]
    kv_seg = jnp.transpose(kv_seg_ref[...]) if has_segments else None  # [bk, 1]

    def body(i, carry, masked):
        refs = (q_ref, do_ref, lse_ref, delta_ref, q_seg_ref)
        return _kv_tile_step(cfg, carry, i, masked, refs, k, v, kv_seg, k0)[:2]

    zeros = (jnp.zeros((bk, k.shape[-1]), jnp.float32), jnp.zeros((bk, v.shape[-1]), jnp.float32))
    dk, dv = _masked_loops(ranges_for_kv_tile(cfg, k0, bk, bq), body)(zeros)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _kv_tile_step(cfg: FlashConfig, carry, i, masked, refs, k, v, kv_seg, k0):
    """One query block `i` against a kv tile, transposed ([kv, q]): S, P, dP and dS once;
    returns (dk, dv) accumulated into `carry`, and dS [bk, bq] (the fused kernel's dQ).
    `refs`: (q, do, lse, delta, q segment ids or None); `k0`: the tile's first key position
    (read from program_id by the caller: the interpreter has no program_id inside loops).
    Shared by the split dK/dV kernel and the fused one."""
    q_ref, do_ref, lse_ref, delta_ref, q_seg_ref = refs
    dk, dv = carry
    bq, _ = cfg.blocks.for_kernel("dkv")  # the fused kernel walks the same tiles
    prec = matmul_precision(k.dtype)
    q0 = pl.multiple_of(i * bq, bq)
    q = q_ref[pl.ds(q0, bq), :]
    do = do_ref[pl.ds(q0, bq), :]
    lse = lse_ref[i]  # [1, bq]
    delta = delta_ref[i]  # [1, bq]
    seg = kv_seg == q_seg_ref[i] if kv_seg is not None else None  # [bk, 1] == [1, bq]
    s, dcap = _scores(cfg, k, q, prec, q0, k0, q_axis=1, masked=masked, segment_mask=seg)
    p = jnp.exp(s - lse)
    dv = dv + _dot_nn(p.astype(do.dtype), do, prec)
    dp = _dot_nt(v, do, prec)
    ds = _softmax_grad(p, dp, delta, dcap)
    dk = dk + _dot_nn(ds.astype(q.dtype), q, prec)
    return dk, dv, ds


def _fused_bwd_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, cfg: FlashConfig, has_segments: bool
):
    """dQ, dK, dV in one pass over the dK/dV kernel's [kv, q] tiles: S, P, dP and dS
    are computed once per visited block and feed all three gradients (5 matmuls).

    dK/dV accumulate in registers/VMEM over the query loop, as in ``_dkv_kernel``.
    dQ of every query block gathers contributions from every kv tile, i.e. from
    other grid steps, so it is summed in f32 over the whole sequence of the
    (batch, head). On TPU/CPU the grid runs in order and the tile axis is
    "arbitrary": the sum stays resident across it, zeroed at the first tile, in
    the f32 dQ output block itself or, for a narrower dQ dtype, in an f32
    scratch cast into the output at the last tile (no f32 dQ in HBM). On Triton
    the tiles run in parallel and add into an f32 HBM buffer, zeroed by the
    caller, with float atomics.
    """
    atomic = cfg.backend == "gpu"
    q_seg_ref = None
    if has_segments:
        q_seg_ref, kv_seg_ref, *rest = rest
    if atomic:
        _, dq_ref, dk_ref, dv_ref = rest  # rest[0] is the zeros aliased to dq_ref
        acc_ref = dq_ref
    else:
        dq_ref, dk_ref, dv_ref, *scratch = rest
        acc_ref = scratch[0] if scratch else dq_ref
    bq, bk = cfg.blocks.for_kernel("fused")
    tile = pl.program_id(2)
    k0 = tile * bk
    k = k_ref[...]
    v = v_ref[...]
    prec = matmul_precision(k.dtype)
    kv_seg = jnp.transpose(kv_seg_ref[...]) if has_segments else None  # [bk, 1]

    if not atomic:

        @pl.when(tile == 0)
        def _zero_dq():
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    def body(i, carry, masked):
        refs = (q_ref, do_ref, lse_ref, delta_ref, q_seg_ref)
        dk, dv, ds = _kv_tile_step(cfg, carry, i, masked, refs, k, v, kv_seg, k0)
        q0 = pl.multiple_of(i * bq, bq)
        dq = _dot_nn(jnp.transpose(ds).astype(k.dtype), k, prec) * cfg.scale  # [bq, D]
        if atomic:
            from jax.experimental.pallas import triton as pltriton

            pltriton.atomic_add(acc_ref, (pl.ds(q0, bq), slice(None)), dq)
        else:
            acc_ref[pl.ds(q0, bq), :] += dq
        return dk, dv

    zeros = (jnp.zeros((bk, k.shape[-1]), jnp.float32), jnp.zeros((bk, v.shape[-1]), jnp.float32))
    dk, dv = _masked_loops(ranges_for_kv_tile(cfg, k0, bk, bq), body)(zeros)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if acc_ref is not dq_ref:

        @pl.when(tile == pl.num_programs(2) - 1)
        def _write_dq():
            dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


# ----------------------------------------------------------------------------
# Per-backend plumbing: views, BlockSpecs, compiler params, cost estimates.
# ----------------------------------------------------------------------------


def to_kernel_layout(x, cfg: FlashConfig):
    """[B, S, H, D] -> [B, H, S, D] (head-major) or [B, S, H*D] (free reshape)."""
    b, s, h, d = x.shape
    if cfg.head_major:
        return jnp.swapaxes(x, 1, 2)
    return x.reshape(b, s, h * d)


def from_kernel_layout(x, cfg: FlashConfig, heads: int):
    """The inverse of ``to_kernel_layout`` (q/k-like or v-like: the head dim is x's)."""
    if cfg.head_major:
        return jnp.swapaxes(x, 1, 2)
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads)


def _whole_spec(cfg: FlashConfig, head_fn, d=None):
    """BlockSpec for the whole [seq, D] sequence of one head (read by the in-kernel loop)."""
    return _tile_spec(cfg, cfg.seq_pad, head_fn, d, whole=True)


def _tile_spec(cfg: FlashConfig, block: int, head_fn, d=None, *, whole: bool = False):
    """BlockSpec for the grid step's [block, D] tile of one head (or, whole=True, all of it).

    Grid is (batch, q_head, tile); ``head_fn`` maps the query head to the head of
    this operand (identity, or // group for kv heads); ``d``: the head dim (None: q/k's).
    """
    d = cfg.head_dim if d is None else d
    seq_idx = (lambda i: 0) if whole else (lambda i: i)
    if cfg.head_major:
        spec = (None, None, block, d)
        index_map = lambda b, h, i: (b, head_fn(h), seq_idx(i), 0)
    else:
        spec = (None, block, d)
        index_map = lambda b, h, i: (b, seq_idx(i), head_fn(h))
    if whole and cfg.backend == "tpu" and not cfg.interpret:
        # Fetched once per head; a second buffer would only double VMEM use.
        return pl.BlockSpec(spec, index_map, pipeline_mode=pl.Buffered(1))
    return pl.BlockSpec(spec, index_map)


# Per-position vectors (LSE, delta, segment ids) live in HBM as
# [B, (H,) S/blk, 1, blk]: lane-dense on TPU (a [.., S, 1] array would be
# padded 128x by the (8, 128) tiling), and a [1, blk] row per tile in-kernel.


def _vectors(x, block: int):
    """[B, (H,) S] -> [B, (H,) S/block, 1, block] (a free reshape)."""
    *lead, s = x.shape
    return x.reshape(*lead, s // block, 1, block)


def _vector_tile_spec(block: int, *, per_head: bool):
    """The [1, block] row of the grid's current tile."""
    if per_head:
        return pl.BlockSpec((None, None, None, 1, block), lambda b, h, i: (b, h, i, 0, 0))
    return pl.BlockSpec((None, None, 1, block), lambda b, h, i: (b, i, 0, 0))


def _sink_spec(block: int):
    """The head's sink logit as a [1, block] row (every entry the same): a [heads, 1, block]
    operand, so that it is a per-query column in-kernel as the segment ids are."""
    return pl.BlockSpec((None, 1, block), lambda b, h, i: (h, 0, 0))


def _vector_rows_spec(cfg: FlashConfig, block: int, *, per_head: bool):
    """All [n, 1, block] rows of one (batch, head), for the in-kernel loop (``ref[j]``)."""
    n = cfg.seq_pad // block
    if per_head:
        return pl.BlockSpec((None, None, n, 1, block), lambda b, h, i: (b, h, 0, 0, 0))
    return pl.BlockSpec((None, n, 1, block), lambda b, h, i: (b, 0, 0, 0))


def _compiler_params(cfg: FlashConfig, kind: str):
    if cfg.interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        # The fused backward revisits its dQ block along the tile axis: "arbitrary"
        # keeps that axis in order on one core (megacore splits batch and heads).
        tiles = "arbitrary" if kind == "fused" else "parallel"
        return pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", tiles), vmem_limit_bytes=cfg.vmem_limit
        )
    if cfg.backend == "gpu":
        from jax.experimental.pallas import triton as pltriton

        bq, bk = cfg.blocks.for_kernel(kind)
        if kind == "fwd":
            num_warps = 4 if cfg.head_dim <= 64 else 8
        else:
            num_warps = 8 if bq * bk >= 128 * 64 else 4
        # num_stages: copies of the streamed blocks kept in flight by Triton's
        # software pipelining (shared memory grows linearly with it). On an H100 (head_dim
        # 128, flash_tune.py) two and four stages were no faster forward and 10-15% slower
        # backward.
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=3)
    return None


def _visited_blocks(cfg: FlashConfig, kind: str) -> int:
    """Number of (tile, tile) pairs a kernel visits for one (batch, head): for cost estimates."""
    bq, bk = cfg.blocks.for_kernel(kind)
    total = 0
    if kind in ("dkv", "fused"):
        for t in range(cfg.seq_pad // bk):
            lo, _, _, hi = ranges_for_kv_tile(cfg, t * bk, bk, bq, PY_OPS)
            total += max(hi - lo, 0)
    else:
        for t in range(cfg.seq_pad // bq):
            lo, _, _, hi = ranges_for_q_tile(cfg, t * bq, bq, bk, PY_OPS)
            total += max(hi - lo, 0)
    return total * bq * bk


# [block_q, block_kv] x head_dim matmuls per visited block, as each kernel declares
# them: forward S, PV; dQ S, dP, dS K; dK/dV S, P^T dO, dP, dS^T Q; fused: all
# five backward ones once. Split backward 3 + 4 = 7, fused 5 (plus the forward's 2).
KERNEL_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "fused": 5}
# Of those, the ones over the value head dim (PV; dP; dP, dV; dP, dV), the others over q/k's.
_VALUE_MATMULS = {"fwd": 1, "dq": 1, "dkv": 2, "fused": 2}

# Whether pallas_calls traced from here carry a cost estimate (see cost_estimates).
_CHARGE_COST = True


@contextlib.contextmanager
def cost_estimates(enabled: bool):
    """Trace the kernels with (default) or without their ``pl.CostEstimate``.

    XLA's TPU cost model charges a Mosaic custom call only what its cost
    estimate says; without one the kernel counts as free (0 FLOPs, ~0 s). Other
    stacks' kernels (MaxText's splash attention) carry none, so their estimated
    step times leave attention out. ``jaxtrain compile --kernels-uncharged``
    traces under ``cost_estimates(False)`` to compare on those terms. Affects
    tracing only: compiled programs and numerics are unchanged.
    """
    global _CHARGE_COST
    before, _CHARGE_COST = _CHARGE_COST, bool(enabled)
    try:
        yield
    finally:
        _CHARGE_COST = before


def declared_costs(closed_jaxpr) -> dict[str, dict[str, int]]:
    """What the Pallas calls in a traced program declare, summed per kernel name.

    ``closed_jaxpr``: e.g. ``jax.make_jaxpr(jax.grad(loss))(q, k, v)``. Returns
    {pallas_call name: {"calls", "flops", "transcendentals", "bytes_accessed"}};
    calls without a CostEstimate count as 0. XLA's TPU cost model charges a
    Mosaic kernel exactly this, so it shows where cost_analysis totals come from.
    """
    from jax.extend import core as jex_core

    totals: dict[str, dict[str, int]] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                cost = eqn.params.get("cost_estimate")
                row = totals.setdefault(
                    eqn.params["name"], dict(calls=0, flops=0, transcendentals=0, bytes_accessed=0)
                )
                row["calls"] += 1
                for key in ("flops", "transcendentals", "bytes_accessed"):
                    row[key] += int(getattr(cost, key, 0) or 0)
                continue
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return totals


def _cost(cfg: FlashConfig, kind: str, batch: int, operands, outputs) -> pl.CostEstimate | None:
    if not cfg.charge_cost:
        return None
    pairs = _visited_blocks(cfg, kind) * batch * cfg.q_heads
    matmuls = KERNEL_MATMULS[kind]
    nbytes = sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*operands, *outputs) if x is not None
    )
    per_pair = 1 if cfg.softcap is None else 2  # exp, and the softcap's tanh
    return pl.CostEstimate(
        flops=int(
            2 * pairs * ((matmuls - _VALUE_MATMULS[kind]) * cfg.head_dim + _VALUE_MATMULS[kind] * cfg.dv)
        ),
        transcendentals=int(per_pair * pairs),
        bytes_accessed=int(nbytes),
    )


# ----------------------------------------------------------------------------
# pallas_call wrappers on kernel-layout arrays: the block-level API.
#
# Each call runs one kernel over a whole (padded) sequence of cfg.seq_pad. Query
# and key segment ids are separate arguments (both or neither), so that ring
# and chunked attention can attend one sequence block to another.
# ----------------------------------------------------------------------------


def _specs(cfg: FlashConfig, kind: str, *, has_segments: bool, has_sinks: bool = False):
    """(in_specs, out_specs) of kernel ``kind`` ('fwd', 'dq' or 'dkv') over the grid (batch, q_head, tile).

    Operands are (q, k, v[, dO, LSE, delta][, q segment ids, kv segment ids][, sinks (fwd)]).
    q, k, dQ, dK have q/k's head dim, v, O, dO, dV the value head dim (``cfg.dv``).
    The forward and dQ kernels tile the queries and loop over keys; dK/dV tiles
    the keys and loops over queries. The tiled side's operands are the grid
    step's tile (a row for per-position vectors), the looped side's are whole.
    Query head h reads kv head h // group (GQA).
    """
    bq, bk = cfg.blocks.for_kernel(kind)
    g = cfg.group
    q_head, kv_head = (lambda h: h), (lambda h: h // g)
    dv = cfg.dv
    if kind in ("dkv", "fused"):
        q_spec, o_spec = _whole_spec(cfg, q_head), _whole_spec(cfg, q_head, dv)
        k_spec, v_spec = _tile_spec(cfg, bk, kv_head), _tile_spec(cfg, bk, kv_head, dv)
        q_vector = _vector_rows_spec(cfg, bq, per_head=True)
        seg_specs = [_vector_rows_spec(cfg, bq, per_head=False), _vector_tile_spec(bk, per_head=False)]
    else:
        q_spec, o_spec = _tile_spec(cfg, bq, q_head), _tile_spec(cfg, bq, q_head, dv)
        k_spec, v_spec = _whole_spec(cfg, kv_head), _whole_spec(cfg, kv_head, dv)
        q_vector = _vector_tile_spec(bq, per_head=True)
        seg_specs = [_vector_tile_spec(bq, per_head=False), _vector_rows_spec(cfg, bk, per_head=False)]
    in_specs = [q_spec, k_spec, v_spec]
    if kind != "fwd":
        in_specs += [o_spec, q_vector, q_vector]  # dO is laid out like O; LSE, delta per query
    if has_segments:
        in_specs += seg_specs
    if has_sinks:
        in_specs.append(_sink_spec(bq))
    if kind == "fwd":
        return in_specs, [o_spec, q_vector]  # O, LSE
    if kind == "dq":
        return in_specs, q_spec
    # dK, dV per *query* head: a key tile of head h.
    dk_out, dv_out = _tile_spec(cfg, bk, q_head), _tile_spec(cfg, bk, q_head, dv)
    if kind == "dkv":
        return in_specs, [dk_out, dv_out]
    # Fused: dQ of the whole sequence of head h; on GPU (f32) also its zeros input.
    dq_whole = _whole_spec(cfg, q_head)
    if cfg.backend == "gpu":
        in_specs.append(dq_whole)
    return in_specs, [dq_whole, dk_out, dv_out]


def _call(
    cfg: FlashConfig,
    kind: str,
    kernel,
    arrays,
    per_query,
    q_segment_ids,
    kv_segment_ids,
    *,
    out_shape,
    extra=(),
    aliases=None,
    scratch=(),
    sinks=None,
):
    """pallas_call of kernel ``kind`` over the grid (batch, q_head, tile), per-backend params and costs.

    Operands: ``arrays`` (q, k, v[, dO]), then the ``per_query`` vectors (LSE,
    delta), then the segment ids, then the ``sinks`` ([q_heads] f32 or None; the forward
    only), then ``extra`` (aliased to outputs by ``aliases``, {operand index: output index}),
    all as ``_specs`` describes them.
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must both be given or both be None")
    has_segments = q_segment_ids is not None
    bq, bk = cfg.blocks.for_kernel(kind)
    segments = [_vectors(q_segment_ids, bq), _vectors(kv_segment_ids, bk)] if has_segments else []
    has_sinks = sinks is not None
    sink_rows = (
        [jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (cfg.q_heads, 1, bq))]
        if has_sinks
        else []
    )
    operands = [*arrays, *(_vectors(x, bq) for x in per_query), *segments, *sink_rows, *extra]
    in_specs, out_specs = _specs(cfg, kind, has_segments=has_segments, has_sinks=has_sinks)
    batch = operands[0].shape[0]
    flags = dict(has_sinks=True) if has_sinks else {}
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg, has_segments=has_segments, **flags),
        out_shape=out_shape,
        grid=(batch, cfg.q_heads, cfg.seq_pad // (bk if kind in ("dkv", "fused") else bq)),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(cfg, kind),
        input_output_aliases=aliases or {},
        scratch_shapes=scratch,
        cost_estimate=_cost(cfg, kind, batch, operands, jax.tree.leaves(out_shape)),
        interpret=cfg.interpret,
        name=f"flash_attention_{kind}",
    )(*operands)


def _value_shape(cfg: FlashConfig, batch: int) -> tuple[int, ...]:
    """Kernel-layout shape of a per-query-head array with the value head dim (O, dO, dV)."""
    if cfg.head_major:
        return (batch, cfg.q_heads, cfg.seq_pad, cfg.dv)
    return (batch, cfg.seq_pad, cfg.q_heads * cfg.dv)


def _key_shape(cfg: FlashConfig, batch: int) -> tuple[int, ...]:
    """Kernel-layout shape of a per-query-head array with q/k's head dim (dK per query head)."""
    if cfg.head_major:
        return (batch, cfg.q_heads, cfg.seq_pad, cfg.head_dim)
    return (batch, cfg.seq_pad, cfg.q_heads * cfg.head_dim)


def flash_fwd_call(q, k, v, q_segment_ids, kv_segment_ids, cfg: FlashConfig, sinks=None):
    """Forward kernel on kernel-layout q, k, v (``to_kernel_layout``) of cfg.seq_pad positions.

    Segment ids: [batch, seq] int32 for the queries and for the keys, or both None.
    ``sinks``: [q_heads] logits (f32) that join each head's softmax denominator with no
    value (GPT-OSS), or None; the LSE then includes them.
    Returns (O in q's dtype, v's layout, LSE f32 as [batch, q_heads, seq / block_q, 1, block_q]).
    """
    bq = cfg.blocks.block_q
    lse_shape = (q.shape[0], cfg.q_heads, cfg.seq_pad // bq, 1, bq)
    out_shape = [
        jax.ShapeDtypeStruct(_value_shape(cfg, q.shape[0]), q.dtype),
        jax.ShapeDtypeStruct(lse_shape, jnp.float32),
    ]
    return _call(
        cfg,
        "fwd",
        _fwd_kernel,
        [q, k, v],
        [],
        q_segment_ids,
        kv_segment_ids,
        out_shape=out_shape,
        sinks=sinks,
    )


def flash_dq_call(q, k, v, do, lse, delta, q_segment_ids, kv_segment_ids, cfg: FlashConfig, *, out_dtype):
    """dQ kernel on kernel-layout q, k, v, dO; ``lse`` and ``delta`` (rowsum(dO * O)) are
    [batch, q_heads, seq] f32. Returns dQ in q's layout, ``out_dtype``."""
    out_shape = jax.ShapeDtypeStruct(q.shape, out_dtype)
    arrays, per_query = [q, k, v, do], [lse, delta]
    return _call(cfg, "dq", _dq_kernel, arrays, per_query, q_segment_ids, kv_segment_ids, out_shape=out_shape)


def flash_dkv_call(q, k, v, do, lse, delta, q_segment_ids, kv_segment_ids, cfg: FlashConfig, *, out_dtype):
    """dK, dV per *query* head ([B, S, Hq*D] or [B, Hq, S, D], ``out_dtype``); the caller
    sums GQA groups. Arguments as for ``flash_dq_call``."""
    batch = q.shape[0]
    out_shape = [jax.ShapeDtypeStruct(f(cfg, batch), out_dtype) for f in (_key_shape, _value_shape)]
    arrays, per_query = [q, k, v, do], [lse, delta]
    return _call(
        cfg, "dkv", _dkv_kernel, arrays, per_query, q_segment_ids, kv_segment_ids, out_shape=out_shape
    )


def flash_fused_bwd_call(
    q, k, v, do, lse, delta, q_segment_ids, kv_segment_ids, cfg: FlashConfig, *, out_dtype, dq_dtype
):
    """dQ, dK, dV from one kernel (``_fused_bwd_kernel``), on the dK/dV kernel's tiles.

    Returns (dQ in q's layout and ``dq_dtype``, dK, dV per *query* head in
    ``out_dtype`` as ``flash_dkv_call``). dQ is summed in f32 either way; on GPU
    (atomics into HBM) a narrower ``dq_dtype`` is a cast in XLA. Other
    arguments as for ``flash_dq_call``.
    """
    atomic = cfg.backend == "gpu"
    dq_dtype = jnp.dtype(dq_dtype)
    f32 = jnp.dtype(jnp.float32)
    dq_shape = jax.ShapeDtypeStruct(q.shape, f32 if atomic else dq_dtype)
    batch = q.shape[0]
    out_shape = [
        dq_shape,
        *(jax.ShapeDtypeStruct(f(cfg, batch), out_dtype) for f in (_key_shape, _value_shape)),
    ]
    arrays, per_query = [q, k, v, do], [lse, delta]
    extra, aliases, scratch = (), None, ()
    if atomic:  # atomics add into a zeroed buffer
        extra = (jnp.zeros(q.shape, jnp.float32),)
        n_in = len(arrays) + len(per_query) + (2 if q_segment_ids is not None else 0)
        aliases = {n_in: 0}
    elif dq_dtype != f32:
        from jax.experimental.pallas import tpu as pltpu

        scratch = (pltpu.VMEM((cfg.seq_pad, cfg.head_dim), jnp.float32),)
    dq, dk, dv = _call(
        cfg,
        "fused",
        _fused_bwd_kernel,
        arrays,
        per_query,
        q_segment_ids,
        kv_segment_ids,
        out_shape=out_shape,
        extra=extra,
        aliases=aliases,
        scratch=scratch,
    )
    return dq.astype(dq_dtype), dk, dv


# ----------------------------------------------------------------------------
# custom_vjp on [B, S, H, D] arrays (already padded).
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segment_ids, sinks, cfg: FlashConfig):
    return _flash_fwd(q, k, v, segment_ids, sinks, cfg)[0]


def _flash_fwd(q, k, v, segment_ids, sinks, cfg: FlashConfig):
    qk, kk, vk = (to_kernel_layout(x, cfg) for x in (q, k, v))
    ok, lse = flash_fwd_call(qk, kk, vk, segment_ids, segment_ids, cfg, sinks)
    out = from_kernel_layout(ok, cfg, q.shape[2])
    # The output (in the caller's layout: the value the model names `context` too) and the
    # statistics, named for remat policies that keep attention (remat_names.py): then the
    # backward needs no second forward kernel. q, k, v stay in kernel layout.
    out, lse = (checkpoint_name(x, ATTENTION_RESIDUALS) for x in (out, lse))
    return out, (qk, kk, vk, segment_ids, sinks, out, lse)


def _flash_bwd(cfg: FlashConfig, residuals, do):
    qk, kk, vk, segment_ids, sinks, out, lse = residuals
    ok = to_kernel_layout(out, cfg)
    batch, q_heads, kv_heads = qk.shape[0], cfg.q_heads, cfg.kv_heads
    seq_pad = cfg.seq_pad
    dok = to_kernel_layout(do, cfg)
    # delta_i = sum_d dO_id O_id  (= rowsum(P * dP)); O(S) work in XLA.
    prod = ok.astype(jnp.float32) * dok.astype(jnp.float32)
    if cfg.head_major:
        delta = prod.sum(axis=-1)
    else:
        delta = prod.reshape(batch, seq_pad, q_heads, -1).sum(axis=-1).transpose(0, 2, 1)
    lse = lse.reshape(batch, q_heads, seq_pad)
    if cfg.seq_pad != cfg.seq_len:
        # Padded queries: exp(s - inf) = 0 makes their probabilities exactly 0.
        lse = jnp.where(jnp.arange(seq_pad) < cfg.seq_len, lse, jnp.inf)
    grads = (qk, kk, vk, dok, lse, delta, segment_ids, segment_ids, cfg)
    # GQA: each query head writes its own partial dK/dV (f32 so the group sum
    # loses nothing); MHA writes the final dtype directly.
    kv_dtype = jnp.float32 if cfg.group > 1 else kk.dtype
    if cfg.fused_bwd:
        dq, dk, dv = flash_fused_bwd_call(*grads, out_dtype=kv_dtype, dq_dtype=qk.dtype)
    else:
        dq = flash_dq_call(*grads, out_dtype=qk.dtype)
        dk, dv = flash_dkv_call(*grads, out_dtype=kv_dtype)
    dq = from_kernel_layout(dq, cfg, q_heads)
    dk = from_kernel_layout(dk, cfg, q_heads)
    dv = from_kernel_layout(dv, cfg, q_heads)
    if cfg.group > 1:
        g = cfg.group
        dk = dk.reshape(batch, seq_pad, kv_heads, g, -1).sum(axis=3).astype(kk.dtype)
        dv = dv.reshape(batch, seq_pad, kv_heads, g, -1).sum(axis=3).astype(vk.dtype)
    return dq, dk, dv, None, None if sinks is None else sink_grad(sinks, lse, delta)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------
# Public entry point: validation, backend choice, padding.
# ----------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def resolve_block_sizes(block_sizes, backend: str, seq_len: int, head_dim: int, dtype) -> BlockSizes:
    """Validated block sizes (None: the backend's defaults), backward sizes filled in,
    each clamped to the sequence so a short sequence is not padded up to a big tile."""
    if block_sizes is None:
        block_sizes = default_block_sizes(backend, head_dim, dtype)
    elif not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    block_sizes = block_sizes.resolved()
    if block_sizes.fused_bwd is not None and not isinstance(block_sizes.fused_bwd, bool):
        raise ValueError(f"block_sizes.fused_bwd must be True, False or None, got {block_sizes.fused_bwd!r}")
    for name, b in zip(_BLOCK_FIELDS, block_sizes.as_tuple()):
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b <= 0:
            raise ValueError(f"block_sizes.{name} must be a positive int, got {b!r}")
        if backend == "tpu" and b % _TPU_BLOCK_UNIT:
            raise ValueError(f"block_sizes.{name}={b}: TPU blocks must be multiples of {_TPU_BLOCK_UNIT}")
        if backend == "gpu" and (not _is_pow2(b) or b < _TRITON_MIN_BLOCK):
            raise ValueError(
                f"block_sizes.{name}={b}: Triton blocks must be powers of two >= {_TRITON_MIN_BLOCK}"
            )
    # Clamp to the sequence so short sequences are not padded up to a big tile.
    if backend == "tpu":
        cap = _round_up(seq_len, _TPU_BLOCK_UNIT)
    elif backend == "gpu":
        cap = max(pl.next_power_of_2(seq_len), _TRITON_MIN_BLOCK)
    else:
        cap = _round_up(seq_len, 8)
    return BlockSizes(*(min(int(b), cap) for b in block_sizes.as_tuple()), block_sizes.fused_bwd)


def _tpu_vmem_need(cfg: FlashConfig, itemsize: int) -> int:
    """Rough VMEM bytes of the largest kernel: whole-sequence operands + tiles + f32 temporaries."""
    d = max(cfg.head_dim, cfg.dv, 128)  # lanes pad to 128
    whole = 2 * cfg.seq_pad * d * itemsize  # K+V (fwd, dq) or Q+dO (dkv, fused), single-buffered
    if cfg.fused_bwd:
        # The fused kernel's whole f32 dQ sum, and its narrower output block if any.
        whole += cfg.seq_pad * d * (4 + (itemsize if itemsize < 4 else 0))
    rows = 3 * 8 * cfg.seq_pad * 4  # LSE/delta/segment rows pad to 8 sublanes
    pairs = [cfg.blocks.for_kernel(kind) for kind in ("fwd", "dq", "dkv")]
    tile = max(max(p) for p in pairs)
    tiles = 2 * 4 * tile * d * 4  # double-buffered in/out tiles (<= f32)
    temps = 6 * max(bq * bk for bq, bk in pairs) * 4
    return whole + rows + tiles + temps


def _check_tpu_vmem(cfg: FlashConfig, dtype) -> int:
    """VMEM limit for the TPU kernels; ValueError when one head's sequence cannot fit."""
    need = _tpu_vmem_need(cfg, jnp.dtype(dtype).itemsize)
    capacity = TPU_VMEM_BYTES.get(device_kind() or "", TPU_DEFAULT_VMEM_BYTES)
    if need > capacity * TPU_VMEM_USABLE:
        fused = " with the fused backward (block_sizes.fused_bwd=False needs less)" if cfg.fused_bwd else ""
        raise ValueError(
            f"seq={cfg.seq_len}, head_dim={cfg.head_dim}, {jnp.dtype(dtype).name}: the kernels "
            f"keep one head's whole K/V (and Q/dO) sequence in TPU VMEM, about {need >> 20} MiB "
            f"here{fused}, more than fits ({capacity >> 20} MiB); shard the sequence (context "
            f"parallelism) or use shorter sequences per device"
        )
    return int(min(capacity * 0.9, max(need * 1.25, 32 << 20)))


def flash_config(
    *,
    backend: str,
    interpret: bool,
    causal: bool,
    window: int | None,
    scale: float,
    seq_len: int,
    seq_pad: int,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    blocks: BlockSizes,
    dtype,
    softcap: float | None = None,
    q_offset: int = 0,
    v_head_dim: int | None = None,
) -> FlashConfig:
    """The kernels' static configuration for resolved ``blocks`` (``resolve_block_sizes``).

    ``seq_pad`` must be a multiple of every block; ``head_dim`` (q/k) and ``v_head_dim``
    (v and the output; None: ``head_dim``) are the kernel's (padded to a power of two on GPU).
    On TPU it carries the VMEM limit, and raises ValueError when one head's whole sequence
    does not fit VMEM.

    ``blocks.fused_bwd`` None picks the backward per backend: fused on TPU (and
    on CPU, whose interpreter runs the grid in order as Mosaic does) where its
    whole f32 dQ fits VMEM, else the split kernels; split on GPU, where the
    fused kernel must add dQ with float atomics (nondeterministic, and no cost
    model to say it pays). See docs/kernels.md.
    """
    # TPU tiles the two minor dims of [B, S, H, D] together, so a per-head tile
    # is not contiguous there: use [B, H, S, D] (XLA can fuse the transpose
    # into the producer). On GPU the [B, S, H*D] view is a free reshape.
    cfg = FlashConfig(
        backend=backend,
        interpret=interpret,
        causal=causal,
        window=window,
        scale=scale,
        seq_len=seq_len,
        seq_pad=seq_pad,
        head_dim=head_dim,
        q_heads=q_heads,
        kv_heads=kv_heads,
        blocks=blocks,
        head_major=backend == "tpu",
        vmem_limit=None,
        fused_bwd=backend != "gpu" if blocks.fused_bwd is None else blocks.fused_bwd,
        softcap=softcap,
        q_offset=int(q_offset),
        v_head_dim=None if v_head_dim in (None, head_dim) else int(v_head_dim),
    )
    if backend == "tpu":
        if blocks.fused_bwd is None and cfg.fused_bwd:
            itemsize = jnp.dtype(dtype).itemsize
            capacity = TPU_VMEM_BYTES.get(device_kind() or "", TPU_DEFAULT_VMEM_BYTES)
            if _tpu_vmem_need(cfg, itemsize) > capacity * TPU_VMEM_USABLE:
                cfg = dataclasses.replace(cfg, fused_bwd=False)  # the split kernels need less VMEM
        cfg = dataclasses.replace(cfg, vmem_limit=_check_tpu_vmem(cfg, dtype))
    return cfg


def check_window(window, causal: bool) -> int | None:
    """A causal sliding window as an int >= 1 (None: none), for the chunked paths (ring and
    chunked attention), whose windows reach back only; ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {window!r}")
    if not causal:
        raise ValueError(
            f"sliding_window={window} without causal: ring and chunked attention take causal "
            "windows only (Ulysses and flash_attention take both)"
        )
    return int(window)


def check_softcap(softcap) -> float | None:
    """The logit softcap as a static float > 0 (None: none); ValueError otherwise."""
    if softcap is None:
        return None
    try:
        softcap = float(softcap)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"softcap must be a static Python float or None, got {softcap!r}") from e
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
    return softcap


def _check_array(name: str, x, rank: int = 4):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(
            f"{name} must have rank {rank} ([batch, seq, heads, head_dim]), got shape {tuple(x.shape)}"
        )


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    gpu_kernel: str = "triton",
    sinks=None,
):
    """Memory-efficient exact attention as Pallas kernels (forward and backward).

    Args:
      q: [batch, seq, q_heads, head_dim], float32 / bfloat16 / float16.
      k: [batch, seq, kv_heads, head_dim], v: [batch, seq, kv_heads, v_head_dim] (the
        value head dim may differ: MLA), same dtype; q_heads % kv_heads == 0
        (GQA / MQA: query head h reads kv head h // (q_heads // kv_heads)).
      causal: query i attends to keys j <= i.
      segment_ids: optional [batch, seq] integers; attention stays within a segment.
      sliding_window: optional int w >= 1; causal: i - w < j <= i, non-causal: |i - j| < w.
      softmax_scale: defaults to 1 / sqrt(head_dim).
      softcap: optional logit cap c > 0 (Gemma 2): scores become c * tanh(scores / c)
        after the scale, before the mask.
      block_sizes: optional BlockSizes (TPU: multiples of 128; Triton: powers of two);
        its ``fused_bwd`` picks the one-kernel backward (None: fused on TPU/CPU,
        split on GPU).
      backend: 'tpu' (Mosaic), 'gpu' (Triton) or 'cpu'; None picks from the
        arrays' devices, the mesh in context, or jax's default backend.
      interpret: run the kernels in the Pallas interpreter. Defaults to True on
        'cpu' (the only way to run there), False elsewhere.
      gpu_kernel: 'triton' (these kernels) or 'mosaic' (``flash_mgpu.py``: Hopper only,
        16-bit inputs, head_dim 64/128/256, no softcap; on 'cpu' its own interpreter). Not
        for TPU. ``block_sizes`` apply to the Triton kernels only.
      sinks: optional [q_heads] logits (GPT-OSS): each joins its head's softmax
        denominator, exp(sink - max), and carries no value; None: no sink (a sink of 0
        is not none).

    Returns:
      [batch, seq, q_heads, v_head_dim] in q's dtype. Differentiable in q, k, v and sinks.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    batch, seq_len, q_heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[1] != seq_len or v.shape[1] != seq_len:
        raise ValueError(
            f"seq mismatch: k and v must have q's sequence length {seq_len}, got k {k.shape}, v {v.shape}"
        )
    if k.shape[3] != head_dim or v.shape[3] == 0:
        raise ValueError(f"head_dim mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    v_head_dim = v.shape[3]
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v must have k's number of heads: k {k.shape}, v {v.shape}")
    kv_heads = k.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads ({kv_heads})")
    if seq_len == 0 or batch == 0 or head_dim == 0:
        raise ValueError(f"q has an empty dimension: {q.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (batch, seq_len):
            raise ValueError(
                f"segment_ids must have shape (batch, seq) = {(batch, seq_len)}, "
                f"got {getattr(segment_ids, 'shape', type(segment_ids).__name__)}"
            )
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)):
            raise ValueError(f"sliding_window must be an int or None, got {sliding_window!r}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        sliding_window = int(sliding_window)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    try:
        softmax_scale = float(softmax_scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"softmax_scale must be a static Python float, got {softmax_scale!r}") from e
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q_heads)
    backend, interpret = kernel_backend(q, backend, interpret)
    gpu_kernel = check_gpu_kernel(
        gpu_kernel,
        backend=backend,
        head_dim=head_dim,
        dtype=q.dtype,
        softcap=softcap,
        v_head_dim=v_head_dim,
    )
    if gpu_kernel == "mosaic":
        from jaxtrain.pallas_kernels.flash_mgpu import flash_attention_mgpu

        return flash_attention_mgpu(
            q,
            k,
            v,
            causal=causal,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
            softmax_scale=softmax_scale,
            interpret=bool(interpret),
            sinks=sinks,
        )

    # Triton blocks must be powers of two in every dim: pad head_dim with zeros
    # (zero q/k columns add nothing to scores; zero v columns are sliced off).
    kernel_dim = lambda d: max(pl.next_power_of_2(d), _TRITON_MIN_BLOCK) if backend == "gpu" else d
    kernel_head_dim, kernel_v_dim = kernel_dim(head_dim), kernel_dim(v_head_dim)
    blocks = resolve_block_sizes(block_sizes, backend, seq_len, max(kernel_head_dim, kernel_v_dim), q.dtype)
    seq_pad = _round_up(seq_len, math.lcm(*blocks.as_tuple()))
    cfg = flash_config(
        backend=backend,
        interpret=bool(interpret),
        causal=bool(causal),
        window=sliding_window,
        scale=softmax_scale,
        seq_len=seq_len,
        seq_pad=seq_pad,
        head_dim=kernel_head_dim,
        q_heads=q_heads,
        kv_heads=kv_heads,
        blocks=blocks,
        dtype=q.dtype,
        softcap=softcap,
        v_head_dim=kernel_v_dim,
    )
    return _flash_padded(q, k, v, segment_ids, sinks, cfg=cfg, head_dim=head_dim, v_head_dim=v_head_dim)


def check_sinks(sinks, q_heads: int):
    """Sink logits as a [q_heads] float array (None: none); ValueError otherwise."""
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or tuple(sinks.shape) != (q_heads,):
        raise ValueError(
            f"sinks must have shape (q_heads,) = {(q_heads,)}, "
            f"got {getattr(sinks, 'shape', type(sinks).__name__)}"
        )
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be floats, got {sinks.dtype}")
    return sinks


def check_gpu_kernel(
    gpu_kernel: str, *, backend: str, head_dim: int, dtype, softcap=None, v_head_dim=None
) -> str:
    """``gpu_kernel`` if it can run the case on ``backend`` (CPU: its interpreter), else a
    ValueError naming the key: 'mosaic' (flash_mgpu.py) is a Hopper kernel with its own
    limits (``flash_mgpu.unsupported_reason``). Shared by every entry point that takes it
    (flash, chunked, ring and Ulysses attention)."""
    if gpu_kernel not in GPU_KERNELS:
        raise ValueError(f"gpu_kernel must be one of {GPU_KERNELS}, got {gpu_kernel!r}")
    if gpu_kernel == "mosaic":
        if backend == "tpu":
            raise ValueError("gpu_kernel='mosaic' is a Hopper GPU kernel; the backend here is tpu")
        from jaxtrain.pallas_kernels.flash_mgpu import unsupported_reason

        reason = unsupported_reason(head_dim=head_dim, dtype=dtype, softcap=softcap, v_head_dim=v_head_dim)
        if reason:
            raise ValueError(
                f"gpu_kernel='mosaic' cannot run this case: {reason}; expected gpu_kernel='triton'"
            )
    return gpu_kernel


@functools.partial(jax.jit, static_argnames=("cfg", "head_dim", "v_head_dim"))
def _flash_padded(q, k, v, segment_ids, sinks, *, cfg: FlashConfig, head_dim: int, v_head_dim: int):
    pad_s = cfg.seq_pad - cfg.seq_len
    pad_d, pad_v = cfg.head_dim - head_dim, cfg.dv - v_head_dim
    if pad_s or pad_d or pad_v:
        widths = lambda d: ((0, 0), (0, pad_s), (0, 0), (0, d))
        q, k, v = jnp.pad(q, widths(pad_d)), jnp.pad(k, widths(pad_d)), jnp.pad(v, widths(pad_v))
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
        if pad_s:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad_s)))
    out = _flash(q, k, v, segment_ids, sinks, cfg)
    if pad_s or pad_v:
        out = out[:, : cfg.seq_len, :, :v_head_dim]
    return out
