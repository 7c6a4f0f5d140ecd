"""One training step, as pure functions of (train state, batch): the forward pass and loss,
the gradients over microbatches, the optimizer update, the fault guard and the metrics.

`train_step` reads top to bottom as the step runs; each part is a top-level function of
the `StepSpec` (what the step closes over, built once by trainer/program.py) and plain
pytrees, so it can be read, tested and jitted on its own. The model is rebuilt from its
graphdef inside the trace, so Orbax, Optax and the sharding rules all see plain nested
dicts of arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain import models, sharding
from jaxtrain.config import Config
from jaxtrain.models import logit_stats, lora
from jaxtrain.models.fp8 import combine as fp8_combine
from jaxtrain.models.moe import update_router_bias
from jaxtrain.recovery.faults import FAULT_NONE, FAULT_NONFINITE, FAULT_SPIKE
from jaxtrain.trainer import dpo, grpo, qk_clip
from jaxtrain.trainer.batches import rows_axes
from jaxtrain.trainer.loss import chunked_cross_entropy, cross_entropy
from jaxtrain.trainer.mtp import mtp_loss, with_prediction_stats
from jaxtrain.trainer.precision import overflowed, update_loss_scale


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: dict  # nested dict of arrays (fp32 master weights)
    opt_state: Any  # optax state mirroring params
    loss_window: jax.Array  # f32[faults.spike_window]: last good losses, oldest first; NaN = empty
    # float16 compute: the dynamic loss scale (trainer/precision.py); None otherwise
    loss_scale: dict | None = None
    # model.fp8: delayed-scaling state of every fp8 matmul (models/fp8.py); None otherwise
    fp8: dict | None = None
    # model.lora: the frozen base (`params` then holds the adapters alone, which are all that
    # is differentiated and optimized); never checkpointed: train.init_from gives it again
    frozen: dict | None = None
    # train.objective=dpo without model.lora: the frozen reference parameters, a copy of the
    # initial ones (trainer/dpo.py); None otherwise
    reference: dict | None = None


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where the step finds the state `optimizer.offload` / `offload_params` keep in host
    memory, and how it brings it to the device and sends the new values back
    (trainer/program.py `offload_moves`). With neither set, every method is the identity."""

    params: bool
    opt_state: bool
    param_shardings: Any
    opt_shardings: Any
    to_device: Callable
    to_host: Callable

    def fetch(self, state: TrainState) -> tuple[dict, Any]:
        """(params, optimizer state) on the device."""
        params = self.to_device(state.params, self.param_shardings) if self.params else state.params
        opt = self.to_device(state.opt_state, self.opt_shardings) if self.opt_state else state.opt_state
        return params, opt

    def store(self, params: dict, opt_state: Any) -> tuple[dict, Any]:
        """The new (params, optimizer state) where the train state keeps them."""
        return (self.to_host(params) if self.params else params), (
            self.to_host(opt_state) if self.opt_state else opt_state
        )


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the step's functions close over (static: none of it is traced)."""

    cfg: Config  # resolved (planning/resolve.py): no `auto` left
    graphdef: nnx.GraphDef
    abstract_params: nnx.State
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule  # the learning rate by step (for the metrics)
    pipeline: sharding.PipelineSchedule | None  # mesh.stage > 1
    offload: Offload

    @property
    def guarded(self) -> bool:
        """Whether an update can be held back (faults.* or loss scaling)."""
        f = self.cfg.faults
        return f.skip_nonfinite or f.spike_factor is not None or self.loss_scaling

    @property
    def qk_clip(self) -> bool:
        """Whether the forward records attention logits for QK-clip (optimizer.qk_clip.tau)."""
        return self.cfg.optimizer.qk_clip.tau is not None

    @property
    def loss_scaling(self) -> bool:
        return self.cfg.model.compute_dtype == "float16"

    def reference(self, state: TrainState, params: dict) -> dict | None:
        """The DPO reference parameters on the device (trainer/dpo.py `reference_params`), or
        None for the LM objective."""
        if not dpo.uses_reference(self.cfg):
            return None
        if self.offload.params and state.reference is not None:  # kept where the params are
            moved = self.offload.to_device(state.reference, self.offload.param_shardings)
            state = state._replace(reference=moved)
        return dpo.reference_params(state, params)

    @property
    def packs_documents(self) -> bool:
        """Whether a batch row may hold several documents or padding. Synthetic rows never do
        (their segment_ids are all 1), so the model gets no segment_ids: the attention
        kernels then skip the segment mask, and cuDNN's needs no run-time check."""
        return self.cfg.data.source != "synthetic"


