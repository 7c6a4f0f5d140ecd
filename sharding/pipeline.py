"""Pipeline parallelism as a transform over a per-layer function (SPMD).

`run_pipeline(layer_fn, params, x)` runs a stack of L layers (every leaf of
`params` stacked `[L, ...]`) over activations `x` split into M microbatches,
as S pipeline stages that XLA places on the mesh axis `stage`. It is one SPMD
program, written as MaxText's `pipeline.py` is (GSPMD, no per-device code):

* the weights are viewed as `[stage, repeat, layers_per_stage, ...]` and
  constrained to be sharded on `stage` along their first dimension only (every
  other dimension is left `UNCONSTRAINED`, so FSDP / tensor / expert shardings of
  the inside of a layer compose: GSPMD keeps what the caller's rules gave them);
* a buffer `state [stage, microbatch rows, ...]`, sharded on `stage`, holds what
  each stage works on in this iteration; one `jax.vmap` over its first
  dimension (with `spmd_axis_name="stage"`, so sharding hints inside the layer
  gain `stage` on that dimension) runs every stage at once: a `lax.scan` over
  the stage's `layers_per_stage` layers, each `layer_fn` (remat it yourself);
* between iterations the state shifts by one stage (`jnp.roll` on the
  stage-sharded dimension, which XLA lowers to a collective-permute over
  `stage`), and stage 0 takes the next microbatch;
* `M*R + S - 1` iterations in all, so the idle share of every device (the
  bubble) is `(S - 1) / (M*R + S - 1)` (`bubble_fraction`).

Schedules. `repeats=1` is GPipe: stage s holds layers `s*lps .. (s+1)*lps - 1`.
`repeats=R>1` is the circular (interleaved) schedule: stage s holds R chunks,
layer `l = r*S*lps + s*lps + j` for repeat r, so a microbatch goes round the
ring of stages R times and the bubble shrinks R-fold for the same M. A
microbatch leaving the last stage waits in a buffer `[M, rows, ...]` until
stage 0 takes it for the next repeat, which needs `M >= S` (checked).

The schedules 1f1b, interleaved_1f1b and zero_bubble, whose backward passes interleave with
the forwards, cannot be autodiff of a forward loop: `sharding/tick_pipeline.py` runs them
(the loss inside, a custom VJP at the boundary; `Schedule.loss`), with this module's weight
layout. Every schedule's tick table, and its bubble, is in `sharding/pipeline_tables.py`.

Parameter layout. The caller stores layers in model order `[L, ...]`, sharded
on `stage` by the rule `layers -> stage` (checkpoints and HF conversion do not
know about pipelines). For GPipe, stage s's device already holds exactly its
contiguous block, so the view `[S, 1, lps]` is a local reshape. For circular
schedules the layers a stage needs are strided (`l = r*S*lps + s*lps + j`), so
the view moves weights between stage devices once per step, before the loop
(and the gradients back after it), not once per iteration. What XLA makes of it
(CPU, 16 toy layers, stage 4 x data 2, forward + grad with the gradients held to
the parameters' sharding, as the train step does): GPipe, 5 collective-permutes
(the shift) and no all-gather / all-to-all; circular R=2, 2 all-to-alls over
`stage` (the view and its transpose) and 7 collective-permutes. We accept those
two all-to-alls per step rather than store a permuted layer order that every
checkpoint reader would have to undo.

Microbatch m takes rows m, m+M, m+2M, ... (as `train.microbatches` splits),
so a batch sharded over data axes gives every data shard equal work in every
microbatch. Per-row side inputs (`extras`: positions, segment ids) are not
shifted: each stage reads its microbatch's rows from a replicated copy.

Imports only jax (like the rest of `jaxtrain.sharding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.sharding.microbatches import merge_microbatches, split_microbatches
from jaxtrain.sharding.microbatches import stage_axis_size as _stage_axis_size
from jaxtrain.sharding.pipeline_tables import TABLE_SCHEDULES, TickTable
from jaxtrain.sharding.pipeline_tables import table as schedule_table

SCHEDULES = TABLE_SCHEDULES  # gpipe, circular (this module); 1f1b, interleaved_1f1b, zero_bubble
# (sharding/tick_pipeline.py: forwards and backwards interleaved, the loss inside the pipeline)
TICK_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of each device: (S - 1) / (M*R + S - 1)."""
    _check_counts(stages, microbatches, repeats)
    return (stages - 1) / (microbatches * repeats + stages - 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a model needs to run its layer stacks as a pipeline.

    `name`: one of SCHEDULES; None: gpipe for repeats=1, circular otherwise. A forward
    (`__call__`) always runs `run_pipeline` (for a tick schedule that is the forward alone:
    evaluation, where nothing is kept for a backward). A train step asks `backward_inside`:
    if true it calls `loss` instead, whose forward and backward interleave by the table."""

    stages: int
    microbatches: int
    repeats: int = 1
    axis: str = "stage"
    name: str | None = None

    def __post_init__(self):
        _check_counts(self.stages, self.microbatches, self.repeats)
        self.table  # noqa: B018 - validates the schedule's name and counts

    @property
    def schedule(self) -> str:
        return self.name or ("gpipe" if self.repeats == 1 else "circular")

    @property
    def table(self) -> TickTable:
        """Which stage does what at each tick (sharding/pipeline_tables.py)."""
        return schedule_table(self.schedule, self.stages, self.microbatches, self.repeats)

    @property
    def bubble(self) -> float:
        """The idle share of the schedule's tick table."""
        return self.table.bubble

    @property
    def backward_inside(self) -> bool:
        """Whether the backward pass runs inside the pipeline (TICK_SCHEDULES)."""
        return self.schedule in TICK_SCHEDULES

    def loss(
        self, layer_fn, tail_fn, params, tail_params, x, extras, tail_inputs, x_spec=None, aux_weights=None
    ):
        """The summed loss of `tail_fn` over the microbatches, differentiable, with forward
        and backward run by the tick table (sharding/tick_pipeline.py `pipeline_loss`; with
        `aux_weights`, (loss, the layers' aux) and the aux losses' gradients inside)."""
        from jaxtrain.sharding.tick_pipeline import pipeline_loss  # it imports this module

        f = pipeline_loss(layer_fn, tail_fn, table=self.table, axis=self.axis, x_spec=x_spec)
        return f(params, tail_params, x, extras, tail_inputs, aux_weights)

    def __call__(self, layer_fn, params, x, extras=None, x_spec=None):
        return run_pipeline(
            layer_fn,
            params,
            x,
            extras,
            x_spec=x_spec,
            stages=self.stages,
            microbatches=self.microbatches,
            repeats=self.repeats,
            axis=self.axis,
        )


def _check_counts(stages: int, microbatches: int, repeats: int) -> None:
    for name, v in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"pipeline: {name}={v!r}: expected a positive integer")


