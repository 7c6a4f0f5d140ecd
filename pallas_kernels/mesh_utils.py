"""Mesh and platform helpers shared by the sharded, ring, Ulysses and chunked paths.

Which backend the kernels target (from an array's devices, a mesh's devices or
the abstract mesh in context), how mesh-axis arguments are normalised, and the
``shard_map`` plumbing around per-shard attention. Imports only jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = [
    "axes_tuple",
    "check_context_inputs",
    "device_kind",
    "has_explicit_axes",
    "mesh_backend",
    "mesh_platform",
    "reshard_to_specs",
    "resolve_backend",
    "shard_over_sequence",
]


def axes_tuple(name: str, axes) -> tuple[str, ...]:
    """Mesh axes given as None, one name or a sequence of names, as a tuple."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    try:
        return tuple(axes)
    except TypeError:
        raise ValueError(f"{name} must be a mesh axis name or a sequence of them, got {axes!r}") from None


def mesh_platform(mesh) -> str:
    """The platform of a ``Mesh``'s devices or an ``AbstractMesh``'s abstract device ('cuda' -> 'gpu')."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        platform = getattr(mesh.abstract_device, "platform", None) or jax.default_backend()
    else:
        platform = next(iter(mesh.devices.flat)).platform
    platform = platform.lower()
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def mesh_backend(mesh) -> str:
    """The kernels' backend for a mesh: 'tpu', 'gpu', or 'cpu' for anything else."""
    platform = mesh_platform(mesh)
    return platform if platform in ("tpu", "gpu") else "cpu"


def has_explicit_axes(mesh) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def reshard_to_specs(mesh, args, specs) -> tuple:
    """Lay out ``args`` as ``shard_map``'s in_specs where the mesh needs it.

    Explicit ("sharding in types") axes: shard_map wants inputs already laid out
    as in_specs; Auto axes are resharded by shard_map itself. An AbstractMesh
    (from jax.get_abstract_mesh()) is the one set in context, so a bare
    PartitionSpec refers to it. Arguments whose spec is None pass unchanged.
    """
    if not has_explicit_axes(mesh):
        return tuple(args)
    abstract = isinstance(mesh, jax.sharding.AbstractMesh)
    return tuple(
        x if spec is None else jax.reshard(x, spec if abstract else jax.NamedSharding(mesh, spec))
        for x, spec in zip(args, specs)
    )


def _platform_of(x) -> str | None:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return next(iter(x.devices())).platform
    return None


def _abstract_device():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", True):
        return None
    return getattr(mesh, "abstract_device", None)


def resolve_backend(x=None) -> str:
    """'tpu', 'gpu' or 'cpu' for an array: its devices, else the mesh in context, else jax's default."""
    platform = _platform_of(x) if x is not None else None
    if platform is None:
        dev = _abstract_device()
        platform = getattr(dev, "platform", None)
    if platform is None:
        platform = jax.default_backend()
    platform = platform.lower()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "cpu"


def device_kind() -> str | None:
    """The TPU device kind in use (the abstract mesh in context, else the first device), else None."""
    dev = _abstract_device()
    if dev is not None:
        return dev.device_kind
    try:
        d = jax.devices()[0]
    except RuntimeError:  # no backend could start here: no TPU kind to tune for
        return None
    return d.device_kind if d.platform == "tpu" else None


def check_context_inputs(q, k, v, *, mesh, axis_name):
    """ValueError unless q, k, v are [batch, seq, heads, head_dim] (GQA allowed; v's head dim
    may differ from q/k's) and ``axis_name`` is a mesh axis."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), "
                f"got shape {getattr(x, 'shape', None)}"
            )
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis (mesh axes: {mesh.axis_names})")
    if k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k and v must be [batch, seq, kv_heads, head_dim] like q: q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")


def shard_over_sequence(local, q, k, v, segment_ids, *, mesh, axis_name, batch_axes, head_axes, sinks=None):
    """Run ``local(q, k, v, seg)`` per shard: sequence split over ``axis_name``,
    batch over ``batch_axes``, heads over ``head_axes``; output laid out like q. With
    ``sinks`` ([q heads], split over ``head_axes`` as the heads): ``local(q, k, v, seg, sinks)``."""
    x_spec = P(batch_axes or None, axis_name, head_axes or None, None)
    seg_spec = P(batch_axes or None, axis_name)
    if segment_ids is None:
        fn_local = lambda q, k, v, *sinks: local(q, k, v, None, *sinks)
        in_specs, args = (x_spec,) * 3, (q, k, v)
    else:
        fn_local = lambda q, k, v, s, *sinks: local(q, k, v, s.astype(jnp.int32), *sinks)
        in_specs, args = (x_spec,) * 3 + (seg_spec,), (q, k, v, segment_ids)
    if sinks is not None:
        in_specs, args = (*in_specs, P(head_axes or None)), (*args, sinks)
    # check_vma=False: the Pallas kernels' out_shapes carry no manual-axis types
    # and interpret mode fails the varying-axes check (JAX_NOTES, Pallas).
    fn = jax.shard_map(fn_local, mesh=mesh, in_specs=in_specs, out_specs=x_spec, check_vma=False)
    return fn(*reshard_to_specs(mesh, args, in_specs))


KERNEL_BACKENDS = ("tpu", "gpu", "cpu")


def kernel_backend(x, backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """A Pallas kernel's (backend, interpret), decided once: `backend` 'tpu' (Mosaic), 'gpu'
    (Triton) or 'cpu', None: from x's devices (`resolve_backend`); `interpret` None: the
    interpreter on 'cpu' only, the one way a kernel runs there."""
    if backend is None:
        backend = resolve_backend(x)
    elif backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS} or None, got {backend!r}")
    if interpret is None:
        interpret = backend == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("backend='cpu' only runs in interpret mode (interpret=True or None)")
    return backend, interpret


def check_shard_axes(mesh, batch_axes, head_axes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch_axes, head_axes) as tuples of `mesh`'s axes, disjoint: how a kernel called per
    shard splits its batch and its heads."""
    batch_axes = axes_tuple("batch_axes", batch_axes)
    head_axes = axes_tuple("head_axes", head_axes)
    for name, axes in (("batch_axes", batch_axes), ("head_axes", head_axes)):
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(f"{name}: {a!r} is not a mesh axis (mesh axes: {mesh.axis_names})")
    if set(batch_axes) & set(head_axes):
        raise ValueError(f"batch_axes {batch_axes} and head_axes {head_axes} overlap")
    return batch_axes, head_axes
