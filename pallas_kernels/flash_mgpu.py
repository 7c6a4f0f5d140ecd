"""FlashAttention for Hopper (sm90) written with Pallas' Mosaic GPU backend: wgmma, TMA, warp specialisation.

STATUS: forward, dQ and dK/dV kernels exist; ``flash_attention_mgpu`` (custom_vjp, padding
to ``seq_pad`` and slicing back) matches ``jax.grad`` of the float32 reference in Mosaic GPU's
interpreter (jax 0.12.0.1 and 0.11.2; bf16, relative max error <= ~7e-3) for GQA causal,
causal + window, causal + segments, causal + window + segments, non-causal, window +
segments, padding, head_dim 64, 128 and 256 (``tests/test_flash_mgpu.py``), and compiles
deviceless for H100 (sm_90a) under both jax versions, at the issue's B4 S4096 Hq32 Hkv8 D128
causal too. On one H100 (2026-11-27, jax 0.11.2, ``benchmarks/attention.py --gpu``) it ran
the issue's shape (B4 S4096, 32 / 8 heads of 128, causal) at 424 TFLOP/s fwd+bwd, 1.02x cuDNN
(the Triton kernel: 0.72x), within 3.9e-3 of the f32 reference; 1.05x cuDNN at head_dim 64,
1.13x with a window of 1024, 0.89x at 16k tokens, and 0.34x at head_dim 256 (its backward:
16.6 ms against a 1.35 ms forward, where cuDNN takes 5.7 ms in all). ptxas, in a deviceless
compile (``ptxas_report.py``), gave the cause: each dK/dV compute warpgroup held two [64, 256]
f32 accumulators, 256 registers per thread against the 232 it asks for, so it spilled 4 KB and
serialised its wgmmas. At head_dim 256 the dK/dV kernel now runs in two head-dim column parts
(``dkv_parts``; no serialised wgmma, about 1 KB of spills left in each backward kernel); its
speed on a GPU is not measured yet. Reached through
``flash_attention(..., gpu_kernel="mosaic")``, ``model.attention_impl: pallas_mosaic``, and as
the blocks of chunked / ring attention (``blocks.py``: separate query-side and key-side segment
ids, the merged LSE and delta given to the backward) and Ulysses' per-head attention;
``auto`` chooses it where the measured table says it is faster than cuDNN by a margin
(planning/attention_speeds.py: today sliding windows on Hopper).

The interpreter runs each warpgroup as a separate XLA CPU program whose barrier waits block
inside host callbacks; with one CPU device on a 2-core host the CPU client's threads can all
be held by blocked waits, and a kernel then hangs (the memory warpgroup never issues its
first TMA). That, not a barrier-phase bug, was the "causal + window + segments deadlock":
with ``--xla_force_host_platform_device_count=8`` (tests/conftest.py sets it) the same call
completes and matches the reference.

Beside the portable kernel (``flash_attention.py``: Triton on other GPUs, Mosaic on TPU,
the interpreter on CPU), with the same semantics (``reference.py``): causal, GQA,
segment ids, sliding windows (causal or symmetric) and ``q_offset``. Logit softcap is not
implemented here (``unsupported_reason`` says so and the dispatcher keeps Triton).

Learnt from JAX's ``jax/experimental/pallas/ops/gpu/attention_mgpu.py`` (FA3-style
forward): each CTA has two compute warpgroups of ``block_q`` (64) query rows and one
memory warpgroup that streams K/V blocks by TMA into ``steps`` shared-memory slots,
with one "full" barrier per slot (TMA arrival) and one "consumed" barrier per slot (both
compute warpgroups arrive); a two-arrival "schedule" barrier makes the two compute
warpgroups take turns on the tensor cores (one's QK^T wgmma overlaps the other's
softmax); m is kept in log2 units so exp becomes exp2 with an FMA; JAX splits the causal
KV loop into an unmasked part and a masked diagonal. JAX's backward has no causal
support; ours extends the same scheme:

* Every kernel streams the union range of blocks its CTA needs (``ranges_for_q_tile``
  / ``ranges_for_kv_tile`` of ``tile_ranges.py``: causal, window and padding block
  skipping with the same formulas as the Triton kernel). Each compute warpgroup runs
  five loops over it: skip (before its own first block), masked edge, unmasked middle,
  masked edge, skip (after its last). Skipped steps still wait on the slot's barriers
  and arrive on its consumed barriers: Mosaic GPU tracks barrier phases per thread, so
  every warpgroup must see every phase, and the memory warpgroup may only refill a
  slot both compute warpgroups released.
* Position masks (iota compares) run only on edge blocks; segment masks on every block
  when segment ids are given (compared from TMA'd int32 vectors in the WGMMA layout).
* dQ kernel: tiles of queries stream K/V (like the forward). dK/dV kernel: tiles of
  keys stream Q/dO/LSE/delta of *every query head of the group* (GQA), so dK/dV are
  summed in registers and written once in the input dtype (no per-query-head f32
  partials in HBM as in JAX's and the Triton kernel).
* Masked probabilities are zeroed with a select after exp2 in the backward, so rows
  that see no key (a ``q_offset`` past the window) stay finite whatever their LSE.
* The backward kernels follow JAX's ``kernel_dq`` / ``kernel_dkv`` (S^T = K Q^T tiles
  in dK/dV, LSE and delta loaded as column vectors in ``Layout.WGMMA.reduce(0)``) without
  the forward's schedule barrier: each step waits on its slot's full barriers and
  releases it after its last wgmma. LSE enters in log2 units, +inf for padded queries and
  for rows that saw no key. At head_dim 256 they keep one stream slot (``steps_bwd=1``):
  two resident [64, 256] tiles per compute warpgroup leave room for no second one; and the
  dK/dV kernel accumulates one of ``dkv_parts`` column parts of the head dim per CTA (the
  grid's head axis runs over kv heads x parts), every part computing S^T and dP^T over the
  whole head dim: shared-memory operands are held as column parts, so a part is a leading
  index and wgmma sums the parts' products for S^T and dP^T.
* The memory warpgroup also waits on the last releases before it ends (jax 0.11's
  interpreter requires every warpgroup that waited on a barrier to see all its phases).

Layout: ``[batch, seq, heads, head_dim]`` in HBM (TMA takes the per-head
``[block, head_dim]`` slices directly); LSE float32 ``[batch, q_heads, seq]`` in natural
log units (1-D TMA of ``block_q`` entries). The sequence is padded to a multiple of
every tile (``mgpu_config``) by the caller (``flash_attention_mgpu``), padded keys
masked by position, padded queries given LSE = +inf in the backward (zero probabilities).

On CPU the kernels run in Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``), which
does not implement ``pl.run_state`` on wgmma accumulators nor wgmma with a register
operand: ``_mma_into`` then adds a fresh product (a plain dot for register operands).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtrain.pallas_kernels.remat_names import ATTENTION_RESIDUALS
from jaxtrain.pallas_kernels.sinks import sink_grad
from jaxtrain.pallas_kernels.tile_ranges import position_mask, ranges_for_kv_tile, ranges_for_q_tile

__all__ = [
    "HEAD_DIMS",
    "MgpuConfig",
    "flash_attention_mgpu",
    "mgpu_bwd",
    "mgpu_config",
    "mgpu_fwd",
    "seq_tile",
    "ring_chunk_misfit",
    "softmax_delta",
    "unsupported_reason",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Masked scores (log2 units): finite, so fully masked rows give exp2(0) = 1, not NaN; an
# allowed score is far above it, so one allowed key makes alpha = exp2(MASK - m) = 0.
_MASK = -1e30
_LSE_EMPTY = -0.7 * float(jnp.finfo(jnp.float32).max)  # the Triton kernel's LSE of a row that saw no key
_COMPUTE_WGS = 2
HEAD_DIMS = (64, 128, 256)  # the wgmma tiles written for (models/config.py checks it too)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static configuration of one set of Mosaic GPU kernel calls (hashable).

    ``causal``, ``window``, ``seq_len`` and ``q_offset`` carry the names
    ``ranges_for_q_tile`` / ``ranges_for_kv_tile`` read, so the block-skipping
    formulas are shared with the Triton kernel.
    """

    causal: bool
    window: int | None
    scale: float
    seq_len: int  # valid length
    seq_pad: int  # multiple of 2 * block_q, block_kv, block_kv_dq, 2 * block_kv_dkv, block_q_dkv
    q_heads: int
    kv_heads: int
    head_dim: int
    block_q: int = 64  # rows per compute warpgroup (forward, dQ)
    block_kv: int = 128  # streamed key block (forward)
    block_kv_dq: int = 64  # streamed key block (dQ: S, dP and dQ live in registers at once)
    block_q_dkv: int = 64  # streamed query block (dK/dV)
    block_kv_dkv: int = 64  # key rows per compute warpgroup (dK/dV)
    steps: int = 2  # shared-memory slots per stream (max_concurrent_steps), forward
    steps_bwd: int = 2  # the same for the dQ and dK/dV kernels
    dkv_parts: int = 1  # head-dim column parts the dK/dV kernel accumulates in separate CTAs
    q_offset: int = 0
    interpret: bool = False

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def default_blocks(head_dim: int) -> dict:
    """JAX's tuned FA3 shape: 64-row warpgroups; K/V blocks of 128 (64 at head_dim 256, where
    two 128-row K and V slots would exceed the 227 KiB of shared memory); the backward streams
    64-row blocks (S, dP and the dQ accumulator share the registers)."""
    if head_dim > 128:
        # The backward kernels keep two [64, 256] tiles per compute warpgroup resident (Q
        # and dO, or K and V): 128 KiB, so one 64 KiB slot pair of the stream fits, not two.
        # Full-width dK and dV accumulators ([64, 256] f32 each, 256 registers a thread) do not
        # fit the 232 a compute warpgroup gets: ptxas spilled 4 KB and serialised the wgmmas
        # (ptxas_report.py). Two column parts of 128 fit, as at head_dim 128.
        return dict(
            block_q=64,
            block_kv=64,
            block_kv_dq=64,
            block_q_dkv=64,
            block_kv_dkv=64,
            steps=2,
            steps_bwd=1,
            dkv_parts=2,
        )
    return dict(
        block_q=64,
        block_kv=128,
        block_kv_dq=64,
        block_q_dkv=64,
        block_kv_dkv=64,
        steps=2,
        steps_bwd=2,
        dkv_parts=1,
    )


