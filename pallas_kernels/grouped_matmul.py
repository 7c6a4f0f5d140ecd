"""Grouped matmul for dropless MoE on TPU: JAX's Pallas megablox kernels (gmm forward,
gmm + tgmm backward, with their cost estimates), as MaxText's `megablox=True`.

`megablox_grouped_matmul(a, w, group_sizes)`: a [m, k] rows sorted by group, w [groups, k,
n], group_sizes [groups] -> [m, n], row i through its group's w. On a TPU (the mesh in
context or jax's backend, deviceless compiles included) the Mosaic kernel; anywhere else it
runs interpreted (tests), like every kernel in this package. Imports only jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from jaxtrain.pallas_kernels.mesh_utils import resolve_backend

__all__ = ["megablox_grouped_matmul"]


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """gmm tiles: rows in the largest power of two up to 512 dividing m (gmm needs m % tm
    == 0), k and n in blocks of 1024 or whole (MaxText's default tile sizes)."""
    tm = 512
    while m % tm:
        tm //= 2
    return tm, min(k, 1024), min(n, 1024)


def megablox_grouped_matmul(a: jax.Array, w: jax.Array, group_sizes: jax.Array, *, full: bool = False):
    """Rows past sum(group_sizes) come out zero, and so do their gradients (gmm leaves them
    unwritten: zeros are selected there); `full`: the caller knows every row is in a group."""
    interpret = resolve_backend() != "tpu"
    if not full:
        valid = (jnp.arange(a.shape[0]) < jnp.sum(group_sizes))[:, None]
        a = jnp.where(valid, a, 0)
    # custom_vjp: gmm forward, gmm + tgmm backward; positional (its nondiff args)
    out = megablox.gmm(
        a,
        w,
        group_sizes.astype(jnp.int32),
        a.dtype,
        tiling(a.shape[0], a.shape[1], w.shape[2]),
        None,
        None,
        False,
        interpret,
    )
    return out if full else jnp.where(valid, out, 0)