#: Metrics summed over microbatches (the others are means over them): DPO's sums over pairs
#: (divided by the counted pairs at the end), GRPO's token means already weighted.
SUMMED_METRICS = (*dpo.METRICS, *grpo.METRICS)


class Gradients(NamedTuple):
    """The step's gradients and what came with them."""

    loss: jax.Array  # mean cross-entropy over the counted tokens (dpo: mean loss over the pairs)
    tokens: jax.Array  # counted tokens (f32; dpo: counted pairs)
    grads: dict  # of the mean objective, in the parameters' dtype
    # router losses and load, mean over microbatches ({} for dense models); model.mtp: also
    # mtp_loss, its mean over microbatches; dpo: also the dpo/* metrics, means over the
    # counted pairs
    moe_stats: dict
    fp8: dict | None  # the next fp8 state (None without model.fp8)


# --- the forward pass and the loss ------------------------------------------------------------


def model_loss(
    model, micro: dict, fp8: dict | None, spec: StepSpec, dropout_key=None, *, predict_ahead: bool = False
) -> tuple[jax.Array, jax.Array, dict]:
    """(CE sum, counted tokens, aux) of `model` on one (micro)batch. With `train.loss_chunk`
    > 0 the loss runs over that many positions at a time and the full logits are never
    formed (trainer/loss.py); 0, the plain loss over them. `spec.pipeline`: the layer
    stacks' pipeline schedule (mesh.stage > 1), else None. `dropout_key`: model.lora's
    adapter dropout on (`lora_dropout_key`), None: off. `predict_ahead` (model.mtp set):
    also the multi-token prediction loss, `aux["mtp_loss"]` (trainer/mtp.py)."""
    chunk, pipeline = spec.cfg.train.loss_chunk, spec.pipeline
    if pipeline is not None and pipeline.backward_inside:
        return _pipelined_model_loss(model, micro, spec)
    segment_ids = micro["segment_ids"] if spec.packs_documents else None
    predict_ahead = predict_ahead and model.cfg.mtp is not None
    # The named scopes label the ops in a profile (profile.steps): the backward pass shows
    # as transpose(jvp(forward)) and transpose(jvp(loss)).
    recording = logit_stats.recording() if spec.qk_clip else contextlib.nullcontext()
    with jax.named_scope("forward"), recording:
        x, aux = model.hidden(
            micro["inputs"],
            positions=micro["positions"],
            segment_ids=segment_ids,
            fp8=fp8,
            pipeline=pipeline,
            lora_key=dropout_key,
            normed=not predict_ahead,
        )
    if predict_ahead:  # the prediction modules start from the residual before the final norm
        residual, x = x, model.final_norm(x)
        with jax.named_scope("mtp"):
            mean_loss, stats = mtp_loss(model, residual, micro, segment_ids=segment_ids, chunk=chunk)
        moe = model.cfg.moe
        aux = with_prediction_stats(aux, stats, 0 if moe is None else moe.num_moe_layers(model.cfg))
        aux["mtp_loss"] = mean_loss
    with jax.named_scope("loss"):
        if chunk:
            total, count = chunked_cross_entropy(
                x, model.head(), micro["targets"], micro["loss_mask"], chunk=chunk
            )
        else:
            total, count = cross_entropy(model.project(x), micro["targets"], micro["loss_mask"])
    return total, count, aux


