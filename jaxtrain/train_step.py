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

from jaxtrain import loss_chunk, models, sharding
from jaxtrain.chunked_loss import chunked_cross_entropy
from jaxtrain.config import Config, ConfigError, LossScaleConfig
from jaxtrain.faults import FAULT_NONE, FAULT_NONFINITE, FAULT_SPIKE
from jaxtrain.models.fp8 import combine as fp8_combine
from jaxtrain.models.fp8 import model_meta as fp8_model_meta
from jaxtrain.models.moe import update_router_bias
from jaxtrain.optimizer import learning_rate_schedule, make_optimizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BATCH_AXES = ("batch", "seq")


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: dict  # nested dict of arrays (fp32 master weights)
    opt_state: Any  # optax state mirroring params
    loss_window: jax.Array  # f32[faults.spike_window]: last good losses, oldest first; NaN = empty
    # float16 compute: the dynamic loss scale (`init_loss_scale`); None otherwise
    loss_scale: dict | None = None
    # model.fp8: delayed-scaling state of every fp8 matmul (models/fp8.py); None otherwise
    fp8: dict | None = None


MAX_LOSS_SCALE = 2.0**24  # growth stops here (or at the initial scale, if higher)


def init_loss_scale(cfg: LossScaleConfig) -> dict:
    """Dynamic loss scaling state: the scale, clean steps since the last change, and the
    steps skipped because the scaled gradients overflowed (a running total)."""
    return {
        "scale": jnp.asarray(cfg.init, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),
        "overflows": jnp.zeros((), jnp.int32),
    }


def update_loss_scale(state: dict, overflow, clean, skipped, cfg: LossScaleConfig) -> dict:
    """The next loss-scale state. `overflow`: the gradients overflowed at this scale (back
    off, restart the clean count); `clean`: a step that updated normally (count towards
    growth); `skipped`: the step was skipped for the overflow alone (the running total)."""
    good_steps = jnp.where(overflow, 0, state["good_steps"] + clean.astype(jnp.int32))
    grow = good_steps >= cfg.growth_interval
    scale = state["scale"]
    scale = jnp.where(
        overflow,
        jnp.maximum(scale * cfg.backoff_factor, cfg.min_scale),
        jnp.where(grow, jnp.minimum(scale * cfg.growth_factor, max(MAX_LOSS_SCALE, cfg.init)), scale),
    )
    return {
        "scale": scale.astype(jnp.float32),
        "good_steps": jnp.where(grow, 0, good_steps).astype(jnp.int32),
        "overflows": state["overflows"] + skipped.astype(jnp.int32),
    }


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
    # jitted (state, batch) -> (CE sum, counted tokens), f32; state not donated (`eval.*`)
    eval_step: Callable | None = None


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token losses, number of counted tokens), both f32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def model_loss(
    model, micro: dict, fp8: dict | None, chunk: int, pipeline: sharding.PipelineSchedule | None = None
) -> tuple[jax.Array, jax.Array, dict]:
    """(CE sum, counted tokens, aux) of `model` on one (micro)batch. `chunk`
    (`train.loss_chunk`): > 0, the loss runs over that many positions at a time and the
    full logits are never formed (jaxtrain/chunked_loss.py); 0, the plain loss over them.
    `pipeline`: the layer stacks' pipeline schedule (mesh.stage > 1), else None."""
    x, aux = model.hidden(
        micro["inputs"],
        positions=micro["positions"],
        segment_ids=micro["segment_ids"],
        fp8=fp8,
        pipeline=pipeline,
    )
    if chunk:
        total, count = chunked_cross_entropy(
            x, model.head(), micro["targets"], micro["loss_mask"], chunk=chunk
        )
    else:
        total, count = cross_entropy(model.project(x), micro["targets"], micro["loss_mask"])
    return total, count, aux


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch m = rows m, m+n, m+2n, ... so that
    every data-parallel shard contributes equally to every microbatch."""

    def split(x):
        return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def pipeline_schedule(cfg: Config) -> sharding.PipelineSchedule | None:
    """The model's pipeline schedule for mesh.stage > 1 (the `pipeline` section); None otherwise."""
    stages = cfg.mesh.stage
    if stages <= 1:
        return None
    p = cfg.pipeline
    return sharding.PipelineSchedule(stages, p.resolved_microbatches(stages), p.repeats)