def unsupported_reason(*, head_dim: int, dtype, softcap=None, v_head_dim=None) -> str | None:
    """Why this kernel cannot run a case (the dispatcher then keeps Triton), or None."""
    if softcap is not None:
        return "softcap is not implemented in the Mosaic GPU kernel"
    if v_head_dim not in (None, head_dim):
        return f"value head_dim {v_head_dim} != query/key head_dim {head_dim}: not in the Mosaic GPU kernel"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16/float16 (wgmma operands)"
    return None


def seq_tile(head_dim: int, **blocks) -> int:
    """The length every padded sequence is a multiple of: a CTA's queries (two warpgroups'
    rows) and keys, and every streamed block."""
    b = {**default_blocks(head_dim), **blocks}
    return math.lcm(
        _COMPUTE_WGS * b["block_q"],
        b["block_kv"],
        b["block_kv_dq"],
        _COMPUTE_WGS * b["block_kv_dkv"],
        b["block_q_dkv"],
    )


def ring_chunk_misfit(seq_len: int, context: int, head_dim: int) -> tuple[int, int] | None:
    """(chunk, tile) when load-balanced ring attention's chunks (seq_len / (2 * context)
    tokens) are no multiple of this kernel's tile, so it cannot run them as blocks; else None."""
    chunk, tile = seq_len // (2 * context), seq_tile(head_dim)
    return (chunk, tile) if chunk % tile else None


