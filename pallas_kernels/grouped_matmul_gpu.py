"""Grouped matmul for dropless MoE on GPU: a Pallas Triton kernel (forward and both
backward products), for any NVIDIA GPU Triton targets.

`triton_grouped_matmul(a, w, group_sizes)`: a [m, k] rows sorted by group, w [groups, k, n],
group_sizes [groups] -> [m, n], row i through its group's w; rows past sum(group_sizes) come
out zero and get zero gradients (megablox_grouped_matmul's contract). A custom_vjp:
forward out = a @ w[g]; dA = dout @ w[g]^T (the same kernel reading w transposed);
dW[g] = a_g^T @ dout_g (a second kernel).

Design (learnt from JAX's megablox `make_group_metadata` and Mosaic GPU
`ragged_dot_mgpu.GroupInfo`):
* The forward kernel walks row tiles of `block_m`; a tile that straddles a group boundary
  is visited once per group it holds, so the grid's tile axis has at most
  m / block_m + groups entries. Per-tile metadata (row tile, first and last row of the
  group, group id) is computed in jnp and passed as int32 arrays: Triton Pallas has no
  scalar prefetch, so the kernel reads its tile's entry with a scalar load. Each visit
  stores only its group's rows (a masked store), so visits of one tile from different
  programs never write the same row; loads are unmasked, since row i of the output only
  depends on row i of a. Rows past sum(group_sizes) form one more "group" whose visits
  skip the k loop and store zeros (the output is not zero-initialised); unused trailing
  grid entries store nothing.
* The weight-gradient kernel has one program per (group, k tile, n tile) and loops over
  the group's row tiles (a dynamic trip count), masking rows outside the group in both
  operands, so empty groups give zeros and garbage rows past the groups never leak in.
* m, k and n are padded up to tile multiples outside the kernel (no copy at the MoE
  shapes, where they divide) rather than masking out-of-bounds columns inside: the
  kernel stays simple, and interpret mode (which clamps out-of-bounds slices) runs the
  same index arithmetic as the GPU.
Tiles default to 128 x 128 with k steps of 64, 8 warps, 3 stages (Triton's H100 matmul
tutorial sizes); `GroupedMatmulBlocks` exposes them. Off GPU it runs interpreted (tests).
Imports only jax.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels.mesh_utils import resolve_backend

__all__ = ["GroupedMatmulBlocks", "tile_metadata", "triton_grouped_matmul"]


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlocks:
    """Tiles of the Triton grouped matmul (powers of two >= 16).

    gmm (forward and dA): output tile block_m x block_n, k in steps of block_k.
    tgmm (dW): output tile tgmm_k x tgmm_n, rows in steps of tgmm_m."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    tgmm_m: int = 64
    tgmm_k: int = 128
    tgmm_n: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k", "tgmm_m", "tgmm_k", "tgmm_n"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GroupedMatmulBlocks.{f} must be a power of two >= 16, got {v}")

    @property
    def row_multiple(self) -> int:
        return max(self.block_m, self.tgmm_m)

    @property
    def col_multiple(self) -> int:
        # k and n are each a contraction dim in one product and an output dim in another
        return max(self.block_n, self.block_k, self.tgmm_k, self.tgmm_n)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, multiple: int):
    extra = _round_up(x.shape[axis], multiple) - x.shape[axis]
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