def _pipelined_model_loss(model, micro: dict, spec: StepSpec) -> tuple[jax.Array, jax.Array, dict]:
    """model_loss for a pipeline schedule whose backward runs inside the pipeline (1f1b,
    interleaved_1f1b, zero_bubble): the loss of each microbatch is formed at the last stage,
    in the schedule's tick loop (models/transformer.py `pipelined_loss`)."""
    chunk = spec.cfg.train.loss_chunk

    def loss(x, head, rows):
        targets, mask = rows
        if chunk:
            return chunked_cross_entropy(x, head, targets, mask, chunk=chunk)[0]
        return cross_entropy(model.project(x, head), targets, mask)[0]

    count = jnp.sum(micro["loss_mask"].astype(jnp.float32))
    moe = spec.cfg.model.moe
    # MoE: the router losses' weights in `objective` (count x weight x their means), whose
    # gradients the pipeline takes inside each stage's backward; `objective` then adds them
    # as constants
    router_weights = None if moe is None else (count * moe.aux_loss_weight, count * moe.z_loss_weight)
    with jax.named_scope("pipeline"):
        out = model.pipelined_loss(
            micro["inputs"],
            loss,
            (micro["targets"], micro["loss_mask"]),
            pipeline=spec.pipeline,
            positions=micro["positions"],
            segment_ids=micro["segment_ids"] if spec.packs_documents else None,
            router_weights=router_weights,
        )
    total, stats = (out, {}) if moe is None else out
    return total, count, stats


def whole_params(params: dict, frozen: dict | None) -> dict:
    """The model's whole parameter tree: `params` itself, or with model.lora the adapters
    joined to the frozen base (models/lora.py)."""
    return params if frozen is None else lora.join(frozen, params)


def lora_dropout_key(spec: StepSpec, step) -> jax.Array | None:
    """The key of this step's adapter dropout (model.lora.dropout > 0), a function of the seed
    and the step alone, so a resumed run drops exactly what an uninterrupted one does."""
    m = spec.cfg.model
    if m.lora is None or not m.lora.dropout:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(spec.cfg.seed), 0x10A), step)


def objective(
    spec: StepSpec, params: dict, micro: dict, fp8: dict | None, scale, dropout_key=None, ref_logps=None
):
    """(what the backward pass differentiates, (loss sum, count, stats)). The objective is
    the CE sum over the counted tokens (train.objective=dpo: the DPO loss sum over the counted
    pairs, against the reference log-probabilities `ref_logps`; trainer/dpo.py), plus for MoE
    models count x (weighted router losses) and with model.mtp count x (weighted multi-token
    prediction loss), so that after the division by the batch's count these enter as their
    count-weighted means over microbatches (train.objective=grpo, whose objective is already
    the batch's mean loss and is not divided: the weighted router losses / the microbatches,
    TRL's rule); times `scale` under loss scaling. `dropout_key`:
    model.lora's adapter dropout, or None."""
    model = models.merge(spec.graphdef, spec.abstract_params, params)
    if grpo.is_grpo(spec.cfg):
        total, count, stats = grpo.completion_loss(spec, model, micro, fp8, ref_logps, dropout_key)
    elif ref_logps is not None:
        total, count, stats = dpo.pair_loss(spec, model, micro, fp8, ref_logps, dropout_key)
    else:
        total, count, stats = model_loss(model, micro, fp8, spec, dropout_key, predict_ahead=True)
    value = total
    moe, mtp = spec.cfg.model.moe, spec.cfg.model.mtp
    if moe is not None:
        router = moe.aux_loss_weight * stats["moe_aux_loss"] + moe.z_loss_weight * stats["moe_z_loss"]
        # grpo: `total` is already this microbatch's part of the batch's mean loss, and TRL adds
        # the weighted router losses of each microbatch / the accumulation steps beside it
        grpo_run = grpo.is_grpo(spec.cfg)
        value = total + (router / spec.cfg.train.microbatches if grpo_run else count * router)
    else:
        stats = {k: v for k, v in stats.items() if k in SUMMED_METRICS or k in ("mtp_loss", logit_stats.KEY)}
    if "mtp_loss" in stats:
        value = value + count * mtp.loss_weight * stats["mtp_loss"]
    return (value if scale is None else value * scale), (total, count, stats)


# --- gradients over microbatches ------------------------------------------------------------