def mgpu_config(
    *,
    causal: bool,
    window: int | None,
    scale: float,
    seq_len: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_offset: int = 0,
    interpret: bool = False,
    **blocks,
) -> MgpuConfig:
    """Config with the sequence padded to a multiple of every tile (``seq_tile``)."""
    b = {**default_blocks(head_dim), **blocks}
    parts = b["dkv_parts"]
    if parts < 1 or head_dim % parts or (head_dim // parts) % 64:
        raise ValueError(
            f"dkv_parts={parts}: head_dim {head_dim} must split into parts of a multiple of 64 "
            "columns (the 128-byte swizzle of a wgmma operand)"
        )
    unit = seq_tile(head_dim, **blocks)
    seq_pad = -(-seq_len // unit) * unit
    return MgpuConfig(
        causal=bool(causal),
        window=window,
        scale=float(scale),
        seq_len=seq_len,
        seq_pad=seq_pad,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_offset=int(q_offset),
        interpret=bool(interpret),
        **b,
    )


# ----------------------------------------------------------------------------
# Helpers shared by the three kernels.
# ----------------------------------------------------------------------------

_TRANSFORMS = lambda: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _mma_into(acc, a, b, interpret: bool):
    """acc + a @ b on the tensor cores (wgmma), acc f32 in the WGMMA layout."""
    if interpret:
        if isinstance(a, jax.Array):  # the interpreter's wgmma takes shared-memory operands only
            return acc + lax.dot(a, b[...], preferred_element_type=jnp.float32)
        return acc + _mma(a, b, acc.shape)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b))(plgpu.ACC.init(acc))


def _mma(a, b, shape):
    """a @ b into a fresh f32 accumulator."""
    return _mma_sum([(a, b)], shape)


def _mma_sum(pairs, shape):
    """sum(a @ b for a, b in pairs) into a fresh f32 accumulator."""

    def run(ref):
        for a, b in pairs:
            plgpu.wgmma(ref, a, b)
        return ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _row_vector(value, n):
    """[n] f32 in the layout of a WGMMA tile's rows (reduced over columns)."""
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def _position_mask(cfg: MgpuConfig, shape, q0, k0, *, q_axis: int):
    """Causal / window / key-padding mask of a tile whose queries run along ``q_axis``."""
    qpos = q0 + cfg.q_offset + plgpu.broadcasted_iota(jnp.int32, shape, q_axis, layout=plgpu.Layout.WGMMA)
    kpos = k0 + plgpu.broadcasted_iota(jnp.int32, shape, 1 - q_axis, layout=plgpu.Layout.WGMMA)
    return position_mask(cfg, qpos, kpos)


def _and_mask(a, b):
    if a is None:
        return b
    return a if b is None else jnp.logical_and(a, b)


def _slot(buf, slot):
    """A stream buffer's slot: ``buf.at[slot]``, or ``buf(slot)`` for one laid out otherwise."""
    return buf(slot) if callable(buf) else buf.at[slot]


def _produce(num_steps, steps: int, groups):
    """Memory warpgroup: TMA step t's blocks into slot t % steps, refilling a slot only
    after both compute warpgroups released it (and waiting for the last releases).
    ``groups``: (consumed barriers, [(source(t) -> gmem ref, smem slots or slot -> smem ref,
    full barriers), ...]) per release group."""

    def issue(t, slot):
        for _, loads in groups:
            for src, buf, full in loads:
                plgpu.copy_gmem_to_smem(src(t), _slot(buf, slot), full.at[slot])

    for i in range(steps):

        @pl.when(i < num_steps)
        def _():
            issue(jnp.int32(i), i)

    @pl.loop(jnp.int32(steps), num_steps)
    def _(t):
        slot = lax.rem(t, jnp.int32(steps))
        for consumed, loads in groups:
            plgpu.barrier_wait(consumed.at[slot])
            for src, buf, full in loads:
                plgpu.copy_gmem_to_smem(src(t), _slot(buf, slot), full.at[slot])

    # Observe the last releases too: jax 0.11's interpreter requires every warpgroup that
    # waited on a barrier to have seen all its phases when the kernel ends.
    @pl.loop(jnp.maximum(num_steps - steps, 0), num_steps)
    def _(t):
        slot = lax.rem(t, jnp.int32(steps))
        for consumed, _ in groups:
            plgpu.barrier_wait(consumed.at[slot])


