"""Microbatch rows and the stage axis's size, shared by the pipelines (pipeline.py: GPipe and
circular; tick_pipeline.py: the tick-table schedules) without either importing the other."""

from __future__ import annotations

import jax


def stage_axis_size(axis: str) -> int | None:
    """Size of mesh axis `axis` in the current (abstract) mesh; None without a mesh or axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return None
    return dict(mesh.shape)[axis]


def split_microbatches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...]; microbatch i = rows i, i+m, i+2m, ..."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def merge_microbatches(a: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`: [m, B/m, ...] -> [B, ...]."""
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])
