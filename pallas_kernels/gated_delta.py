"""The chunked gated delta rule as Pallas kernels, forward and backward: one source for Mosaic
TPU, Triton GPU and the CPU interpreter.

Same math, arguments and results as ``models.gated_deltanet.chunked_gated_delta_rule`` (the
algorithm of flash-linear-attention's ``chunk_gated_delta_rule``), so either can stand in for
the other. Per chunk of ``chunk_size`` tokens (i, j) of one value head, in float32:

    decay[i, j] = exp(G_i - G_j) for j <= i in one document, else 0   G: the chunk's cumsum of g
    A = (I + strictly_lower(beta_i k_i.k_j decay[i, j]))^-1       WY form, forward substitution
    U = A (beta v),  W = A (beta a k)                                a_i = exp(G_i) [i continues S]
    V = U - W S;  O = (a q) S + (q k^T * decay) V;  S <- a_last S + (b k)^T V
                                                  b_j = exp(G_last - G_j) [j in the last document]

Why the pieces sit where they do:

* The grid is (batch, value head, value-column block) and the chunk loop runs *inside* the
  kernel with the state [dk, block_v] as its float32 carry: Triton runs grid programs in
  parallel, so a recurrence cannot live on a grid axis there. Columns of v (and of S) never mix,
  so splitting dv over the grid is exact; each block recomputes the chunk's WY terms (A, W),
  flops traded for registers (``block_v``; on GPU 64 by default, half the 128 x 128 state a
  Triton program holds in registers: a guess, not measured, as both compile for an H100).
* Key heads are read through the BlockSpec index map (value head h reads key head h // groups):
  no repeated q/k in HBM. dq/dk come back per value head and column block and are summed in XLA.
* The unit-lower-triangular solve is column-oriented forward substitution on a [chunk, chunk]
  tile: per column, one masked column/row extraction and an outer product. No triangular-solve
  primitive lowers inside Mosaic or Triton, and the Neumann product (I - L)(I + L^2)... is
  unstable when keys are alike (its partial products grow binomially, then cancel).
* The work that is elementwise over the sequence stays in XLA, outside the kernels, where
  autodiff differentiates it: the optional L2 norm of q and k, the dk ** -0.5 scale, the chunk
  cumsum G of g, and the per-token factors a and b (with the document resets of
  ``segment_ids``). The kernels see G, a and b as independent inputs and return their
  gradients; inside, only decay's exp(G_i - G_j) needs G (masked before the exp, where the
  upper triangle could overflow).
* The backward (``jax.custom_vjp``) is a reverse chunk loop carrying dS. It recomputes each
  chunk's decay, A, U, W and V from the inputs and stores nothing per chunk except the state
  entering it, which the forward writes out ([batch, v_heads, chunks, dk, dv] float32: 4 MiB a
  head at 4096 tokens and dk = dv = 128) because the recurrence cannot be run backwards
  (a reset makes a_last = 0).
* Per-token scalars (beta, G, a, b, segment ids, their gradients) are stored lane-dense as
  [..., chunks, 1, chunk] rows, as the flash kernels store LSE, and turned into columns with an
  in-kernel transpose.
* The whole (padded) sequence of one head is one block, as the flash kernels' K/V: on TPU it
  sits in VMEM (single-buffered), which bounds the sequence per device.

Matmuls take HIGHEST precision for float32 inputs (true f32, the reference's) and the
backend's default otherwise, as the flash kernels (``matmul_precision``).

Where it stands: forward and every gradient equal both jnp references in the interpreter
(tests/test_gated_delta_kernel.py), and forward + backward compile deviceless for TPU v5p and
H100 at Qwen3.5-35B-A3B's shape (4096 tokens). Not yet run on a TPU or GPU, so no timings. On
v5p one head's sequence must fit VMEM: 8192 tokens per shard at dk = dv = 128, longer refused
at the door. Open costs: q, k, v reach the kernels in float32 (prepared in XLA) even from bf16
inputs, and the solve is 64 serial steps per chunk, run again in the backward and per column
block. Differences from the reference's signature: ``backend``, ``interpret``, ``block_v``, and
``chunk_size=None`` (64, but 32 for float32 inputs on GPU: see ``_GPU_F32_CHUNK``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from jaxtrain.pallas_kernels.flash_attention import (
    TPU_DEFAULT_VMEM_BYTES,
    TPU_VMEM_BYTES,
    TPU_VMEM_USABLE,
    matmul_precision,
)
from jaxtrain.pallas_kernels.gated_delta_inputs import CHUNK_SIZE, continues, prepare
from jaxtrain.pallas_kernels.gated_delta_inputs import initial_state as entry_state
from jaxtrain.pallas_kernels.mesh_utils import (
    check_shard_axes,
    device_kind,
    kernel_backend,
    mesh_backend,
    reshard_to_specs,
)

__all__ = ["chunked_gated_delta_rule_pallas", "sharded_gated_delta_rule"]


@dataclasses.dataclass(frozen=True)
class _Config:
    """The kernels' static description (hashable: a custom_vjp nondiff argument)."""

    backend: str
    interpret: bool
    prec: object  # lax.Precision or None
    chunk: int
    seq: int  # padded to a multiple of chunk
    dk: int
    dv: int
    block_v: int
    groups: int  # value heads per key head