def _stream_kv(start, num_steps, bk, steps, refs, smem, full, consumed, b, kv_head):
    """The memory warpgroup of the forward and dQ kernels: K blocks (with the keys' segment
    ids, when given) and V blocks ``start ..`` of one kv head into their slots."""
    plgpu.set_max_registers(40, action="decrease")
    (k_ref, v_ref, seg_ref), (k_smem, v_smem, kseg_smem) = refs, smem
    (k_full, v_full, kseg_full), (k_consumed, v_consumed) = full, consumed
    blk = lambda t: pl.ds((start + t) * bk, bk)
    k_loads = [(lambda t: k_ref.at[b, blk(t), kv_head], k_smem, k_full)]
    if seg_ref is not None:
        k_loads.append((lambda t: seg_ref.at[b, blk(t)], kseg_smem, kseg_full))
    v_loads = [(lambda t: v_ref.at[b, blk(t), kv_head], v_smem, v_full)]
    _produce(num_steps, steps, [(k_consumed, k_loads), (v_consumed, v_loads)])


def _five_loops(start, own, end, step, skip, carry):
    """Runs stream steps [start, end): skip before own[0], masked [own0, own1), unmasked
    [own1, own2), masked [own2, own3), skip after own[3]. ``step(t, carry, masked)``,
    ``skip(t)``; t is the block index."""
    lo, fl, fh, hi = own
    lo = jnp.maximum(lo, start)
    hi = jnp.minimum(jnp.maximum(hi, lo), end)
    fl, fh = jnp.clip(fl, lo, hi), jnp.clip(fh, lo, hi)
    fh = jnp.maximum(fh, fl)
    pl.loop(start, lo)(lambda t: skip(t))
    carry = lax.fori_loop(lo, fl, lambda t, c: step(t, c, True), carry)
    carry = lax.fori_loop(fl, fh, lambda t, c: step(t, c, False), carry)
    carry = lax.fori_loop(fh, hi, lambda t, c: step(t, c, True), carry)
    pl.loop(hi, end)(lambda t: skip(t))
    return carry


def _kernel_call(body, cfg: MgpuConfig, *, out_type, grid, grid_names, scratch):
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None,
    )


# ----------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------