def _precision(dtype):
    # f32 inputs: true f32 matmuls (Triton would otherwise use TF32).
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _group_bounds(group_sizes, m: int):
    """Start and end row of each group, plus one last "group" for the rows past them."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def tile_metadata(group_sizes, m: int, block_m: int):
    """Per grid entry t < m / block_m + groups: (row tile, first row, end row, group).

    Group ids run 0..groups-1 for the real groups and `groups` for the rows past
    sum(group_sizes); entries past the last visit have first == end (store nothing)."""
    groups = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    sizes = ends - starts
    first = starts // block_m
    ntiles = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)
    tile_end = jnp.cumsum(ntiles)
    t = jnp.arange(m // block_m + groups, dtype=jnp.int32)
    g = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    used = g <= groups
    gc = jnp.minimum(g, groups)
    row_tile = first[gc] + t - (tile_end[gc] - ntiles[gc])
    zero = jnp.zeros_like(t)
    return (
        jnp.where(used, row_tile, zero),
        jnp.where(used, starts[gc], zero),
        jnp.where(used, ends[gc], zero),
        jnp.where(used, gc, groups),
    )


def _gmm_kernel(tile_ref, lo_ref, hi_ref, grp_ref, a_ref, w_ref, o_ref, *, blocks, groups, nk, transpose_rhs):
    from jax.experimental.pallas import triton as plt

    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    ni, t = pl.program_id(0), pl.program_id(1)
    row0 = tile_ref[t] * bm
    lo, hi, g = lo_ref[t], hi_ref[t], grp_ref[t]
    n0 = ni * bn
    gw = jnp.minimum(g, groups - 1)
    precision = _precision(a_ref.dtype)

    def body(j, acc):
        k0 = pl.multiple_of(j * bk, bk)
        a = a_ref[pl.ds(row0, bm), pl.ds(k0, bk)]
        if transpose_rhs:  # w is [groups, n, k]: a @ w[g]^T
            b = w_ref[gw, pl.ds(n0, bn), pl.ds(k0, bk)]
            dims = (((1,), (1,)), ((), ()))
        else:
            b = w_ref[gw, pl.ds(k0, bk), pl.ds(n0, bn)]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    # the rows past the groups (g == groups) and unused entries (lo == hi) skip the matmul
    # integer arithmetic, not a select: Triton Pallas lowers a bool-valued scalar
    # select into the loop bound as i1 (scf.for then fails to verify)
    steps = nk * jnp.minimum(jnp.maximum(hi - lo, 0), 1) * jnp.minimum(groups - g, 1)
    acc = lax.fori_loop(steps * 0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    mask = jnp.broadcast_to(((rows >= lo) & (rows < hi))[:, None], (bm, bn))
    plt.store(o_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=mask)


def _tgmm_kernel(lo_ref, hi_ref, a_ref, d_ref, o_ref, *, blocks):
    from jax.experimental.pallas import triton as plt

    bm, bk, bn = blocks.tgmm_m, blocks.tgmm_k, blocks.tgmm_n
    ni, ki, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[g], hi_ref[g]
    first = lo // bm
    steps = ((hi - 1) // bm - first + 1) * jnp.minimum(jnp.maximum(hi - lo, 0), 1)  # 0 if empty
    precision = _precision(a_ref.dtype)

    def body(j, acc):
        r0 = (first + j) * bm
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        inside = ((rows >= lo) & (rows < hi))[:, None]
        a = plt.load(
            a_ref.at[pl.ds(r0, bm), pl.ds(ki * bk, bk)], mask=jnp.broadcast_to(inside, (bm, bk)), other=0
        )
        d = plt.load(
            d_ref.at[pl.ds(r0, bm), pl.ds(ni * bn, bn)], mask=jnp.broadcast_to(inside, (bm, bn)), other=0
        )
        dims = (((0,), (0,)), ((), ()))
        return acc + lax.dot_general(a, d, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(steps * 0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _compiler_params(blocks: GroupedMatmulBlocks, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def gmm(
    a, w, group_sizes, blocks: GroupedMatmulBlocks, *, transpose_rhs: bool = False, interpret: bool = False
):
    """a [m, K] (m a multiple of block_m) @ w[g] -> [m, N] in a's dtype; w [G, K, N], or
    [G, N, K] with transpose_rhs; K, N multiples of the tiles (the caller pads)."""
    m, kdim = a.shape
    groups = w.shape[0]
    ndim = w.shape[1] if transpose_rhs else w.shape[2]
    meta = tile_metadata(group_sizes, m, blocks.block_m)
    kernel = functools.partial(
        _gmm_kernel, blocks=blocks, groups=groups, nk=kdim // blocks.block_k, transpose_rhs=transpose_rhs
    )
    flops = 2 * m * kdim * ndim
    nbytes = a.size * a.dtype.itemsize + w.size * w.dtype.itemsize + m * ndim * a.dtype.itemsize
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, ndim), a.dtype),
        grid=(ndim // blocks.block_n, meta[0].shape[0]),
        compiler_params=_compiler_params(blocks, interpret),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=nbytes),
        interpret=interpret,
        name="grouped_matmul_t" if transpose_rhs else "grouped_matmul",
    )(*meta, a, w)


def tgmm(a, d, group_sizes, blocks: GroupedMatmulBlocks, *, out_dtype, interpret: bool = False):
    """dW[g] = a_g^T @ d_g: a [m, K], d [m, N] -> [G, K, N] (zeros for empty groups)."""
    m, kdim = a.shape
    ndim = d.shape[1]
    groups = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    bk, bn = blocks.tgmm_k, blocks.tgmm_n
    flops = 2 * m * kdim * ndim
    nbytes = a.size * a.dtype.itemsize + d.size * d.dtype.itemsize + groups * kdim * ndim * 4
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, blocks=blocks),
        out_shape=jax.ShapeDtypeStruct((groups, kdim, ndim), out_dtype),
        grid=(ndim // bn, kdim // bk, groups),
        out_specs=pl.BlockSpec((None, bk, bn), lambda ni, ki, g: (g, ki, ni)),
        compiler_params=_compiler_params(blocks, interpret),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=nbytes),
        interpret=interpret,
        name="grouped_matmul_dw",
    )(starts[:groups], ends[:groups], a, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(a, w, group_sizes, blocks, interpret):
    return _forward(a, w, group_sizes, blocks, interpret)


def _forward(a, w, group_sizes, blocks, interpret):
    m, n = a.shape[0], w.shape[2]
    rows, cols = blocks.row_multiple, blocks.col_multiple
    ap = _pad_axis(_pad_axis(a, 0, rows), 1, cols)
    wp = _pad_axis(_pad_axis(w.astype(a.dtype), 1, cols), 2, cols)
    return gmm(ap, wp, group_sizes, blocks, interpret=interpret)[:m, :n]


def _fwd(a, w, group_sizes, blocks, interpret):
    return _forward(a, w, group_sizes, blocks, interpret), (a, w, group_sizes)


def _bwd(blocks, interpret, res, dout):
    a, w, group_sizes = res
    (m, k), n = a.shape, w.shape[2]
    rows, cols = blocks.row_multiple, blocks.col_multiple
    dp = _pad_axis(_pad_axis(dout.astype(a.dtype), 0, rows), 1, cols)
    wp = _pad_axis(_pad_axis(w.astype(a.dtype), 1, cols), 2, cols)
    ap = _pad_axis(_pad_axis(a, 0, rows), 1, cols)
    da = gmm(dp, wp, group_sizes, blocks, transpose_rhs=True, interpret=interpret)[:m, :k]
    dw = tgmm(ap, dp, group_sizes, blocks, out_dtype=w.dtype, interpret=interpret)[:, :k, :n]
    return da, dw, None


_grouped.defvjp(_fwd, _bwd)


def triton_grouped_matmul(
    a: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    full: bool = False,
    blocks: GroupedMatmulBlocks | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Rows past sum(group_sizes) come out zero, and so do their gradients (the kernel
    always handles them, so `full`, the caller's promise that there are none, changes
    nothing). Output in a's dtype (w is cast to it, as ragged_dot's bf16 x bf16). On a
    GPU the Triton kernel, interpreted anywhere else unless `interpret` says."""
    del full
    if a.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or a.shape[1] != w.shape[1]:
        raise ValueError(
            f"triton_grouped_matmul wants a [m, k], w [groups, k, n], group_sizes [groups]: "
            f"got a {a.shape}, w {w.shape}, group_sizes {group_sizes.shape}"
        )
    if interpret is None:
        interpret = resolve_backend() != "gpu"
    return _grouped(a, w, group_sizes.astype(jnp.int32), blocks or GroupedMatmulBlocks(), interpret)


def grouped_matmul_flops(m: int, k: int, n: int) -> int:
    """Forward FLOPs of one grouped matmul over m rows (each row through one expert)."""
    return 2 * m * k * n