# Triton holds the loop-carried state [dk, block_v] (and dS in the backward) in registers: 64
# columns halve it at dv = 128. Unmeasured; 128 compiles for an H100 too.
_GPU_BLOCK_V = 64
# Triton's full-precision float32 dots (HIGHEST, for float32 inputs) stage more in shared memory:
# at 64-token chunks and dk = 128 the backward asked an H100 for 304 KiB of its 227. The chunk
# changes only the tiling, not the result (beyond rounding).
_GPU_F32_CHUNK = 32


# ----------------------------------------------------------------------------
# In-kernel helpers (2-D tiles; identical on every backend).
# ----------------------------------------------------------------------------


def _nn(a, b, prec):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _nt(a, b, prec):
    """a @ b.T"""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _tn(a, b, prec):
    """a.T @ b, with the transpose explicit (both lowerings take a 2-D transpose)."""
    return _nn(jnp.transpose(a), b, prec)


def _col(row):
    """[1, c] -> [c, 1]."""
    return jnp.transpose(row)


def _iota(c, axis):
    return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def _unit_lower_inverse(strict):
    """(I + strict)^-1 for a strictly lower-triangular [c, c] tile: forward substitution by
    columns. Row j of the inverse is final once columns < j are eliminated; then it is
    subtracted, times column j of ``strict``, from the rows below."""
    c = strict.shape[0]
    rows, cols = _iota(c, 0), _iota(c, 1)

    def step(j, x):
        col = jnp.sum(jnp.where(cols == j, strict, 0.0), axis=1, keepdims=True)  # [c, 1]
        row = jnp.sum(jnp.where(rows == j, x, 0.0), axis=0, keepdims=True)  # [1, c]
        return x - col * row

    return lax.fori_loop(0, c, step, jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32))


def _last(row):
    """The last entry of a [1, c] row, as [1, 1]."""
    c = row.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, row.shape, 1)
    return jnp.sum(jnp.where(lane == c - 1, row, 0.0), axis=1, keepdims=True)


def _chunk_terms(q, k, v, beta_r, g_r, a_r, seg_r, prec):
    """A chunk's forward terms (everything but the state): decay, q k^T, k k^T, the WY inverse
    A, U = A (beta v), W = A (beta a k)."""
    c = q.shape[0]
    rows, cols = _iota(c, 0), _iota(c, 1)
    beta, a, g = _col(beta_r), _col(a_r), _col(g_r)
    allowed = rows >= cols
    if seg_r is not None:
        allowed = jnp.logical_and(allowed, _col(seg_r) == seg_r)
    decay = jnp.exp(jnp.where(allowed, g - g_r, -jnp.inf))
    kk = _nt(k, k, prec)
    strict = jnp.where(rows > cols, beta * kk * decay, 0.0)
    inv = _unit_lower_inverse(strict)
    bv = beta * v
    bak = (beta * a) * k
    u = _nn(inv, bv, prec)
    w = _nn(inv, bak, prec)
    qk = _nt(q, k, prec)
    return dict(decay=decay, kk=kk, inv=inv, bv=bv, bak=bak, u=u, w=w, qk=qk, beta=beta, a=a)