def micro_gradients(
    spec: StepSpec,
    params: dict,
    micro: dict,
    scale=None,
    fp8: dict | None = None,
    frozen: dict | None = None,
    dropout_key=None,
    reference=None,
):
    """(CE sum, token count, gradients of the objective, MoE stats, next fp8 state) of one
    microbatch. `fp8`: the state the matmuls quantize with; its "gradient" is its next
    value (models/fp8.py), so it is differentiated alongside the parameters. `frozen`:
    model.lora's base, joined to `params` (the adapters) but not differentiated: no
    gradient of a base weight is formed. `dropout_key`: the adapters' dropout, or None.
    `reference` (train.objective=dpo): the reference parameters, whose log-probabilities are
    computed first, outside the differentiated function."""
    ref_logps = None
    if reference is not None:
        ref_of = grpo.reference_logps if grpo.is_grpo(spec.cfg) else dpo.reference_logps
        ref_logps = ref_of(spec, reference, micro, fp8)
    loss = lambda p, meta: objective(
        spec, whole_params(p, frozen), micro, meta, scale, dropout_key, ref_logps
    )
    if fp8 is None:
        (_, (total, count, stats)), grads = jax.value_and_grad(loss, has_aux=True)(params, None)
        return total, count, grads, stats, None
    (_, (total, count, stats)), (grads, new_fp8) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        params, fp8
    )
    return total, count, grads, stats, new_fp8


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch m = rows m, m+n, m+2n, ... so that
    every data-parallel shard contributes equally to every microbatch."""

    def split(x):
        return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def _accumulated(
    spec: StepSpec,
    params: dict,
    batch: dict,
    scale,
    fp8: dict | None,
    frozen=None,
    dropout_key=None,
    reference=None,
):
    """micro_gradients summed over `train.microbatches` slices in a scan (stats averaged,
    the dpo/* metric sums summed, fp8 next states combined by max: models/fp8.py `combine`;
    the dropout key folded with the microbatch's index)."""
    n = spec.cfg.train.microbatches

    def add(carry, xs):
        micro, i = xs
        micro = jax.tree.map(lambda x: sharding.constrain(x, rows_axes(x)), micro)
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
        total, count, grads, stats, new_fp8 = micro_gradients(
            spec, params, micro, scale, fp8, frozen, key, reference
        )
        acc_total, acc_count, acc_grads, acc_stats, acc_fp8 = carry
        return (
            acc_total + total,
            acc_count + count,
            jax.tree.map(jnp.add, acc_grads, grads),
            {k: _accumulate_stat(k, acc_stats[k], s, n) for k, s in stats.items()},
            None if fp8 is None else fp8_combine(acc_fp8, new_fp8),
        ), None

    one_micro = jax.tree.map(lambda x: x[::n], batch)
    stats_shape = jax.eval_shape(
        lambda: micro_gradients(spec, params, one_micro, frozen=frozen, reference=reference)[3]
    )
    zero = jnp.zeros((), jnp.float32)
    stats_init = {
        k: jax.tree.map(lambda s, k=k: jnp.full(s.shape, -jnp.inf if k == logit_stats.KEY else 0, s.dtype), v)
        for k, v in stats_shape.items()
    }
    init = (
        zero,
        zero,
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        stats_init,
        None if fp8 is None else jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), fp8),
    )
    return jax.lax.scan(add, init, (split_microbatches(batch, n), jnp.arange(n)))[0]


def _accumulate_stat(key: str, acc, value, n: int):
    """One statistic over microbatches: dpo/* and grpo/* sums summed, the attention logits' maxima
    (logit_stats, QK-clip) the largest, the rest (router losses and load) averaged."""
    if key == logit_stats.KEY:
        return jax.tree.map(jnp.maximum, acc, value)
    return acc + (value if key in SUMMED_METRICS else value / n)


def batch_gradients(
    spec: StepSpec,
    params: dict,
    batch: dict,
    scale=None,
    fp8: dict | None = None,
    frozen: dict | None = None,
    dropout_key=None,
    reference=None,
) -> Gradients:
    """Mean loss over the counted tokens (dpo: pairs), their number and the mean-loss
    gradients, accumulated over `train.microbatches` (sums first, one division at the end,
    so the result does not depend on how the batch is split). `scale`: the loss scale the
    backward pass runs at; the gradients come back unscaled. `frozen`, `dropout_key`:
    model.lora's base and adapter dropout (`micro_gradients`); `reference`: the DPO
    reference parameters (train.objective=dpo), else None."""
    per_unit = None
    normalised = grpo.is_grpo(spec.cfg)  # grpo: the objective is already the batch's mean loss
    if scale is not None and normalised:
        per_unit = scale
    elif scale is not None:  # the objective is a sum over tokens (pairs): scale / their number
        counted = (
            jnp.sum(batch["loss_mask"].astype(jnp.float32))
            if reference is None
            else jnp.sum(dpo.counted_pairs(batch["loss_mask"]).astype(jnp.float32))
        )
        per_unit = scale / jnp.maximum(counted, 1.0)
    args = (spec, params, batch, per_unit, fp8, frozen, dropout_key, reference)
    if spec.cfg.train.microbatches == 1:
        total, count, grads, stats, new_fp8 = micro_gradients(*args)
    else:
        total, count, grads, stats, new_fp8 = _accumulated(*args)
    denom = jnp.maximum(count, 1.0)
    loss_denom = 1.0 if normalised else denom
    grad_denom = loss_denom if scale is None else scale
    grads = jax.tree.map(lambda g, p: (g / grad_denom).astype(p.dtype), grads, params)
    stats = {k: v / denom if k in dpo.METRICS else v for k, v in stats.items()}
    return Gradients(total / loss_denom, count, grads, stats, new_fp8)


# --- the update and its guard -----------------------------------------------------------------


def optimizer_update(spec: StepSpec, params: dict, opt_state, g: Gradients) -> tuple[dict, Any]:
    """Optax's update of the parameters (and, with moe.score_bias, the routers' selection
    bias, which no gradient trains: the main layers' by their load, the multi-token prediction
    blocks' (model.mtp) by theirs)."""
    updates, opt_state = spec.optimizer.update(g.grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if spec.qk_clip:  # after the update, by the logits of this step's forward pass
        params = qk_clip.clip(
            params, g.moe_stats[logit_stats.KEY], spec.cfg.optimizer.qk_clip.tau, spec.cfg.model
        )
    moe = spec.cfg.model.moe
    if moe is not None and moe.score_bias:
        main = {k: v for k, v in params.items() if k != "mtp"}
        params = {**params, **update_router_bias(main, g.moe_stats["moe_expert_load"], moe.score_bias_rate)}
        if "mtp" in params:
            load = g.moe_stats["moe_mtp_expert_load"]
            params["mtp"] = update_router_bias(params["mtp"], load, moe.score_bias_rate)
    return params, opt_state


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


class Verdict(NamedTuple):
    """Whether the step's update goes in, and the state that records why."""

    update: jax.Array  # bool: apply this step's update
    skipped: jax.Array  # int32: skipped by the fault policy (faults.*)
    fault: jax.Array  # int32: recovery/faults.py FAULT_* code
    window: jax.Array  # the next loss window
    loss_scale: dict | None  # the next loss-scale state (float16), else None
    scale_skipped: jax.Array  # bool: skipped for a loss-scale overflow alone


def guard(spec: StepSpec, state: TrainState, loss, grad_norm) -> Verdict:
    """The fault policy and the loss scaler's verdict on this step. Overflowing gradients
    at a scale above the minimum are the scaler's (update skipped, scale lowered), and the
    fault judge then sees a finite step, so the fault monitor neither counts it nor rolls
    back for it. A faulty step (non-finite, or a loss spike) leaves params and optimizer
    state exactly as they were; the step counter still advances because the batch was
    consumed."""
    f, ls = spec.cfg.faults, spec.cfg.optimizer.loss_scale
    overflow = jnp.zeros((), bool)
    if spec.loss_scaling:
        overflow = overflowed(loss, grad_norm, state.loss_scale["scale"], ls)
    apply, fault, window = judge_step(
        loss,
        jnp.where(overflow, 0.0, grad_norm),
        state.loss_window,
        skip_nonfinite=f.skip_nonfinite,
        spike_factor=f.spike_factor,
    )
    window = jnp.where(overflow, state.loss_window, window)  # no update: not a good step
    update = apply & ~overflow
    scale_skipped = overflow & apply  # skipped for the overflow alone
    loss_scale = None
    if spec.loss_scaling:
        loss_scale = update_loss_scale(state.loss_scale, overflow, update, scale_skipped, ls)
    return Verdict(update, (~apply).astype(jnp.int32), fault, window, loss_scale, scale_skipped)


def step_metrics(spec: StepSpec, state: TrainState, g: Gradients, grad_norm, verdict: Verdict) -> dict:
    """The step's replicated scalars (the loop fetches them at logging steps)."""
    metrics = {
        "loss": g.loss,
        "grad_norm": grad_norm,
        "lr": spec.schedule(state.step),
        "tokens": g.tokens,
        "skipped": verdict.skipped,
        "fault": verdict.fault,
    }
    metrics.update(
        {k: v for k, v in g.moe_stats.items() if not k.endswith("expert_load") and k != logit_stats.KEY}
    )
    if logit_stats.KEY in g.moe_stats:  # QK-clip: the largest logit over layers and heads
        metrics["attention/max_logit"] = jnp.max(
            jnp.stack([jnp.max(v) for v in jax.tree.leaves(g.moe_stats[logit_stats.KEY])])
        )
    if spec.loss_scaling:
        metrics["loss_scale"] = state.loss_scale["scale"]  # the scale this step's backward ran at
        metrics["loss_scale_skipped"] = verdict.scale_skipped.astype(jnp.int32)
        metrics["loss_scale_overflows"] = verdict.loss_scale["overflows"]  # running total
    return metrics


# --- the step -------------------------------------------------------------------------------


def train_step(spec: StepSpec, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """(next state, metrics): gradients, optimizer update, the guard's verdict, metrics."""
    params, opt_state = spec.offload.fetch(state)  # offloaded state comes to the device
    scale = state.loss_scale["scale"] if spec.loss_scaling else None
    g = batch_gradients(
        spec,
        params,
        batch,
        scale,
        state.fp8,
        state.frozen,
        lora_dropout_key(spec, state.step),
        spec.reference(state, params),
    )
    with jax.named_scope("optimizer"):
        grad_norm = optax.tree.norm(g.grads)
        new_params, new_opt = optimizer_update(spec, params, opt_state, g)
        verdict = guard(spec, state, g.loss, grad_norm)
    new_fp8 = g.fp8
    if spec.guarded:  # a select, so nothing leaves the device
        new_params, new_opt, new_fp8 = jax.tree.map(
            lambda new, old: jnp.where(verdict.update, new, old),
            (new_params, new_opt, new_fp8),
            (params, opt_state, state.fp8),
        )
    new_params, new_opt = spec.offload.store(new_params, new_opt)
    next_state = TrainState(
        step=state.step + 1,
        params=new_params,
        opt_state=new_opt,
        loss_window=verdict.window,
        loss_scale=verdict.loss_scale,
        fp8=new_fp8,
        frozen=state.frozen,
        reference=state.reference,  # frozen: passed through as it came
    )
    return next_state, step_metrics(spec, state, g, grad_norm, verdict)


def loss_and_grads(spec: StepSpec, params: dict, batch: dict):
    """(mean loss, counted tokens, gradients) without the update (tests and tools; model.fp8:
    without fp8, which has no state here; train.objective=dpo: at the reference point, the
    reference being `params` themselves). `params`: the whole tree; with model.lora the
    gradients are the adapters' alone."""
    reference = params if dpo.uses_reference(spec.cfg) else None
    if spec.cfg.model.lora is None:
        return batch_gradients(spec, params, batch, reference=reference)[:3]
    base, adapters = lora.split(params)
    return batch_gradients(spec, adapters, batch, frozen=base, reference=reference)[:3]


def eval_sums(spec: StepSpec, state: TrainState, batch: dict):
    """(sum of masked next-token losses, counted tokens) over `batch`: the step's forward
    without gradients or MoE router losses, over `train.microbatches` slices as the step
    takes them (so its peak memory stays below the step's); model.fp8: quantized with the
    state's fp8 scales, which it leaves as they are. Nothing is donated."""
    params, _ = dataclasses.replace(spec.offload, opt_state=False).fetch(state)
    model = models.merge(spec.graphdef, spec.abstract_params, whole_params(params, state.frozen))
    sums = lambda micro: model_loss(model, micro, state.fp8, spec)[:2]
    n = spec.cfg.train.microbatches
    if n == 1:
        return sums(batch)

    def add(carry, micro):
        total, count = sums(jax.tree.map(lambda x: sharding.constrain(x, rows_axes(x)), micro))
        return (carry[0] + total, carry[1] + count), None

    zero = jnp.zeros((), jnp.float32)
    return jax.lax.scan(add, (zero, zero), split_microbatches(batch, n))[0]