def build_program(cfg: Config, mesh: Mesh, rules: sharding.AxisRules) -> TrainProgram:
    if cfg.model.remat == "auto":  # callers that did not resolve it (jaxtrain train and compile do)
        from jaxtrain.planner import resolve_remat_for_devices

        cfg, _ = resolve_remat_for_devices(cfg, list(mesh.devices.flat))
    cfg = loss_chunk.resolved(cfg, mesh.shape)  # `auto`: by the logits' size per device
    mcfg = cfg.model
    make_model = lambda: models.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
    graphdef, abstract_params = models.abstract_model(make_model)
    param_axes = models.logical_axes(abstract_params)
    param_shapes = nnx.to_pure_dict(abstract_params)
    param_shardings = sharding.tree_shardings(param_axes, rules, mesh, shapes=param_shapes)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps, param_axes=param_axes)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    schedule_pp = pipeline_schedule(cfg)

    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, param_shapes)
    ocfg = cfg.optimizer

    # optimizer.shard_state (ZeRO-1): the moments are laid out as their params and then split
    # over `data` too; XLA reduce-scatters the gradients into them and all-gathers the updates.
    state_layout = param_shardings
    if ocfg.shard_state:
        state_layout = jax.tree.map(
            lambda s, x: NamedSharding(mesh, sharding.shard_further(s.spec, x.shape, mesh, "data")),
            param_shardings,
            param_shapes,
        )

    def opt_state_shardings(memory_kind: str | None):
        """Param-shaped optimizer leaves (Adam's moments) as their params (ZeRO-1: split
        over data as well), in `memory_kind`."""
        return optax.tree_map_params(
            tx,
            lambda _, s: s if memory_kind is None else s.with_memory_kind(memory_kind),
            abstract_opt,
            state_layout,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )

    # optimizer.offload(_params): the train state keeps the moments (master weights) in
    # pinned host memory; the step brings them to the device and its output shardings
    # send the new values back, into the donated host buffers.
    opt_shardings = opt_state_shardings(None)
    to_device, to_host = _offload_moves(mesh, ocfg.offload or ocfg.offload_params)
    # float16 compute: dynamic loss scaling (optimizer.loss_scale), its state in the train state.
    scaling = mcfg.compute_dtype == "float16"
    state_shardings = TrainState(
        step=replicated,
        params=_in_memory(param_shardings, HOST if ocfg.offload_params else None),
        opt_state=opt_state_shardings(HOST) if ocfg.offload else opt_shardings,
        loss_window=replicated,
        loss_scale=jax.tree.map(lambda _: replicated, init_loss_scale(ocfg.loss_scale)) if scaling else None,
        # model.fp8: scales and amax histories, replicated (a few KB per layer)
        fp8=jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: fp8_model_meta(mcfg)))
        if mcfg.fp8
        else None,
    )
    batch_sharding = sharding.named_sharding(BATCH_AXES, rules, mesh)

    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(make_model(), nnx.Param))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            loss_window=jnp.full((cfg.faults.spike_window,), jnp.nan, jnp.float32),
            loss_scale=init_loss_scale(ocfg.loss_scale) if scaling else None,
            fp8=fp8_model_meta(mcfg) if mcfg.fp8 else None,
        )

    def micro_loss_and_grads(params, micro, scale=None, fp8=None):
        """(CE sum, token count, gradients of the objective, MoE stats, next fp8 state). The
        objective is the CE sum, plus for MoE models count * (weighted router losses), so
        that after the division by the total count the router losses enter as their
        token-weighted mean over microbatches. `scale` (loss scaling: the loss scale over
        the batch's token count): the gradients are those of scale x objective. `fp8`: the
        fp8 state the matmuls quantize with; its "gradient" is its next value (models/fp8.py)."""
        scaled = (lambda x: x) if scale is None else (lambda x: x * scale)

        def loss_sum(p, meta):
            model = models.merge(graphdef, abstract_params, p)
            total, count, stats = model_loss(model, micro, meta, cfg.train.loss_chunk, schedule_pp)
            if mcfg.moe is None:
                return scaled(total), (total, count, {})
            router = (
                mcfg.moe.aux_loss_weight * stats["moe_aux_loss"]
                + mcfg.moe.z_loss_weight * stats["moe_z_loss"]
            )
            return scaled(total + count * router), (total, count, stats)

        if fp8 is None:
            (_, (total, count, stats)), grads = jax.value_and_grad(loss_sum, has_aux=True)(params, None)
            return total, count, grads, stats, None
        (_, (total, count, stats)), (grads, new_fp8) = jax.value_and_grad(
            loss_sum, argnums=(0, 1), has_aux=True
        )(params, fp8)
        return total, count, grads, stats, new_fp8

    def loss_grads_and_stats(params, batch, scale=None, fp8=None):
        """Mean loss over counted tokens, their number, and the mean-loss gradients,
        accumulated over `train.microbatches` (sums first, one division at the end,
        so the result does not depend on how the batch is split); plus MoE stats
        (mean over microbatches; {} for dense models). `scale`: the loss scale the
        backward pass ran at, applied to the mean loss as usual (the gradients come back
        unscaled). `fp8`: the fp8 state; its next value is returned last (None without)."""
        n = cfg.train.microbatches
        per_token = None
        if scale is not None:  # the objective is a sum over tokens: scale / their number
            per_token = scale / jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        if n == 1:
            total, count, grads, stats, new_fp8 = micro_loss_and_grads(params, batch, per_token, fp8)
        else:

            def accumulate(carry, micro):
                micro = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), micro)
                total, count, grads, stats, new_fp8 = micro_loss_and_grads(params, micro, per_token, fp8)
                acc_total, acc_count, acc_grads, acc_stats, acc_fp8 = carry
                return (
                    acc_total + total,
                    acc_count + count,
                    jax.tree.map(jnp.add, acc_grads, grads),
                    jax.tree.map(lambda a, s: a + s / n, acc_stats, stats),
                    None if fp8 is None else fp8_combine(acc_fp8, new_fp8),
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
            # fp8: the microbatches' next states combine by max (models/fp8.py `combine`)
            no_fp8 = None if fp8 is None else jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), fp8)
            init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros, zero_stats, no_fp8)
            (total, count, grads, stats, new_fp8), _ = jax.lax.scan(
                accumulate, init, split_microbatches(batch, n)
            )
        denom = jnp.maximum(count, 1.0)
        grad_denom = denom if scale is None else scale
        grads = jax.tree.map(lambda g, p: (g / grad_denom).astype(p.dtype), grads, params)
        return total / denom, count, grads, stats, new_fp8

    def loss_and_grads(params, batch):
        return loss_grads_and_stats(params, batch)[:3]  # model.fp8: without fp8 (no state here)

    def eval_sums(state: TrainState, batch: dict):
        """(sum of masked next-token losses, counted tokens) over `batch`: the step's forward
        without gradients or MoE router losses, over `train.microbatches` slices as the step
        takes them (so its peak memory stays below the step's); model.fp8: quantized with the
        state's fp8 scales, which it leaves as they are. Nothing is donated."""
        params = to_device(state.params, param_shardings) if ocfg.offload_params else state.params
        model = models.merge(graphdef, abstract_params, params)

        def sums(micro):
            return model_loss(model, micro, state.fp8, cfg.train.loss_chunk, schedule_pp)[:2]

        n = cfg.train.microbatches
        if n == 1:
            return sums(batch)

        def accumulate(carry, micro):
            total, count = sums(jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), micro))
            return (carry[0] + total, carry[1] + count), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(accumulate, (zero, zero), split_microbatches(batch, n))
        return total, count

    def step(state: TrainState, batch: dict):
        # Offloaded state comes to the device here (a no-op when it lives there already).
        old_params = to_device(state.params, param_shardings) if ocfg.offload_params else state.params
        old_opt = to_device(state.opt_state, opt_shardings) if ocfg.offload else state.opt_state
        scale = state.loss_scale["scale"] if scaling else None
        loss, count, grads, moe_stats, fp8 = loss_grads_and_stats(old_params, batch, scale, state.fp8)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, old_opt, old_params)
        params = optax.apply_updates(old_params, updates)
        if mcfg.moe is not None and mcfg.moe.score_bias:
            params = update_router_bias(params, moe_stats["moe_expert_load"], mcfg.moe.score_bias_rate)
        # Loss scaling: gradients that overflow (finite loss, non-finite gradients) at a
        # scale above the minimum are the scaler's business, not a numerical fault: the
        # update is skipped and the scale lowered, and the fault judge below sees a
        # finite step (so the fault monitor neither counts it nor rolls back for it).
        overflow = jnp.zeros((), bool)
        if scaling:
            ls_cfg = ocfg.loss_scale
            overflow = jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (scale > ls_cfg.min_scale)
        # A faulty step (non-finite, or a loss spike) leaves params and optimizer state
        # exactly as they were (a select, so nothing leaves the device); the step
        # counter still advances because the batch was consumed. The loop counts these.
        apply, fault, window = judge_step(
            loss,
            jnp.where(overflow, 0.0, grad_norm),
            state.loss_window,
            skip_nonfinite=cfg.faults.skip_nonfinite,
            spike_factor=cfg.faults.spike_factor,
        )
        skipped = (~apply).astype(jnp.int32)  # the fault monitor's (faults.*)
        window = jnp.where(overflow, state.loss_window, window)  # no update: not a good step
        update = apply & ~overflow
        if cfg.faults.skip_nonfinite or cfg.faults.spike_factor is not None or scaling:
            params, opt_state, fp8 = jax.tree.map(
                lambda new, old: jnp.where(update, new, old),
                (params, opt_state, fp8),
                (old_params, old_opt, state.fp8),
            )
        loss_scale = None
        if scaling:
            scale_skipped = overflow & apply  # skipped for the overflow alone
            loss_scale = update_loss_scale(state.loss_scale, overflow, update, scale_skipped, ls_cfg)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": count,
            "skipped": skipped,
            "fault": fault,
        }
        metrics.update({k: v for k, v in moe_stats.items() if k != "moe_expert_load"})
        if scaling:
            metrics["loss_scale"] = scale  # the scale this step's backward pass ran at
            metrics["loss_scale_skipped"] = scale_skipped.astype(jnp.int32)
            metrics["loss_scale_overflows"] = loss_scale["overflows"]  # running total
        return TrainState(
            step=state.step + 1,
            params=to_host(params) if ocfg.offload_params else params,
            opt_state=to_host(opt_state) if ocfg.offload else opt_state,
            loss_window=window,
            loss_scale=loss_scale,
            fp8=fp8,
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
        eval_step=jax.jit(
            eval_sums, in_shardings=(state_shardings, batch_sharding), out_shardings=(replicated, replicated)
        ),
    )