# ----------------------------------------------------------------------------
# Kernels. Refs arrive squeezed by the BlockSpecs: q/k [T, dk], v/o [T, bv], rows [n, 1, c],
# states [dk, bv] (per-chunk states [n, dk, bv]).
# ----------------------------------------------------------------------------


def _fwd_kernel(
    q_ref, k_ref, v_ref, beta_ref, g_ref, a_ref, b_ref, *rest, chunk, prec, has_segments, save_states
):
    if has_segments:
        seg_ref, *rest = rest
    s0_ref, o_ref, sn_ref, *states_ref = rest
    n = beta_ref.shape[0]

    def body(j, state):
        t0 = pl.multiple_of(j * chunk, chunk)
        q, k, v = (r[pl.ds(t0, chunk), :].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
        seg_r = seg_ref[j] if has_segments else None
        a_r = a_ref[j]
        t = _chunk_terms(q, k, v, beta_ref[j], g_ref[j], a_r, seg_r, prec)
        if save_states:
            states_ref[0][j] = state
        new = t["u"] - _nn(t["w"], state, prec)
        o = _nn(t["a"] * q, state, prec) + _nn(t["qk"] * t["decay"], new, prec)
        o_ref[pl.ds(t0, chunk), :] = o.astype(o_ref.dtype)
        kb = _col(b_ref[j]) * k
        return _last(a_r) * state + _tn(kb, new, prec)

    sn_ref[...] = lax.fori_loop(0, n, body, s0_ref[...].astype(jnp.float32))


def _bwd_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, a_ref, b_ref, *rest, chunk, prec, has_segments):
    if has_segments:
        seg_ref, *rest = rest
    states_ref, do_ref, dsn_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, da_ref, db_ref, ds0_ref = rest
    n = beta_ref.shape[0]
    c = chunk

    def body(i, ds):  # chunks in reverse; ds: the gradient of the state leaving chunk j
        j = n - 1 - i
        t0 = pl.multiple_of(j * c, c)
        q, k, v = (r[pl.ds(t0, c), :].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
        do = do_ref[pl.ds(t0, c), :].astype(jnp.float32)
        seg_r = seg_ref[j] if has_segments else None
        a_r, b_r = a_ref[j], b_ref[j]
        t = _chunk_terms(q, k, v, beta_ref[j], g_ref[j], a_r, seg_r, prec)
        state = states_ref[j]
        decay, inv, beta, a = t["decay"], t["inv"], t["beta"], t["a"]
        b = _col(b_r)
        new = t["u"] - _nn(t["w"], state, prec)
        p = t["qk"] * decay
        qa, kb = a * q, b * k
        # O = qa S + P V;  S' = a_last S + kb^T V
        dqa = _nt(do, state, prec)
        dp = _nt(do, new, prec)
        dnew = _tn(p, do, prec) + _nn(kb, ds, prec)
        dkb = _nt(new, ds, prec)
        dcd = jnp.sum(jnp.sum(state * ds, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
        ds_in = _last(a_r) * ds + _tn(qa, do, prec) - _tn(t["w"], dnew, prec)
        # V = U - W S;  U = A bv, W = A bak;  A = (I + L)^-1
        dw = -_nt(dnew, state, prec)
        inv_t = jnp.transpose(inv)
        dbv = _nn(inv_t, dnew, prec)
        dbak = _nn(inv_t, dw, prec)
        dinv = _nt(dnew, t["bv"], prec) + _nt(dw, t["bak"], prec)
        rows, cols = _iota(c, 0), _iota(c, 1)
        # d(T^-1) = -T^-1 dT T^-1, so dL = -(A^T dA A^T), kept where L has entries
        dl = jnp.where(rows > cols, -_nn(_nn(inv_t, dinv, prec), inv_t, prec), 0.0)
        # L = strict(beta kk decay);  P = qk decay
        dkk = dl * beta * decay
        dqk = dp * decay
        ddecay = dl * beta * t["kk"] + dp * t["qk"]
        dx = ddecay * decay  # d(G_i - G_j): G_i gets its row sum, G_j minus its column sum
        dq = _nn(dqk, k, prec) + a * dqa
        dk = _tn(dqk, q, prec) + _nn(dkk, k, prec) + _tn(dkk, k, prec) + b * dkb + (beta * a) * dbak
        kdbak = jnp.sum(k * dbak, axis=1, keepdims=True)  # [c, 1]
        dbeta = jnp.sum(dl * t["kk"] * decay, axis=1, keepdims=True) + jnp.sum(v * dbv, axis=1, keepdims=True)
        dbeta = dbeta + a * kdbak
        da = jnp.sum(q * dqa, axis=1, keepdims=True) + beta * kdbak
        db = jnp.sum(k * dkb, axis=1, keepdims=True)
        lane = lax.broadcasted_iota(jnp.int32, (1, c), 1)
        dq_ref[pl.ds(t0, c), :] = dq
        dk_ref[pl.ds(t0, c), :] = dk
        dv_ref[pl.ds(t0, c), :] = beta * dbv
        dbeta_ref[j] = jnp.transpose(dbeta)
        dg_ref[j] = jnp.transpose(jnp.sum(dx, axis=1, keepdims=True)) - jnp.sum(dx, axis=0, keepdims=True)
        da_ref[j] = jnp.transpose(da) + jnp.where(lane == c - 1, dcd, 0.0)
        db_ref[j] = jnp.transpose(db)
        return ds_in

    ds0_ref[...] = lax.fori_loop(0, n, body, dsn_ref[...].astype(jnp.float32))


# ----------------------------------------------------------------------------
# pallas_calls: grid (batch, value head, value-column block).
# ----------------------------------------------------------------------------


def _specs(cfg):
    """The BlockSpecs of one (batch, value head, column block) grid step: whole sequences."""
    tp, c, dk, bv, groups = cfg.seq, cfg.chunk, cfg.dk, cfg.block_v, cfg.groups
    n = tp // c
    whole = cfg.backend == "tpu" and not cfg.interpret

    def spec(shape, index_map):
        if whole:  # one buffer: a second would let the next step's copy overlap this step's
            # long chunk loop, and double the VMEM that bounds the sequence length
            return pl.BlockSpec(shape, index_map, pipeline_mode=pl.Buffered(1))
        return pl.BlockSpec(shape, index_map)

    return dict(
        qk=spec((None, None, tp, dk), lambda b, h, v: (b, h // groups, 0, 0)),
        val=spec((None, None, tp, bv), lambda b, h, v: (b, h, 0, v)),
        rows=spec((None, None, n, 1, c), lambda b, h, v: (b, h, 0, 0, 0)),
        seg=spec((None, n, 1, c), lambda b, h, v: (b, 0, 0, 0)),
        state=spec((None, None, dk, bv), lambda b, h, v: (b, h, 0, v)),
        states=spec((None, None, n, dk, bv), lambda b, h, v: (b, h, 0, 0, v)),
        part_qk=spec((None, None, None, tp, dk), lambda b, h, v: (b, h, v, 0, 0)),
        part_rows=spec((None, None, None, n, 1, c), lambda b, h, v: (b, h, v, 0, 0, 0)),
    )


def _tpu_vmem_limit(cfg, kind: str) -> int:
    """VMEM limit of one kernel on TPU; ValueError when one head's whole sequence cannot fit.
    The blocks are float32 and single-buffered; [.., 1, chunk] rows take 128 lanes a chunk."""
    n = cfg.seq // cfg.chunk
    rows = n * max(cfg.chunk, 128) * 4
    if kind == "fwd":  # q, k; v, o; per-chunk states; beta, G, a, b, segment ids
        need = 4 * cfg.seq * (2 * cfg.dk + 2 * cfg.block_v) + 4 * n * cfg.dk * cfg.block_v + 5 * rows
    else:  # q, k, dq, dk; v, dO, dv; states; beta, G, a, b, their grads, segment ids
        need = 4 * cfg.seq * (4 * cfg.dk + 3 * cfg.block_v) + 4 * n * cfg.dk * cfg.block_v + 9 * rows
    capacity = TPU_VMEM_BYTES.get(device_kind() or "", TPU_DEFAULT_VMEM_BYTES)
    if need > capacity * TPU_VMEM_USABLE:
        raise ValueError(
            f"gated delta rule {kind}: one head's whole sequence ({cfg.seq} tokens, dk={cfg.dk},"
            f" block_v={cfg.block_v}) takes about {need >> 20} MiB of TPU VMEM, more than fits"
            f" ({capacity >> 20} MiB); use shorter sequences per device (no sequence sharding here)"
        )
    return int(min(capacity * 0.9, max(need * 1.25, 32 << 20)))


def _compiler_params(cfg, kind: str):
    if cfg.interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"),
            vmem_limit_bytes=_tpu_vmem_limit(cfg, kind),
        )
    from jax.experimental.pallas import triton as pltriton

    # Unmeasured (no GPU here): 4 warps, and no software pipelining of the chunk loop's loads,
    # whose stages would take shared memory beside the chunk's tiles.
    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _fwd_call(cfg, q, k, v, beta, g, a, b, seg, s0, *, save_states):
    batch, heads = v.shape[:2]
    n, tp, dk, dv = cfg.seq // cfg.chunk, cfg.seq, cfg.dk, cfg.dv
    sp = _specs(cfg)
    has_segments = seg is not None
    in_specs = [
        sp["qk"],
        sp["qk"],
        sp["val"],
        *[sp["rows"]] * 4,
        *([sp["seg"]] if has_segments else []),
        sp["state"],
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, tp, dv), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, dk, dv), jnp.float32),
    ]
    out_specs = [sp["val"], sp["state"]]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, n, dk, dv), jnp.float32))
        out_specs.append(sp["states"])
    kernel = functools.partial(
        _fwd_kernel, chunk=cfg.chunk, prec=cfg.prec, has_segments=has_segments, save_states=save_states
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, heads, dv // cfg.block_v),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(cfg, "fwd"),
        interpret=cfg.interpret,
        name="gated_delta_fwd",
    )(q, k, v, beta, g, a, b, *([seg] if has_segments else []), s0)