def _on_stage(a: jax.Array, axis: str | None, rows: P | None = None) -> jax.Array:
    """Constrain dim 0 of `a` to mesh axis `axis` (None: replicated there if `rows` is
    given, else left alone) and the rest to `rows` (None: left to the partitioner)."""
    if axis is None and rows is None:
        return a
    rest = [P.UNCONSTRAINED] * (a.ndim - 1) if rows is None else [*rows, *[None] * (a.ndim - 1 - len(rows))]
    return jax.lax.with_sharding_constraint(a, P(axis, *rest))


def run_pipeline(
    layer_fn: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]],
    params: Any,
    x: jax.Array,
    extras: Any = None,
    *,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    axis: str = "stage",
    x_spec: P | None = None,
) -> tuple[jax.Array, Any]:
    """Run `layer_fn` over every layer of `params` as an S-stage pipeline.

    layer_fn(layer_params, x_rows, extras_rows) -> (x_rows, aux): one layer on one
      microbatch (`layer_params`: `params` without its leading layer dim; `aux`: any
      pytree of arrays, or None).
    params: pytree, every leaf `[L, ...]` with layers in model order; L must be a
      multiple of stages * repeats.
    x: activations `[B, ...]`, B a multiple of `microbatches`.
    extras: pytree of `[B, ...]` per-row inputs every layer sees unchanged (or None).
    axis: the mesh axis the stages run on. Without a mesh that has it (one device,
      tests) the same schedule runs unsharded, which is how it is checked.
    x_spec: the PartitionSpec of one microbatch of `x` (`[rows, ...]`, e.g. rows over the
      data axes); the stage and microbatch buffers are held to it. None: left to the
      partitioner, which may pick a layout it then has to undo at every iteration.

    Returns (y `[B, ...]`, aux stacked `[L, M, ...]`: layer in model order, microbatch).
    The result equals applying the L layers in order to each microbatch.
    """
    _check_counts(stages, microbatches, repeats)
    S, M, R = stages, microbatches, repeats
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("pipeline: params has no arrays")
    n_layers = leaves[0].shape[0] if leaves[0].ndim else 0
    for leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != n_layers:
            raise ValueError(
                f"pipeline: every params leaf needs the same leading layer dim; got {leaf.shape}"
            )
    if n_layers % (S * R):
        raise ValueError(
            f"pipeline: {n_layers} layers do not split into stages={S} x repeats={R} equal chunks"
        )
    if x.ndim < 1 or x.shape[0] % M:
        raise ValueError(f"pipeline: x batch {x.shape[:1]} is not a multiple of microbatches={M}")
    if R > 1 and M < S:
        raise ValueError(
            f"pipeline: the circular schedule needs microbatches >= stages; got microbatches={M}, stages={S}"
        )
    for e in jax.tree.leaves(extras):
        if e.shape[:1] != x.shape[:1]:
            raise ValueError(f"pipeline: extras leaf {e.shape} does not share x's batch dim {x.shape[0]}")
    mesh_size = _stage_axis_size(axis)
    if mesh_size not in (None, 1, S):
        raise ValueError(f"pipeline: stages={S} but mesh axis {axis!r} has size {mesh_size}")
    spmd = axis if mesh_size == S and S > 1 else None
    lps = n_layers // (S * R)

    # [L, ...] -> [S, R, lps, ...], layer l = r*S*lps + s*lps + j.
    def to_stages(p):
        p = p.reshape(R, S, lps, *p.shape[1:]).swapaxes(0, 1)
        return _on_stage(p, spmd)

    stage_params = jax.tree.map(to_stages, params)
    if x_spec is not None and mesh_size is None:
        x_spec = None  # no mesh: nothing to constrain to
    xs = _on_stage(split_microbatches(x, M), None, x_spec)  # [M, rows, ...]
    ex = jax.tree.map(lambda e: split_microbatches(e, M), extras)

    def stage_fn(p_stage, repeat, h, ex_rows):
        p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), p_stage)

        def body(h, lp):
            return layer_fn(lp, h, ex_rows)

        return jax.lax.scan(body, h, p)  # aux: [lps, ...]

    # The iteration's weight slice depends on the iteration (its repeat), so autodiff would
    # keep one copy per iteration for the backward pass: (M*R + S - 1) x a stage's weights
    # (129 GiB of temp per H100 for Llama-2-70B). So the backward pass recomputes each
    # iteration's stage from its input, the only thing kept: one microbatch per stage per
    # iteration. The price is one more forward pass of the layers (the per-layer remat
    # inside still applies within that recompute).
    stage_fn = jax.checkpoint(stage_fn, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)

    run_stages = jax.vmap(stage_fn, spmd_axis_name=spmd)
    one_aux = jax.eval_shape(
        stage_fn,
        jax.tree.map(lambda a: a[0], stage_params),
        jnp.zeros((), jnp.int32),
        xs[0],
        jax.tree.map(lambda e: e[0], ex),
    )[1]
    # aux accumulator [S, R, lps, M, ...]; entries of idle (bubble) slots are never written.
    aux0 = jax.tree.map(lambda a: jnp.zeros((S, R, lps, M, *a.shape[1:]), a.dtype), one_aux)
    stage_ids = jnp.arange(S)

    def iteration(carry, t):
        state, buf, aux_acc = carry
        k = t - stage_ids  # the schedule step each stage is at; valid in [0, M*R)
        valid = (k >= 0) & (k < M * R)
        micro, repeat = jnp.mod(k, M), jnp.clip(k // M, 0, R - 1)
        state = state.at[0].set(jax.lax.dynamic_index_in_dim(buf, jnp.mod(t, M), 0, keepdims=False))
        state = _on_stage(state, spmd, x_spec)
        ex_rows = jax.tree.map(lambda e: _on_stage(jnp.take(e, micro, axis=0), spmd), ex)
        out, aux = run_stages(stage_params, repeat, state, ex_rows)
        out = _on_stage(out, spmd, x_spec)
        # The last stage's output is microbatch (t - S + 1) mod M, finished with a repeat:
        # it waits in `buf` for stage 0 (next repeat) or is the result (last repeat).
        done = jnp.mod(t - (S - 1), M)
        old = jax.lax.dynamic_index_in_dim(buf, done, 0, keepdims=False)
        buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(t >= S - 1, out[S - 1], old), done, 0)
        buf = _on_stage(buf, None, x_spec)

        def record(acc, a, r, m, ok):  # one stage: acc [R, lps, M, ...], a [lps, ...]
            cur = acc[r, :, m]
            return acc.at[r, :, m].set(jnp.where(ok, a, cur))

        aux_acc = jax.tree.map(
            lambda acc, a: jax.vmap(record, spmd_axis_name=spmd)(acc, a, repeat, micro, valid), aux_acc, aux
        )
        return (_on_stage(jnp.roll(out, 1, axis=0), spmd, x_spec), buf, aux_acc), None

    state0 = _on_stage(jnp.zeros((S, *xs.shape[1:]), xs.dtype), spmd, x_spec)
    steps = jnp.arange(M * R + S - 1)
    (_, buf, aux_acc), _ = jax.lax.scan(iteration, (state0, xs, aux0), steps)
    # [S, R, lps, M, ...] -> [R, S, lps, M, ...] -> [L, M, ...] (model order)
    aux = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(n_layers, M, *a.shape[4:]), aux_acc)
    return merge_microbatches(buf), aux
