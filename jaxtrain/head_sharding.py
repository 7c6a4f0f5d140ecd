"""`mesh.head_sharding`: how the untied output head is laid out, and the axis rules a run
uses.

Under FSDP every weight is sharded on d_model and all-gathered where it is used. For the
head [d_model, vocab] that costs about 2 x d_model x vocab / tensor values per device per
microbatch (the gather, and the gradient's reduce-scatter), however few tokens there are.
`vocab` shards the head on vocab over fsdp instead (sharding.vocab_parallel_head) and
gathers the final activations into the head's rows: about 2 x rows x d_model values, where
rows = the microbatch's tokens / (data x expert x context), the rows one device then holds.
`auto` picks `vocab` when rows < vocab / tensor, the point where that moves fewer bytes:
small batches and long vocabularies (the 4096-token bench-peer step against a 32000-entry
vocabulary), never a pod's million-token batch. The log-sum-exp of the cross-entropy is then
summed over fsdp (a few floats per token). The embedding table keeps its FSDP layout: sharded
on vocab, its lookup became a [tokens, d_model] all-reduce, slower on TPU (README).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxtrain.config import Config

if TYPE_CHECKING:
    from jaxtrain.sharding import AxisRules


def head_rows_per_device(cfg: Config, mesh_shape: Mapping[str, int]) -> int:
    """Tokens of one microbatch that one device holds when the head is vocab-parallel
    (gathered over fsdp; still split over data, expert and context)."""
    t = cfg.train
    split = mesh_shape.get("data", 1) * mesh_shape.get("expert", 1) * mesh_shape.get("context", 1)
    return t.global_batch_size * t.seq_len // (max(1, t.microbatches) * split)


def resolve(cfg: Config, mesh_shape: Mapping[str, int]) -> tuple[str, str]:
    """(`embed` or `vocab`, why) for `cfg.mesh.head_sharding` on a mesh of these axis sizes
    (ICI x DCN, as built)."""
    mode = cfg.mesh.head_sharding
    if mode != "auto":
        return mode, "as configured"
    fsdp = mesh_shape.get("fsdp", 1)
    if fsdp <= 1:
        return "embed", "no fsdp axis to shard the vocabulary over"
    if cfg.mesh.rules == "data_parallel":
        return "embed", "mesh.rules=data_parallel replicates the head"
    if cfg.mesh.stage > 1:
        return "embed", "pipeline stages keep the head FSDP-sharded"
    rows = head_rows_per_device(cfg, mesh_shape)
    columns = cfg.model.vocab_size // max(1, mesh_shape.get("tensor", 1))
    if rows < columns:
        return "vocab", (
            f"a device gathers {rows} activation rows x d_model instead of the head's "
            f"{columns} vocabulary columns x d_model"
        )
    return "embed", f"{rows} activation rows per device >= {columns} vocabulary columns per device"


def axis_rules(cfg: Config, mesh_shape: Mapping[str, int]) -> AxisRules:
    """The run's logical-axis rules: the `mesh.rules` preset, vocab-parallel head if resolved."""
    from jaxtrain import sharding  # imports jax; resolve() does not (the planner's analytic pass)

    rules = sharding.PRESETS[cfg.mesh.rules]
    return sharding.vocab_parallel_head(rules) if resolve(cfg, mesh_shape)[0] == "vocab" else rules


def note(cfg: Config, mesh_shape: Mapping[str, int]) -> str:
    """The log line saying what `mesh.head_sharding` resolved to and why."""
    mode, why = resolve(cfg, mesh_shape)
    return f"mesh.head_sharding={cfg.mesh.head_sharding} -> {mode}: {why}"