def _bwd_call(cfg, q, k, v, beta, g, a, b, seg, states, do, dsn):
    batch, heads = v.shape[:2]
    n, tp, dk, dv = cfg.seq // cfg.chunk, cfg.seq, cfg.dk, cfg.dv
    nv = dv // cfg.block_v
    sp = _specs(cfg)
    has_segments = seg is not None
    in_specs = [
        sp["qk"],
        sp["qk"],
        sp["val"],
        *[sp["rows"]] * 4,
        *([sp["seg"]] if has_segments else []),
        sp["states"],
        sp["val"],
        sp["state"],
    ]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    out_shape = [
        f32(batch, heads, nv, tp, dk),  # dq (per value head and column block)
        f32(batch, heads, nv, tp, dk),  # dk
        f32(batch, heads, tp, dv),  # dv
        *[f32(batch, heads, nv, n, 1, cfg.chunk)] * 4,  # dbeta, dG, da, db
        f32(batch, heads, dk, dv),  # dS0
    ]
    out_specs = [sp["part_qk"], sp["part_qk"], sp["val"], *[sp["part_rows"]] * 4, sp["state"]]
    kernel = functools.partial(_bwd_kernel, chunk=cfg.chunk, prec=cfg.prec, has_segments=has_segments)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, heads, nv),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=_compiler_params(cfg, "bwd"),
        interpret=cfg.interpret,
        name="gated_delta_bwd",
    )(q, k, v, beta, g, a, b, *([seg] if has_segments else []), states, do, dsn)