HOST = "pinned_host"  # where optimizer.offload keeps state (a JAX memory kind)


def _offload_moves(mesh: Mesh, offload: bool) -> tuple[Callable, Callable]:
    """(to_device(tree, device_shardings), to_host(tree)): how the step moves offloaded state.

    Where the devices have a `pinned_host` memory kind (TPU, GPU, CPU), the state's
    shardings carry it: the step's input and output shardings place the state, so
    to_device is a device_put to the device shardings and to_host does nothing.
    Compile-only GPU devices (`jaxtrain compile`, XLA's GPU topology) describe no
    memory spaces at all, and jaxlib then drops every memory kind from their shardings
    (`NamedSharding.with_memory_kind("pinned_host").memory_kind is None`); there the
    step moves the state itself with `jax.memory.Space` (XLA's host-offload custom
    calls, as the remat offload policies do), which the compiler honours: the donated
    state is host memory in the compiled program's memory stats. Devices that list
    their memories but no `pinned_host` are a config error.
    """
    keep = lambda tree, *_: tree
    if not offload:
        return keep, keep
    device = mesh.devices.flat[0]
    probe = NamedSharding(mesh, PartitionSpec()).with_memory_kind(HOST)
    if probe.memory_kind == HOST:
        return jax.device_put, keep
    if not device.addressable_memories():  # a compile-only device without memory descriptions
        return (
            lambda tree, *_: jax.device_put(tree, jax.memory.Space.Device),
            lambda tree: jax.device_put(tree, jax.memory.Space.Host),
        )
    raise ConfigError(
        f"optimizer.offload: the devices ({device.device_kind}) have no '{HOST}' memory (JAX memory "
        "kinds), so the optimizer state cannot live on the host; set optimizer.offload=false and "
        "optimizer.offload_params=false"
    )


def _in_memory(shardings, memory_kind: str | None):
    """The same shardings in `memory_kind` (None: unchanged, i.e. device memory)."""
    if memory_kind is None:
        return shardings
    return jax.tree.map(
        lambda s: s.with_memory_kind(memory_kind), shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
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
