"""The sharded training program: state creation and one jitted, donated step.

Everything here is a pure function of (params, optimizer state, batch); the
model is rebuilt from its graphdef inside the trace, so Orbax, Optax and the
sharding rules all see plain nested dicts of arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import models, sharding
from jaxtrain.config import Config
from jaxtrain.faults import FAULT_NONE, FAULT_NONFINITE, FAULT_SPIKE
from jaxtrain.models.moe import update_router_bias
from jaxtrain.optimizer import learning_rate_schedule, make_optimizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BATCH_AXES = ("batch", "seq")


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: dict  # nested dict of arrays (fp32 master weights)
    opt_state: Any  # optax state mirroring params
    loss_window: jax.Array  # f32[faults.spike_window]: last good losses, oldest first; NaN = empty


def judge_step(loss, grad_norm, window, *, skip_nonfinite: bool, spike_factor: float | None):
    """(apply the update?, fault code, next loss window) for one step, on device.

    A step is a fault when its loss or gradient norm is not finite, or when its
    loss exceeds ``spike_factor`` x the median of the last good losses (judged
    only once the window is full). Faulty steps do not enter the window. Run
    inside the step, before the update is applied, so a spike never reaches the
    weights; and the window is part of the train state, so a resumed or
    rolled-back run judges exactly as an uninterrupted one.
    """
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spike = jnp.zeros((), bool)
    if spike_factor is not None:
        full = jnp.all(jnp.isfinite(window))
        spike = finite & full & (loss > spike_factor * jnp.median(window))
    good = finite & ~spike
    fault = jnp.where(~finite, FAULT_NONFINITE, jnp.where(spike, FAULT_SPIKE, FAULT_NONE))
    apply = good if skip_nonfinite else ~spike
    window = jnp.where(good, jnp.concatenate([window[1:], loss[None].astype(window.dtype)]), window)
    return apply, fault.astype(jnp.int32), window


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """What the loop (and `jaxtrain compile`) needs: shardings and jitted functions."""

    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # ShapeDtypeStructs with Variable metadata
    param_axes: dict  # logical axes per parameter
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[], TrainState]  # jitted; creates the state already sharded
    step: Callable  # jitted (state, batch) -> (state, metrics); state donated
    loss_and_grads: Callable  # jitted (params, batch) -> (loss, tokens, grads); for tests/tools
    optimizer: optax.GradientTransformation


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token losses, number of counted tokens), both f32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch m = rows m, m+n, m+2n, ... so that
    every data-parallel shard contributes equally to every microbatch."""

    def split(x):
        return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def build_program(cfg: Config, mesh: Mesh, rules: sharding.AxisRules) -> TrainProgram:
    mcfg = cfg.model
    make_model = lambda: models.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, abstract_params = models.abstract_model(make_model)
    param_axes = models.logical_axes(abstract_params)
    param_shapes = nnx.to_pure_dict(abstract_params)
    param_shardings = sharding.tree_shardings(param_axes, rules, mesh, shapes=param_shapes)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps, param_axes=param_axes)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)

    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, param_shapes)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    state_shardings = TrainState(
        step=replicated, params=param_shardings, opt_state=opt_shardings, loss_window=replicated
    )
    batch_sharding = sharding.named_sharding(BATCH_AXES, rules, mesh)

    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(make_model(), nnx.Param))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            loss_window=jnp.full((cfg.faults.spike_window,), jnp.nan, jnp.float32),
        )

    def micro_loss_and_grads(params, micro):
        """(CE sum, token count, gradients of the objective, MoE stats). The objective is
        the CE sum, plus for MoE models count * (weighted router losses), so that
        after the division by the total count the router losses enter as their
        token-weighted mean over microbatches."""

        def loss_sum(p):
            model = models.merge(graphdef, abstract_params, p)
            if mcfg.moe is None:
                logits = model(
                    micro["inputs"], positions=micro["positions"], segment_ids=micro["segment_ids"]
                )
                total, count = cross_entropy(logits, micro["targets"], micro["loss_mask"])
                return total, (total, count, {})
            logits, stats = model(
                micro["inputs"],
                positions=micro["positions"],
                segment_ids=micro["segment_ids"],
                return_aux=True,
            )
            total, count = cross_entropy(logits, micro["targets"], micro["loss_mask"])
            router = (
                mcfg.moe.aux_loss_weight * stats["moe_aux_loss"]
                + mcfg.moe.z_loss_weight * stats["moe_z_loss"]
            )
            return total + count * router, (total, count, stats)

        (_, (total, count, stats)), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
        return total, count, grads, stats

    def loss_grads_and_stats(params, batch):
        """Mean loss over counted tokens, their number, and the mean-loss gradients,
        accumulated over `train.microbatches` (sums first, one division at the end,
        so the result does not depend on how the batch is split); plus MoE stats
        (mean over microbatches; {} for dense models)."""
        n = cfg.train.microbatches
        if n == 1:
            total, count, grads, stats = micro_loss_and_grads(params, batch)
        else:

            def accumulate(carry, micro):
                micro = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), micro)
                total, count, grads, stats = micro_loss_and_grads(params, micro)
                acc_total, acc_count, acc_grads, acc_stats = carry
                return (
                    acc_total + total,
                    acc_count + count,
                    jax.tree.map(jnp.add, acc_grads, grads),
                    jax.tree.map(lambda a, s: a + s / n, acc_stats, stats),
                ), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            zero_stats = (
                {}
                if mcfg.moe is None
                else jax.tree.map(
                    lambda s: jnp.zeros(s.shape, s.dtype),
                    jax.eval_shape(
                        lambda: micro_loss_and_grads(params, jax.tree.map(lambda x: x[::n], batch))[3]
                    ),
                )
            )
            init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros, zero_stats)
            (total, count, grads, stats), _ = jax.lax.scan(accumulate, init, split_microbatches(batch, n))
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        return total / denom, count, grads, stats

    def loss_and_grads(params, batch):
        return loss_grads_and_stats(params, batch)[:3]

    def step(state: TrainState, batch: dict):
        loss, count, grads, moe_stats = loss_grads_and_stats(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if mcfg.moe is not None and mcfg.moe.score_bias:
            params = update_router_bias(params, moe_stats["moe_expert_load"], mcfg.moe.score_bias_rate)
        # A faulty step (non-finite, or a loss spike) leaves params and optimizer state
        # exactly as they were (a select, so nothing leaves the device); the step
        # counter still advances because the batch was consumed. The loop counts these.
        apply, fault, window = judge_step(
            loss,
            grad_norm,
            state.loss_window,
            skip_nonfinite=cfg.faults.skip_nonfinite,
            spike_factor=cfg.faults.spike_factor,
        )
        if cfg.faults.skip_nonfinite or cfg.faults.spike_factor is not None:
            params, opt_state = jax.tree.map(
                lambda new, old: jnp.where(apply, new, old),
                (params, opt_state),
                (state.params, state.opt_state),
            )
        skipped = (~apply).astype(jnp.int32)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": count,
            "skipped": skipped,
            "fault": fault,
        }
        metrics.update({k: v for k, v in moe_stats.items() if k != "moe_expert_load"})
        return TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, loss_window=window
        ), metrics

    return TrainProgram(
        graphdef=graphdef,
        abstract_params=abstract_params,
        param_axes=param_axes,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ),
        loss_and_grads=jax.jit(
            loss_and_grads,
            in_shardings=(param_shardings, batch_sharding),
            out_shardings=(replicated, replicated, param_shardings),
        ),
        optimizer=tx,
    )


def batch_to_device(batch: dict, batch_sharding: NamedSharding) -> dict:
    """This process's numpy rows -> global jax.Arrays sharded on the batch axes."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, batch[k]) for k in BATCH_KEYS}


def abstract_batch(cfg: Config, batch_sharding: NamedSharding) -> dict:
    """ShapeDtypeStructs of one global batch (for AOT compiles)."""
    shape = (cfg.train.global_batch_size, cfg.train.seq_len)
    dtypes = {"loss_mask": jnp.float32}
    return {
        k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=batch_sharding) for k in BATCH_KEYS
    }
