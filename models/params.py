"""Bridges between an NNX model and plain pytrees: the trainer, Orbax and the
sharding rules all work on nested dicts of arrays, not on Variables."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(state: nnx.State) -> dict:
    """Nested dict (same structure as `nnx.to_pure_dict(state)`) of each
    parameter's logical axis names, as declared by the model."""
    axes = jax.tree.map(lambda v: tuple(v.get_metadata().get("out_sharding") or ()), state, is_leaf=_is_var)
    return nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes


def abstract_model(make_model) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and abstract parameter state (ShapeDtypeStructs), allocating nothing.

    Runs with no mesh in context: under a mesh, `nnx.eval_shape` would read the
    logical names as mesh axes; we resolve them with `sharding.rules` instead.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(make_model))


def merge(graphdef: nnx.GraphDef, abstract_state: nnx.State, params: dict) -> Any:
    """Rebuild a model from its graphdef and a nested dict of arrays."""
    state = jax.tree.map(lambda x: x, abstract_state, is_leaf=_is_var)  # a copy we may fill
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
