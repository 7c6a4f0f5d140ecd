"""Meshes and logical-axis sharding rules, usable by any JAX project.

Imports only jax and numpy: `from sharding import rules` must not pull in flax,
optax or the trainer (tests check this in a fresh interpreter).

Mesh axes are **Auto** (classic GSPMD/Shardy propagation): parameters and a few
activation hints carry shardings and XLA partitions the rest. We chose Auto over
Explicit ("sharding in types") on purpose: model code stays free of
`out_sharding=` arguments on every contraction, Pallas kernels run under
`shard_map` either way, and `with_sharding_constraint` hints at layer
boundaries are enough for XLA to pick the collectives we want. See the docs' Parallelism
page (docs/parallelism.md).
"""

from jaxtrain.sharding.mesh import MESH_AXES, make_mesh, mesh_shape_from_sizes
from jaxtrain.sharding.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from jaxtrain.sharding.pipeline import Schedule as PipelineSchedule
from jaxtrain.sharding.pipeline import bubble_fraction, run_pipeline
from jaxtrain.sharding.rules import (
    DATA_PARALLEL,
    DEFAULT_RULES,
    FSDP,
    FSDP_TENSOR,
    FSDP_TENSOR_SP,
    PRESETS,
    AxisRules,
    axes_tuple,
    axis_rules,
    constrain,
    current_rules,
    format_parameter_table,
    is_vocab_parallel,
    logical_axes_by_path,
    logical_to_spec,
    named_sharding,
    parameter_table,
    shard_further,
    tree_shardings,
    tree_specs,
    vocab_parallel_head,
    with_rules,
)

__all__ = [
    "MESH_AXES",
    "make_mesh",
    "mesh_shape_from_sizes",
    "PIPELINE_SCHEDULES",
    "PipelineSchedule",
    "bubble_fraction",
    "run_pipeline",
    "DATA_PARALLEL",
    "DEFAULT_RULES",
    "FSDP",
    "FSDP_TENSOR",
    "FSDP_TENSOR_SP",
    "PRESETS",
    "AxisRules",
    "axes_tuple",
    "axis_rules",
    "constrain",
    "current_rules",
    "with_rules",
    "logical_to_spec",
    "logical_axes_by_path",
    "named_sharding",
    "is_vocab_parallel",
    "parameter_table",
    "vocab_parallel_head",
    "format_parameter_table",
    "shard_further",
    "tree_shardings",
    "tree_specs",
]
