"""Grouped matmul for dropless MoE on Hopper: JAX's Mosaic GPU ragged-dot kernels (wgmma,
TMA, a persistent grid over the SMs) in the grouped-matmul contract, as
grouped_matmul.py wraps JAX's megablox for TPU.

`mosaic_grouped_matmul(a, w, group_sizes)`: a [m, k] rows sorted by group, w [groups, k, n]
-> [m, n]; rows past sum(group_sizes) come out zero with zero gradients. A custom_vjp:
forward `ragged_dot_mgpu.ragged_dot(a, w)`; dA the same kernel with `transpose_rhs`
(dout [m, n] against w read as [groups, n, k]); dW `transposed_ragged_dot_mgpu`
(a^T dout per group, rows as the ragged contraction). The kernels are identical in jax
0.11.2 and 0.12.

What they need, checked here by name (`check_shapes`): bf16 or f16 operands of one dtype
(wgmma), k and n multiples of the blocks (the forward contracts k in block_k steps and
stores whole block_n columns; dA swaps them; dW tiles k by block_m and n by block_n).
Groups need no alignment: the forward visits a tile once per group it holds and stores
only the group's rows (a ladder of power-of-two TMA stores), so rows past the groups are
never written (here: selected to zero); dW masks the rows outside the group in its first
and last row block by multiplication, so garbage past the groups is zeroed first unless
the caller says every row is in a group (`full`). The dW kernel sizes its persistent grid
by `jax.devices()[0].core_count`; a deviceless compile (no GPU device) gets an H100's 132.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp

__all__ = ["MosaicBlocks", "check_shapes", "mosaic_grouped_matmul"]

H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Blocks of the Mosaic GPU kernels (probe on an H100, jax 0.11.2, bf16, m 32768, 8
    groups: forward 128 x 128 x 64, 4 steps in flight, 242-347 TFLOP/s; grid_block_n 2
    where n / block_n is even, +35% at n 2048). grid_block_n None: 2 where it divides."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int | None = None
    dw_block_m: int = 128
    dw_block_n: int = 128
    dw_block_k: int = 64
    dw_max_concurrent_steps: int = 4
    dw_grid_block_n: int = 1


def check_shapes(a_shape, w_shape, dtype, blocks: MosaicBlocks) -> None:
    """ValueError naming the requirement unless the three kernels take these shapes."""
    (_, k), (_, _, n) = a_shape, w_shape
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"mosaic grouped matmul: bf16 or f16 operands only (wgmma), got {jnp.dtype(dtype)}")
    needs = [
        ("k", k, "block_k", blocks.block_k),
        ("n", n, "block_n", blocks.block_n),
        ("n (dA contracts n)", n, "block_k", blocks.block_k),
        ("k (dA's output columns)", k, "block_n", blocks.block_n),
        ("k (dW's rows)", k, "dw_block_m", blocks.dw_block_m),
        ("n (dW's columns)", n, "dw_block_n", blocks.dw_block_n),
    ]
    for dim, size, block, b in needs:
        if size % b:
            raise ValueError(f"mosaic grouped matmul: {dim}={size} must be a multiple of {block}={b}")


def _grid_block_n(n: int, blocks: MosaicBlocks) -> int:
    if blocks.grid_block_n is not None:
        return blocks.grid_block_n
    return 2 if (n // blocks.block_n) % 2 == 0 else 1


@contextlib.contextmanager
def _interpreted(interpret: bool):
    """JAX's kernels call plgpu.kernel without `interpret`: with interpret, their modules
    alone see a plgpu whose kernel runs under the Mosaic GPU interpreter (jax >= 0.12;
    wgmma, TMA and the persistent grid simulated on the CPU), for tests."""
    if not interpret:
        yield
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    fake = types.SimpleNamespace(
        **{name: getattr(plgpu, name) for name in dir(plgpu) if not name.startswith("__")}
    )
    fake.kernel = functools.partial(plgpu.kernel, interpret=plgpu.InterpretGPUParams())
    mods = (ragged_dot_mgpu, transposed_ragged_dot_mgpu)
    for mod in mods:
        mod.plgpu = fake
    try:
        yield
    finally:
        for mod in mods:
            mod.plgpu = plgpu


@contextlib.contextmanager
def _sm_count():
    """transposed_ragged_dot reads jax.devices()[0].core_count; off a GPU (a deviceless
    compile) that module alone sees an H100's SM count."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd

    if hasattr(jax.devices()[0], "core_count"):
        yield
        return
    fake = types.SimpleNamespace(
        **{name: getattr(jax, name) for name in dir(jax) if not name.startswith("__")}
    )
    fake.devices = lambda *a, **k: [types.SimpleNamespace(core_count=H100_SMS)]
    trd.jax = fake
    try:
        yield
    finally:
        trd.jax = jax


def _ragged(lhs, rhs, group_sizes, blocks: MosaicBlocks, interpret: bool, *, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    with _interpreted(interpret):
        return ragged_dot_mgpu.ragged_dot(
            lhs,
            rhs,
            group_sizes=group_sizes,
            block_m=blocks.block_m,
            block_n=blocks.block_n,
            block_k=blocks.block_k,
            max_concurrent_steps=blocks.max_concurrent_steps,
            grid_block_n=_grid_block_n(n, blocks),
            transpose_rhs=transpose_rhs,
        )


def _zero_tail(x, group_sizes):
    valid = (jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None]
    return jnp.where(valid, x, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(a, w, group_sizes, blocks, full, interpret):
    out = _ragged(a, w, group_sizes, blocks, interpret, transpose_rhs=False)
    return out if full else _zero_tail(out, group_sizes)


def _fwd(a, w, group_sizes, blocks, full, interpret):
    return _grouped(a, w, group_sizes, blocks, full, interpret), (a, w, group_sizes)


def _bwd(blocks, full, interpret, res, dout):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    a, w, group_sizes = res
    dout = dout.astype(a.dtype)
    if not full:
        a, dout = _zero_tail(a, group_sizes), _zero_tail(dout, group_sizes)
    da = _ragged(dout, w, group_sizes, blocks, interpret, transpose_rhs=True)
    if not full:
        da = _zero_tail(da, group_sizes)
    with _sm_count(), _interpreted(interpret):
        dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            a,
            dout,
            group_sizes=group_sizes,
            block_m=blocks.dw_block_m,
            block_n=blocks.dw_block_n,
            block_k=blocks.dw_block_k,
            max_concurrent_steps=blocks.dw_max_concurrent_steps,
            grid_block_n=blocks.dw_grid_block_n,
        )
    return da, dw.astype(w.dtype), None


_grouped.defvjp(_fwd, _bwd)


def mosaic_grouped_matmul(
    a: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    full: bool = False,
    blocks: MosaicBlocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Hopper (sm90) only (wgmma and TMA). `full`: the caller knows every row is in a
    group (skips zeroing the tail). `interpret`: the Mosaic GPU interpreter (tests, jax
    >= 0.12); never chosen by the backend, as no other platform runs these kernels."""
    blocks = blocks or MosaicBlocks()
    check_shapes(a.shape, w.shape, a.dtype, blocks)
    if w.dtype != a.dtype:
        w = w.astype(a.dtype)
    return _grouped(a, w, group_sizes.astype(jnp.int32), blocks, full, interpret)
