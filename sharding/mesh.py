"""Build a named device mesh from per-axis sizes.

Axis order is fixed (outermost first): data, stage, fsdp, context, expert,
tensor. The innermost axes get the closest devices (on TPU, neighbours on the
ICI torus via `mesh_utils`), so tensor parallelism, the most communication
hungry, sits on the fastest links; data parallelism, which only all-reduces
gradients once per step, sits outermost (and across slices/hosts via DCN).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "context", "expert", "tensor")
_log = logging.getLogger("jaxtrain.sharding")


def mesh_shape_from_sizes(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolve sizes (one may be -1: fill the rest) into a full {axis: size} dict.

    Missing axes default to 1. Raises ValueError naming the axis and value when
    an axis is unknown, a size is invalid, or the product does not equal
    `num_devices`.
    """
    unknown = [a for a in axis_sizes if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh axis {unknown[0]!r} is unknown; expected one of {MESH_AXES}")
    sizes = {a: int(axis_sizes.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh axes {fill} are all -1; at most one axis may fill the rest")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"mesh.{a}={s}: expected a positive size or -1 (fill the remaining devices)")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"mesh.{fill[0]}=-1: the other axes multiply to {known}, which does not divide "
                f"the {num_devices} devices"
            )
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        raise ValueError(f"mesh product {product} ({shape}) does not equal the device count {num_devices}")
    return sizes


def make_mesh(
    axis_sizes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    *,
    dcn_axis_sizes: Mapping[str, int] | None = None,
    allow_plain_grid: bool = False,
) -> Mesh:
    """Make a `Mesh` with all of MESH_AXES (size-1 ones included) and Auto axis types.

    `axis_sizes` are per-slice (ICI) degrees; `dcn_axis_sizes` multiply them across slices /
    hosts (multi-slice TPU, multi-node GPU). Device order comes from `mesh_utils`: torus-aware
    on TPU, plain order where the devices have no physical layout (CPU, GPU, compile-only
    devices). Where mesh_utils knows no layout for TPU devices (a subset of a slice, say), a
    topology-blind order would put neighbours in the mesh far apart on the torus: ValueError,
    unless `allow_plain_grid`, which takes the plain order with one warning saying why.
    Multi-slice: devices are grouped by slice (TPU `slice_index`, else by process: GPU hosts,
    CPU processes).
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn = {a: int(s) for a, s in (dcn_axis_sizes or {}).items()}
    n_slices = math.prod(dcn.values()) if dcn else 1
    if len(devices) % n_slices:
        raise ValueError(f"dcn axis sizes {dcn} (product {n_slices}) do not divide {len(devices)} devices")
    ici = mesh_shape_from_sizes(axis_sizes, len(devices) // n_slices)
    ici_shape = tuple(ici[a] for a in MESH_AXES)
    on_tpu = getattr(devices[0], "platform", None) == "tpu"
    if n_slices > 1:
        dcn_full = mesh_shape_from_sizes(dcn, n_slices)
        dcn_shape = tuple(dcn_full[a] for a in MESH_AXES)
        if not on_tpu:  # no slices: processes are the granules (mesh_utils' process_is_granule)
            grid = _hybrid_plain_grid(devices, ici_shape, dcn_shape)
        else:
            try:
                grid = mesh_utils.create_hybrid_device_mesh(
                    ici_shape, dcn_shape, devices, allow_split_physical_axes=True
                )
            except (ValueError, AssertionError, NotImplementedError) as e:
                _plain_order_or_refuse(devices, f"{ici_shape} x {dcn_shape} slices", e, allow_plain_grid)
                grid = _hybrid_plain_grid(devices, ici_shape, dcn_shape)
    else:
        try:
            grid = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
        except (ValueError, AssertionError, NotImplementedError) as e:
            if on_tpu:
                _plain_order_or_refuse(devices, str(ici_shape), e, allow_plain_grid)
            else:
                _log.warning(
                    "mesh: no device order for %s from mesh_utils (%s); devices in plain order",
                    ici_shape,
                    _first_line(e),
                )
            grid = _plain_grid(devices, ici_shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def _plain_order_or_refuse(devices, shape: str, error: Exception, allowed: bool) -> None:
    """TPU devices mesh_utils cannot lay out: refuse, or (asked for) warn and go on."""
    what = f"{len(devices)} {devices[0].device_kind} devices as {shape}"
    if not allowed:
        raise ValueError(
            f"mesh: no torus-aware device order for {what} ({_first_line(error)}); a topology-blind "
            "order would slow every collective. Use a whole slice, or allow it (mesh.allow_plain_grid=true)"
        ) from error
    _log.warning(
        "mesh: no torus-aware device order for %s (%s); devices in plain order, as asked",
        what,
        _first_line(error),
    )


def _hybrid_plain_grid(
    devices: Sequence[jax.Device], ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...]
) -> np.ndarray:
    """A multi-slice grid where mesh_utils has no physical layout (CPU processes, GPU hosts):
    devices grouped by slice (TPU `slice_index`, else `process_index`; stable in the given
    order), each group laid out on the ICI shape, groups on the DCN shape, and each mesh
    axis indexed DCN-major (index = dcn_i * ici_size + ici_i), as mesh_utils does. So a DCN
    degree always crosses the slice / process boundary, whatever the other axes are."""
    n_slices = math.prod(dcn_shape)

    def key(d) -> int:
        index = getattr(d, "slice_index", None)
        return int(index if index is not None else getattr(d, "process_index", 0))

    ordered = sorted(devices, key=key)
    per = len(ordered) // n_slices
    groups = [ordered[i * per : (i + 1) * per] for i in range(n_slices)]
    if len(set(map(key, ordered))) == n_slices and any(len(set(map(key, g))) > 1 for g in groups):
        raise ValueError(f"devices do not split evenly into {n_slices} slices / processes")
    k = len(ici_shape)
    grid = np.asarray(ordered, dtype=object).reshape(*dcn_shape, *ici_shape)
    # (d0, ..., dk, i0, ..., ik) -> (d0, i0, d1, i1, ...) -> (d0*i0, d1*i1, ...)
    grid = grid.transpose([j for a in range(k) for j in (a, k + a)])
    return grid.reshape(tuple(i * d for i, d in zip(ici_shape, dcn_shape)))


def _plain_grid(devices: Sequence[jax.Device], shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(devices, dtype=object).reshape(shape)