def mgpu_fwd(q, k, v, segments, cfg: MgpuConfig):
    """(out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] f32, natural log) for padded inputs;
    ``segments``: None or (the queries' segment ids, the keys') [B, S] int32."""
    batch, seq, q_heads, head_dim = q.shape
    bq, bk, n = cfg.block_q, cfg.block_kv, cfg.steps
    has_seg = segments is not None
    dtype = q.dtype
    c2 = cfg.scale * _LOG2E  # scores in log2 units

    def flash_fwd(q_ref, k_ref, v_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, out_ref, lse_ref, bufs, full, consumed, sched = rest
        else:
            out_ref, lse_ref, bufs, full, consumed, sched = rest
            qseg_ref = kseg_ref = None
        qo_smem2, lse_smem2, qseg_smem2, k_smem, v_smem, kseg_smem = bufs
        q_full, k_full, v_full, kseg_full, qseg_full = full
        k_consumed, v_consumed = consumed
        b = lax.axis_index("batch")
        head = lax.axis_index("heads")
        kv_head = lax.div(head, jnp.int32(cfg.group))
        wg = lax.axis_index("wg")
        cta_q0 = lax.axis_index("q_seq") * (_COMPUTE_WGS * bq)
        start, _, _, end = ranges_for_q_tile(cfg, cta_q0, _COMPUTE_WGS * bq, bk)
        num_steps = end - start

        def sched_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            q0 = cta_q0 + wg * bq
            own = ranges_for_q_tile(cfg, q0, bq, bk)
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), head], qo_smem, q_full.at[wg])
            if has_seg:
                plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(q0, bq)], qseg_smem2.at[wg], qseg_full.at[wg])
                plgpu.barrier_wait(qseg_full.at[wg])
                q_seg = plgpu.load(qseg_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            plgpu.barrier_wait(q_full.at[wg])

            def slot_of(t):
                return lax.rem(t - start, jnp.int32(n))

            def wait_next_k(t):
                @pl.when(t + 1 < end)
                def _():
                    plgpu.barrier_wait(k_full.at[slot_of(t + 1)])

            def step(t, carry, masked):
                acc, m_i, l_i = carry
                slot = slot_of(t)
                k0 = t * bk
                s = _mma(qo_smem, k_smem.at[slot].transpose((1, 0)), (bq, bk))
                sched_barrier()
                mask = _position_mask(cfg, (bq, bk), q0, k0, q_axis=0) if masked else None
                if has_seg:
                    plgpu.barrier_wait(kseg_full.at[slot])
                    k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    same = lax.broadcast_in_dim(q_seg, (bq, bk), [0]) == lax.broadcast_in_dim(
                        k_seg, (bq, bk), [1]
                    )
                    mask = _and_mask(mask, same)
                plgpu.barrier_arrive(k_consumed.at[slot])
                s = s * c2
                if mask is not None:
                    s = jnp.where(mask, s, _MASK)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha
                p16 = p.astype(dtype)
                # JAX's order: the row sum before the barrier pays for head_dim <= 128.
                if head_dim <= 128:
                    l_i = l_i + p.sum(axis=1)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(sched)
                if head_dim > 128:
                    l_i = l_i + p.sum(axis=1)
                acc = _mma_into(acc, p16, v_smem.at[slot], cfg.interpret)
                wait_next_k(t)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l_i

            def skip(t):
                slot = slot_of(t)
                if has_seg:
                    plgpu.barrier_wait(kseg_full.at[slot])
                plgpu.barrier_arrive(k_consumed.at[slot])
                sched_barrier()
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(sched)
                wait_next_k(t)
                plgpu.barrier_arrive(v_consumed.at[slot])

            @pl.when(num_steps > 0)
            def _():
                plgpu.barrier_wait(k_full.at[0])

            pl.when(wg == 1)(sched_barrier)
            carry = (_zeros((bq, head_dim)), _row_vector(_MASK, bq), _row_vector(0.0, bq))
            acc, m_i, l_i = _five_loops(start, own, end, step, skip, carry)
            pl.when(wg == 0)(sched_barrier)

            # A row that saw no allowed key (only with a q_offset, or padding) keeps m at
            # the mask value: output 0 and the Triton kernel's empty LSE.
            empty = m_i <= 0.5 * _MASK
            inv = jnp.where(empty, 0.0, 1.0 / l_i)
            acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem2.at[wg][...] = jnp.where(empty, _LSE_EMPTY, (m_i + jnp.log2(l_i)) * _LN2)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q0, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[b, head, pl.ds(q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _memory():
            _stream_kv(
                start,
                num_steps,
                bk,
                n,
                (k_ref, v_ref, kseg_ref),
                (k_smem, v_smem, kseg_smem),
                (k_full, v_full, kseg_full),
                (k_consumed, v_consumed),
                b,
                kv_head,
            )

    tf = _TRANSFORMS()
    bufs = (
        plgpu.SMEM((_COMPUTE_WGS, bq, head_dim), dtype, transforms=tf),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.int32) if has_seg else None,
        plgpu.SMEM((n, bk, head_dim), dtype, transforms=tf),
        plgpu.SMEM((n, bk, head_dim), dtype, transforms=tf),
        plgpu.SMEM((n, bk), jnp.int32) if has_seg else None,
    )
    full = (
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n) if has_seg else None,
        plgpu.Barrier(num_barriers=_COMPUTE_WGS) if has_seg else None,
    )
    consumed = (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=n),) * 2
    sched = plgpu.Barrier(num_arrivals=_COMPUTE_WGS)
    out_type = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((batch, q_heads, seq), jnp.float32),
    )
    call = _kernel_call(
        flash_fwd,
        cfg,
        out_type=out_type,
        grid=(q_heads, seq // (_COMPUTE_WGS * bq), batch),
        grid_names=("heads", "q_seq", "batch"),
        scratch=(bufs, full, consumed, sched),
    )
    return call(q, k, v, *(segments or ()))


def softmax_delta(out, do):
    """rowsum(out * dO) [B, Hq, S] f32: the softmax backward's correction, O(S) work in XLA."""
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def mgpu_bwd(q, k, v, segments, lse, delta, do, cfg: MgpuConfig):
    """(dq, dk, dv) in the inputs' dtypes for padded inputs: the dQ kernel and the dK/dV kernel.

    ``lse`` (natural log) and ``delta`` (``softmax_delta``) are the whole row's: the forward's,
    or, for one block of ring attention, the ones merged over every block. LSE goes to the
    kernels in log2 units, +inf for padded queries and for rows that saw no key (their
    probabilities are then exactly 0).
    """
    valid = jnp.arange(q.shape[1]) < cfg.seq_len
    empty = lse <= 0.5 * _LSE_EMPTY
    lse2 = jnp.where(valid & ~empty, lse * _LOG2E, jnp.inf)
    dq = _dq_call(q, k, v, do, lse2, delta, segments, cfg)
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, segments, cfg)
    return dq, dk, dv