# ----------------------------------------------------------------------------
# custom_vjp over the kernel-layout operands.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, beta, g, a, b, seg, s0):
    o, sn = _fwd_call(cfg, q, k, v, beta, g, a, b, seg, s0, save_states=False)
    return o, sn


def _core_fwd(cfg, q, k, v, beta, g, a, b, seg, s0):
    o, sn, states = _fwd_call(cfg, q, k, v, beta, g, a, b, seg, s0, save_states=True)
    return (o, sn), (q, k, v, beta, g, a, b, seg, states)


def _core_bwd(cfg, res, cotangents):
    q, k, v, beta, g, a, b, seg, states = res
    do, dsn = cotangents
    dq, dk, dv, dbeta, dg, da, db, ds0 = _bwd_call(cfg, q, k, v, beta, g, a, b, seg, states, do, dsn)
    batch, heads = v.shape[:2]

    def per_key_head(x):  # [b, hv, nv, t, dk] -> [b, hk, t, dk]: sum column blocks and groups
        x = x.sum(axis=2)
        return x.reshape(batch, heads // cfg.groups, cfg.groups, *x.shape[2:]).sum(axis=2)

    rows = lambda x: x.sum(axis=2)  # noqa: E731
    return per_key_head(dq), per_key_head(dk), dv, rows(dbeta), rows(dg), rows(da), rows(db), None, ds0


_core.defvjp(_core_fwd, _core_bwd)


# ----------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------


def chunked_gated_delta_rule_pallas(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    segment_ids=None,
    *,
    chunk_size: int | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    backend: str | None = None,
    interpret: bool | None = None,
    block_v: int | None = None,
):
    """``models.gated_deltanet.chunked_gated_delta_rule`` as Pallas kernels (forward and a
    custom-VJP backward).

    q, k [batch, seq, k_heads, dk]; v [batch, seq, v_heads, dv]; g (log decay, <= 0), beta
    [batch, seq, v_heads]; initial_state [batch, v_heads, dk, dv]; segment_ids [batch, seq]
    (packed documents: the state resets where the id changes). Returns (out [batch, seq,
    v_heads, dv] in q's dtype, final state [batch, v_heads, dk, dv] float32).

    chunk_size: tokens per chunk; None: the reference's 64, except 32 for float32 inputs on GPU
    (shared memory). backend: 'tpu' (Mosaic), 'gpu' (Triton) or 'cpu'; None: from q's devices, the mesh in
    context or jax's default, decided once here. interpret: the Pallas interpreter (default on
    'cpu', the only way there). block_v: value columns per grid step (a divisor of dv; default
    dv, 64 on GPU). Like every Pallas call it cannot be auto-partitioned: call it per shard
    (inside shard_map) on a mesh.
    """
    backend, interpret = kernel_backend(q, backend, interpret)
    if chunk_size is None:
        chunk_size = _GPU_F32_CHUNK if backend == "gpu" and q.dtype == jnp.float32 else CHUNK_SIZE
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    # Triton tiles are powers of two, its dots at least 16 wide; Mosaic slices whole sublane tiles.
    if not interpret and backend == "gpu" and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size={chunk_size}: on GPU a power of two >= 16")
    if not interpret and backend == "tpu" and chunk_size % 8:
        raise ValueError(f"chunk_size={chunk_size}: on TPU a multiple of 8")
    out_dtype, prec = q.dtype, matmul_precision(q.dtype)
    batch, seq, k_heads, dk = q.shape
    # The reference's own validation, float32 cast, L2 norm and scale; it repeats key heads over
    # value heads, undone by a strided slice so that the kernels read one copy per key head.
    q, k, v, g, beta = prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    heads, dv = v.shape[2:]
    groups = heads // k_heads
    q, k = q[:, :, ::groups], k[:, :, ::groups]
    s0 = entry_state(initial_state, q, v)
    continues(segment_ids, (batch, seq))  # validates the shape
    if block_v is None:
        block_v = _GPU_BLOCK_V if backend == "gpu" and dv % _GPU_BLOCK_V == 0 else dv
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide the value head dim {dv}")

    c = chunk_size
    pad = -seq % c
    tp, n = seq + pad, (seq + pad) // c
    head_major = lambda x: jnp.swapaxes(jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]), 1, 2)  # noqa: E731
    q, k, v = head_major(q), head_major(k), head_major(v)
    # Per-token scalars, [b, h, n, c]; padding neither decays (g = 0) nor writes (beta = 0).
    g, beta = (
        jnp.swapaxes(jnp.pad(x, [(0, 0), (0, pad), (0, 0)]), 1, 2).reshape(batch, heads, n, c)
        for x in (g, beta)
    )
    cum = jnp.cumsum(g, axis=-1)  # G
    if segment_ids is None:
        carried = to_end = jnp.ones((1, 1, n, c), jnp.float32)
        seg = None
    else:
        seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, pad)], mode="edge").reshape(batch, 1, n, c)
        before = jnp.concatenate([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], axis=2)
        carried = (seg == before).astype(jnp.float32)
        to_end = (seg == seg[..., -1:]).astype(jnp.float32)
        seg = seg.reshape(batch, n, 1, c)
    a = jnp.exp(cum) * carried
    b = jnp.exp(cum[..., -1:] - cum) * to_end
    rows = lambda x: x.reshape(batch, heads, n, 1, c)  # noqa: E731
    cfg = _Config(
        backend=backend,
        interpret=bool(interpret),
        prec=prec,
        chunk=c,
        seq=tp,
        dk=dk,
        dv=dv,
        block_v=block_v,
        groups=groups,
    )
    o, state = _core(cfg, q, k, v, rows(beta), rows(cum), rows(a), rows(b), seg, s0)
    out = jnp.swapaxes(o, 1, 2)[:, :seq].astype(out_dtype)
    return out, state