def _dq_call(q, k, v, do, lse2, delta, segments, cfg: MgpuConfig):
    """dQ: each compute warpgroup owns ``block_q`` query rows (Q, dO, LSE, delta in shared
    memory) and streams the CTA's K/V blocks like the forward; dQ stays in registers."""
    batch, seq, q_heads, head_dim = q.shape
    bq, bk, n = cfg.block_q, cfg.block_kv_dq, cfg.steps_bwd
    has_seg = segments is not None
    dtype = q.dtype
    c2 = cfg.scale * _LOG2E

    def flash_dq(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, dq_ref, bufs, full, consumed = rest
        else:
            dq_ref, bufs, full, consumed = rest
            qseg_ref = kseg_ref = None
        q_smem2, do_smem2, lse_smem2, delta_smem2, qseg_smem2, k_smem, v_smem, kseg_smem = bufs
        own_full, k_full, v_full, kseg_full = full
        k_consumed, v_consumed = consumed
        b = lax.axis_index("batch")
        head = lax.axis_index("heads")
        kv_head = lax.div(head, jnp.int32(cfg.group))
        wg = lax.axis_index("wg")
        cta_q0 = lax.axis_index("q_seq") * (_COMPUTE_WGS * bq)
        start, _, _, end = ranges_for_q_tile(cfg, cta_q0, _COMPUTE_WGS * bq, bk)
        num_steps = end - start

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q0 = cta_q0 + wg * bq
            own = ranges_for_q_tile(cfg, q0, bq, bk)
            rows = (b, pl.ds(q0, bq), head)
            loads = [
                (q_ref.at[rows], q_smem),
                (do_ref.at[rows], do_smem),
                (lse_ref.at[b, head, pl.ds(q0, bq)], lse_smem2.at[wg]),
                (delta_ref.at[b, head, pl.ds(q0, bq)], delta_smem2.at[wg]),
            ]
            if has_seg:
                loads.append((qseg_ref.at[b, pl.ds(q0, bq)], qseg_smem2.at[wg]))
            for j, (src, dst) in enumerate(loads):
                plgpu.copy_gmem_to_smem(src, dst, own_full[j].at[wg])
            for j in range(len(loads)):
                plgpu.barrier_wait(own_full[j].at[wg])
            row = plgpu.Layout.WGMMA.reduce(1)
            lse = plgpu.load(lse_smem2.at[wg], layout=row)
            delta = plgpu.load(delta_smem2.at[wg], layout=row)
            rows_of = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])  # in the step: registers
            q_seg = plgpu.load(qseg_smem2.at[wg], layout=row) if has_seg else None

            def slot_of(t):
                return lax.rem(t - start, jnp.int32(n))

            def step(t, dq, masked):
                slot = slot_of(t)
                plgpu.barrier_wait(k_full.at[slot])
                s = _mma(q_smem, k_smem.at[slot].transpose((1, 0)), (bq, bk))
                mask = _position_mask(cfg, (bq, bk), q0, t * bk, q_axis=0) if masked else None
                if has_seg:
                    plgpu.barrier_wait(kseg_full.at[slot])
                    k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    same = lax.broadcast_in_dim(q_seg, (bq, bk), [0]) == lax.broadcast_in_dim(
                        k_seg, (bq, bk), [1]
                    )
                    mask = _and_mask(mask, same)
                plgpu.barrier_wait(v_full.at[slot])
                dp = _mma(do_smem, v_smem.at[slot].transpose((1, 0)), (bq, bk))
                plgpu.barrier_arrive(v_consumed.at[slot])
                p = jnp.exp2(s * c2 - rows_of(lse))
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                ds = p * (dp - rows_of(delta))
                dq = _mma_into(dq, ds.astype(dtype), k_smem.at[slot], cfg.interpret)
                plgpu.barrier_arrive(k_consumed.at[slot])
                return dq

            def skip(t):
                slot = slot_of(t)
                plgpu.barrier_wait(k_full.at[slot])
                if has_seg:
                    plgpu.barrier_wait(kseg_full.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                plgpu.barrier_arrive(k_consumed.at[slot])

            dq = _five_loops(start, own, end, step, skip, _zeros((bq, head_dim)))
            q_smem[...] = (dq * cfg.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _memory():
            _stream_kv(
                start,
                num_steps,
                bk,
                n,
                (k_ref, v_ref, kseg_ref),
                (k_smem, v_smem, kseg_smem),
                (k_full, v_full, kseg_full),
                (k_consumed, v_consumed),
                b,
                kv_head,
            )

    tf = _TRANSFORMS()
    bufs = (
        plgpu.SMEM((_COMPUTE_WGS, bq, head_dim), dtype, transforms=tf),
        plgpu.SMEM((_COMPUTE_WGS, bq, head_dim), dtype, transforms=tf),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.int32) if has_seg else None,
        plgpu.SMEM((n, bk, head_dim), dtype, transforms=tf),
        plgpu.SMEM((n, bk, head_dim), dtype, transforms=tf),
        plgpu.SMEM((n, bk), jnp.int32) if has_seg else None,
    )
    own_full = tuple(plgpu.Barrier(num_barriers=_COMPUTE_WGS) for _ in range(5 if has_seg else 4))
    full = (
        own_full,
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n) if has_seg else None,
    )
    consumed = (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=n),) * 2
    call = _kernel_call(
        flash_dq,
        cfg,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(q_heads, seq // (_COMPUTE_WGS * bq), batch),
        grid_names=("heads", "q_seq", "batch"),
        scratch=(bufs, full, consumed),
    )
    return call(q, k, v, do, lse2, delta, *(segments or ()))


def _dkv_call(q, k, v, do, lse2, delta, segments, cfg: MgpuConfig):
    """dK, dV: each compute warpgroup owns ``block_kv_dkv`` key rows (K, V in shared memory);
    the stream is (query block, query head of the GQA group) pairs, step t = block * group +
    head, carrying Q, dO, LSE and delta, so dK/dV of the kv head sum in registers.

    With ``dkv_parts`` p > 1 a CTA computes dK and dV for one of p column parts of the head
    dim only (the grid's head axis runs over kv heads x parts), so each warpgroup holds two
    [block_kv_dkv, head_dim / p] accumulators instead of two full-width ones. S^T and dP^T still
    contract over the whole head dim, so every part computes them again: (2p + 2) / 4 times
    the kernel's FLOPs, 1.5x at p = 2, in exchange for no register spills. Every
    shared-memory operand is stored as p column parts (TMA loads each part of a row block), so
    the part a CTA accumulates is a leading-dimension index."""
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    bq, bk, n, g = cfg.block_q_dkv, cfg.block_kv_dkv, cfg.steps_bwd, cfg.group
    parts = cfg.dkv_parts
    w = head_dim // parts
    has_seg = segments is not None
    dtype = q.dtype
    c2 = cfg.scale * _LOG2E
    cols = [pl.ds(h * w, w) for h in range(parts)]

    def flash_dkv(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, dk_ref, dv_ref, bufs, full, consumed = rest
        else:
            dk_ref, dv_ref, bufs, full, consumed = rest
            qseg_ref = kseg_ref = None
        k_smem2, v_smem2, kseg_smem2, q_smem, do_smem, lse_smem, delta_smem, qseg_smem = bufs
        own_full, q_full, do_full, lse_full, delta_full, qseg_full = full
        b = lax.axis_index("batch")
        kv_head = lax.div(lax.axis_index("heads"), jnp.int32(parts))
        part = lax.rem(lax.axis_index("heads"), jnp.int32(parts))
        wg = lax.axis_index("wg")
        cta_k0 = lax.axis_index("kv_seq") * (_COMPUTE_WGS * bk)
        start, _, _, end = ranges_for_kv_tile(cfg, cta_k0, _COMPUTE_WGS * bk, bq)
        num_steps = (end - start) * g

        def column_part(buf, i, h):
            """Column part h of a buffer's i-th tile (a warpgroup's K/V, a stream slot's Q/dO):
            the parts of one tile are consecutive along the leading dimension."""
            return buf.at[i * parts + h]

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            own_k = lambda h: column_part(k_smem2, wg, h)
            own_v = lambda h: column_part(v_smem2, wg, h)
            k0 = cta_k0 + wg * bk
            own = tuple(x * g for x in ranges_for_kv_tile(cfg, k0, bk, bq))
            rows = (b, pl.ds(k0, bk), kv_head)
            loads = [(k_ref.at[(*rows, cols[h])], own_k(h)) for h in range(parts)]
            loads += [(v_ref.at[(*rows, cols[h])], own_v(h)) for h in range(parts)]
            if has_seg:
                loads.append((kseg_ref.at[b, pl.ds(k0, bk)], kseg_smem2.at[wg]))
            for j, (src, dst) in enumerate(loads):
                plgpu.copy_gmem_to_smem(src, dst, own_full[j].at[wg])
            for j in range(len(loads)):
                plgpu.barrier_wait(own_full[j].at[wg])
            col = plgpu.Layout.WGMMA.reduce(0)  # a vector along the query (column) axis
            k_seg = plgpu.load(kseg_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1)) if has_seg else None

            def slot_of(t):
                return lax.rem(t - start * g, jnp.int32(n))

            def step(t, carry, masked):
                dk, dv = carry
                slot = slot_of(t)
                q_at = lambda h: column_part(q_smem, slot, h)
                do_at = lambda h: column_part(do_smem, slot, h)
                q0 = lax.div(t, jnp.int32(g)) * bq
                for h in range(parts):
                    plgpu.barrier_wait(q_full[h].at[slot])
                s_t = _mma_sum([(own_k(h), q_at(h).transpose((1, 0))) for h in range(parts)], (bk, bq))
                mask = _position_mask(cfg, (bk, bq), q0, k0, q_axis=1) if masked else None
                if has_seg:
                    plgpu.barrier_wait(qseg_full.at[slot])
                    q_seg = plgpu.load(qseg_smem.at[slot], layout=col)
                    same = lax.broadcast_in_dim(k_seg, (bk, bq), [0]) == lax.broadcast_in_dim(
                        q_seg, (bk, bq), [1]
                    )
                    mask = _and_mask(mask, same)
                plgpu.barrier_wait(lse_full.at[slot])
                lse = plgpu.load(lse_smem.at[slot], layout=col)
                p_t = jnp.exp2(s_t * c2 - lax.broadcast_in_dim(lse, (bk, bq), [1]))
                if mask is not None:
                    p_t = jnp.where(mask, p_t, 0.0)
                for h in range(parts):
                    plgpu.barrier_wait(do_full[h].at[slot])
                dv = _mma_into(dv, p_t.astype(dtype), do_at(part), cfg.interpret)
                dp_t = _mma_sum([(own_v(h), do_at(h).transpose((1, 0))) for h in range(parts)], (bk, bq))
                plgpu.barrier_wait(delta_full.at[slot])
                delta = plgpu.load(delta_smem.at[slot], layout=col)
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, (bk, bq), [1]))
                dk = _mma_into(dk, ds_t.astype(dtype), q_at(part), cfg.interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            def skip(t):
                slot = slot_of(t)
                bars = (*q_full, *do_full, lse_full, delta_full) + ((qseg_full,) if has_seg else ())
                for bar in bars:
                    plgpu.barrier_wait(bar.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])

            zeros = _zeros((bk, w))
            dk, dv = _five_loops(start * g, own, end * g, step, skip, (zeros, zeros))
            # K and V are no longer read: their own part's buffers take the results
            dk_smem, dv_smem = own_k(part), own_v(part)
            dk_smem[...] = (dk * cfg.scale).astype(dtype)
            dv_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            out = (*rows, pl.ds(part * w, w))
            plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[out], commit_group=False)
            plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[out], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            blk = lambda t: pl.ds((start + lax.div(t, jnp.int32(g))) * bq, bq)
            head = lambda t: kv_head * g + lax.rem(t, jnp.int32(g))
            loads = []
            for h in range(parts):
                at_part = lambda buf, h=h: lambda slot: column_part(buf, slot, h)
                rows_of = lambda ref, h=h: lambda t: ref.at[b, blk(t), head(t), cols[h]]
                loads.append((rows_of(q_ref), at_part(q_smem), q_full[h]))
                loads.append((rows_of(do_ref), at_part(do_smem), do_full[h]))
            loads += [
                (lambda t: lse_ref.at[b, head(t), blk(t)], lse_smem, lse_full),
                (lambda t: delta_ref.at[b, head(t), blk(t)], delta_smem, delta_full),
            ]
            if has_seg:
                loads.append((lambda t: qseg_ref.at[b, blk(t)], qseg_smem, qseg_full))
            _produce(num_steps, n, [(consumed, loads)])

    tf = _TRANSFORMS()
    bufs = (
        plgpu.SMEM((_COMPUTE_WGS * parts, bk, w), dtype, transforms=tf),
        plgpu.SMEM((_COMPUTE_WGS * parts, bk, w), dtype, transforms=tf),
        plgpu.SMEM((_COMPUTE_WGS, bk), jnp.int32) if has_seg else None,
        plgpu.SMEM((n * parts, bq, w), dtype, transforms=tf),
        plgpu.SMEM((n * parts, bq, w), dtype, transforms=tf),
        plgpu.SMEM((n, bq), jnp.float32),
        plgpu.SMEM((n, bq), jnp.float32),
        plgpu.SMEM((n, bq), jnp.int32) if has_seg else None,
    )
    full = (
        tuple(plgpu.Barrier(num_barriers=_COMPUTE_WGS) for _ in range(2 * parts + has_seg)),
        tuple(plgpu.Barrier(num_barriers=n) for _ in range(parts)),
        tuple(plgpu.Barrier(num_barriers=n) for _ in range(parts)),
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n),
        plgpu.Barrier(num_barriers=n) if has_seg else None,
    )
    consumed = plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=n)
    kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
    call = _kernel_call(
        flash_dkv,
        cfg,
        out_type=(kv_shape, kv_shape),
        grid=(kv_heads * parts, seq // (_COMPUTE_WGS * bk), batch),
        grid_names=("heads", "kv_seq", "batch"),
        scratch=(bufs, full, consumed),
    )
    return call(q, k, v, do, lse2, delta, *(segments or ()))


# ----------------------------------------------------------------------------
# Differentiable entry point.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segment_ids, sinks, cfg: MgpuConfig):
    return _flash_fwd(q, k, v, segment_ids, sinks, cfg)[0]


def _self_segments(segment_ids):
    """Self-attention: the queries' segment ids are the keys'."""
    return None if segment_ids is None else (segment_ids, segment_ids)


def _with_sinks(out, lse, sinks):
    """The kernel's (out, lse) with each head's sink logit added to the softmax denominator
    (in XLA: O(S) work): lse' = logaddexp(lse, sink), out' = out exp(lse - lse'). The backward
    kernels then run on (out', lse') unchanged."""
    if sinks is None:
        return out, lse
    new = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
    weight = jnp.exp(lse - new).transpose(0, 2, 1)[..., None]  # [B, S, Hq, 1]
    return (out.astype(jnp.float32) * weight).astype(out.dtype), new


def _flash_fwd(q, k, v, segment_ids, sinks, cfg: MgpuConfig):
    out, lse = _with_sinks(*mgpu_fwd(q, k, v, _self_segments(segment_ids), cfg), sinks)
    # Named as the Triton kernel names its own (remat_names.py): a remat policy keeping
    # `context` then saves these, and the backward runs no second forward kernel.
    out, lse = (checkpoint_name(x, ATTENTION_RESIDUALS) for x in (out, lse))
    return out, (q, k, v, segment_ids, sinks, out, lse)


def _flash_bwd(cfg: MgpuConfig, residuals, do):
    q, k, v, segment_ids, sinks, out, lse = residuals
    delta = softmax_delta(out, do)
    dq, dk, dv = mgpu_bwd(q, k, v, _self_segments(segment_ids), lse, delta, do, cfg)
    if sinks is None:
        return dq, dk, dv, None, None
    # dS of the sink column: P_sink (0 - delta), over the real queries (the padded ones' dO is 0)

    return dq, dk, dv, None, sink_grad(sinks, lse, delta)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_mgpu(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    q_offset: int = 0,
    interpret: bool = False,
    sinks=None,
    **blocks,
):
    """Attention with ``reference.attention``'s semantics on the Mosaic GPU kernels.

    Inputs are validated by the caller (``flash_attention``); here only what this kernel
    cannot do raises (``unsupported_reason``). ``blocks`` override ``default_blocks``.
    ``interpret=True`` runs Mosaic GPU's interpreter (CPU tests). ``sinks`` ([q_heads]): added
    to the forward kernel's softmax statistics in XLA (``_with_sinks``).
    """
    batch, seq_len, q_heads, head_dim = q.shape
    reason = unsupported_reason(head_dim=head_dim, dtype=q.dtype, softcap=softcap, v_head_dim=v.shape[3])
    if reason:
        raise NotImplementedError(reason)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    cfg = mgpu_config(
        causal=causal,
        window=sliding_window,
        scale=scale,
        seq_len=seq_len,
        q_heads=q_heads,
        kv_heads=k.shape[2],
        head_dim=head_dim,
        q_offset=q_offset,
        interpret=interpret,
        **blocks,
    )
    return _padded(q, k, v, segment_ids, sinks, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _padded(q, k, v, segment_ids, sinks, *, cfg: MgpuConfig):
    pad = cfg.seq_pad - cfg.seq_len
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    out = _flash(q, k, v, segment_ids, sinks, cfg)
    return out[:, : cfg.seq_len] if pad else out