# ----------------------------------------------------------------------------
# On a mesh: the kernels per shard, inside shard_map.
# ----------------------------------------------------------------------------


def sharded_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    segment_ids=None,
    *,
    mesh,
    batch_axes: Sequence[str] | str | None,
    head_axes: Sequence[str] | str | None,
    use_qk_l2norm_in_kernel: bool = True,
    chunk_size: int | None = None,
    interpret: bool | None = None,
):
    """``chunked_gated_delta_rule_pallas`` over global arrays on ``mesh`` (a ``Mesh`` or the
    context's ``AbstractMesh``), as pallas_kernels/sharded.py runs flash attention: the batch
    split over ``batch_axes``, the heads over ``head_axes``, the kernels called per shard
    inside ``jax.shard_map``. The rule mixes neither batch rows nor heads, so no collective is
    needed either way. The backend follows the mesh's devices (CPU: the interpreter).

    Key heads are split with the value heads, as contiguous blocks: value head h reads key
    head h // r (r = v_heads / k_heads), so shard i's value heads [i hv/n, (i + 1) hv/n) read
    exactly its key heads [i hk/n, (i + 1) hk/n), and locally value head h still reads key head
    h // r. That needs the key heads divisible by the head shards (config validation asks
    model.linear_attention.num_key_heads to be a multiple of mesh.tensor); otherwise this
    refuses in one line. Mesh axes named in neither are replicated (the kernels run
    redundantly on them). With ``mesh`` None or of one device the kernels are called
    directly. Arguments and results otherwise as ``chunked_gated_delta_rule_pallas``.
    """
    kwargs = dict(
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        backend=None if mesh is None else mesh_backend(mesh),
        interpret=interpret,
    )
    if mesh is None or math.prod(mesh.axis_sizes) == 1:
        return chunked_gated_delta_rule_pallas(q, k, v, g, beta, initial_state, segment_ids, **kwargs)
    batch_axes, head_axes = check_shard_axes(mesh, batch_axes, head_axes)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n_batch = math.prod(sizes[a] for a in batch_axes)
    n_head = math.prod(sizes[a] for a in head_axes)
    batch, k_heads, v_heads = q.shape[0], q.shape[2], v.shape[2]
    if batch % n_batch:
        raise ValueError(f"batch {batch} is not divisible by the {n_batch} shards of batch_axes {batch_axes}")
    if k_heads % n_head or v_heads % n_head:
        raise ValueError(
            f"gated delta rule: key heads {k_heads} and value heads {v_heads} must both divide into the "
            f"{n_head} shards of head_axes {head_axes} (each shard keeps whole key-head groups)"
        )
    b_spec = batch_axes or None
    h_spec = head_axes or None
    x_spec = P(b_spec, None, h_spec, None)  # q, k, v, out: [batch, seq, heads, dim]
    row_spec = P(b_spec, None, h_spec)  # g, beta: [batch, seq, v_heads]
    state_spec = P(b_spec, h_spec, None, None)  # [batch, v_heads, dk, dv]
    seg_spec = P(b_spec, None)
    has_state, has_seg = initial_state is not None, segment_ids is not None

    def local(q, k, v, g, beta, *rest):
        rest = list(rest)
        s0 = rest.pop(0) if has_state else None
        seg = rest.pop(0) if has_seg else None
        return chunked_gated_delta_rule_pallas(q, k, v, g, beta, s0, seg, **kwargs)

    in_specs = (x_spec, x_spec, x_spec, row_spec, row_spec)
    args = (q, k, v, g, beta)
    if has_state:
        in_specs, args = (*in_specs, state_spec), (*args, initial_state)
    if has_seg:
        in_specs, args = (*in_specs, seg_spec), (*args, segment_ids)
    # check_vma=False: the kernels' out_shapes carry no manual-axis types, and interpret mode
    # fails the varying-axes check (as pallas_kernels/sharded.py)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(x_spec, state_spec), check_vma=False)
    return fn(*reshard_to_specs(mesh, args, in_specs))
