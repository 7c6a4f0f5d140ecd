"""Direct preference optimisation (train.objective=dpo): the loss, its metrics and the reference.

A DPO batch holds pairs: every batch field is ``[pairs, 2, seq]``, index 0 the chosen
sequence, 1 the rejected one (jaxtrain/data/preference.py), ``loss_mask`` 1 exactly where the
target is a response token. The model runs on the ``[2 x pairs, seq]`` rows (a reshape that
keeps each pair on the device that holds it), and each sequence's log-probability is the sum
of its response tokens' log-probabilities. With the reference model's log-probabilities of
the same sequences, per pair (TRL's ``sigmoid`` loss, Rafailov et al. 2023; label smoothing
as cDPO):

    z = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
    loss = -(1 - label_smoothing) log sigmoid(beta z) - label_smoothing log sigmoid(-beta z)

and the step minimises the mean over the batch's pairs. The metrics are TRL's, over the same
pairs and before the step's update: ``dpo/chosen_reward`` = mean beta (logp_chosen -
ref_chosen), ``dpo/rejected_reward`` likewise, ``dpo/reward_margin`` = the mean of their
difference, ``dpo/accuracy`` = the fraction of pairs whose chosen reward is strictly larger.

A pair counts when both its sequences have at least one response token (a pair whose
response was cut off entirely by ``train.seq_len`` adds nothing, rather than a constant
ln 2 that would dilute the mean).

The reference. It is the run's initial weights (``train.init_from``, or the seed's random
ones), frozen: a second copy of the parameters in the train state (`TrainState.reference`),
outside the optimizer, never updated, saved with every checkpoint. Its log-probabilities are
computed in the same step, by a forward pass without gradients, rather than precomputed
once over the data: nothing then depends on the data order or on a side file, a resumed run
restores the reference bit for bit from its checkpoint (not from `train.init_from`, which may
have changed or gone since), and the cost is one forward pass per step (about a third of the
step's FLOPs) and one copy of the parameters in device memory (counted by
planning/footprint.py). With ``model.lora`` there is no copy: the base weights are frozen
anyway, so the reference is the same tree run with its adapters skipped
(`models.lora.adapters_disabled`), exactly the initial model. `reference_params` is the one
place that says where the reference comes from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain import models, sharding
from jaxtrain.config import Config
from jaxtrain.models import lora

_F32 = jnp.float32
#: Batch axes of a pair batch `[pairs, 2, seq]` (the pair axis is never split).
PAIR_AXES = ("batch", None, "seq")
#: The metrics the step reports, as sums over the counted pairs (divided by their number
#: after the microbatches are summed: trainer/step.py).
METRICS = ("dpo/chosen_reward", "dpo/rejected_reward", "dpo/reward_margin", "dpo/accuracy")


def is_dpo(cfg: Config) -> bool:
    return cfg.train.objective == "dpo"


def uses_reference(cfg: Config) -> bool:
    """Whether the step needs the frozen reference model: DPO, and GRPO with a KL penalty
    (grpo.beta > 0; trainer/grpo.py)."""
    return is_dpo(cfg) or (cfg.train.objective == "grpo" and cfg.grpo.beta > 0)


def holds_reference_copy(cfg: Config) -> bool:
    """Whether the train state keeps a frozen copy of the initial parameters (module
    docstring): a reference without adapters."""
    return uses_reference(cfg) and cfg.model.lora is None


def reference_params(state, params: dict) -> dict:
    """The reference model's parameters for a step whose policy parameters are `params`:
    the frozen copy in the train state; with model.lora the whole tree (the frozen base and
    the adapters `params`), which `reference_logps` runs with its adapters skipped."""
    if state.reference is not None:
        return state.reference
    return lora.join(state.frozen, params)


def sequence_logps(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """[rows] f32: each row's sum of log p(target) over the positions where `mask` is 1."""
    token_logps = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(_F32), targets)
    return jnp.sum(token_logps * mask.astype(_F32), axis=-1)


def pair_logps(
    model, micro: dict, fp8: dict | None, *, packs_documents: bool, pipeline, lora_key=None
) -> tuple:
    """([pairs, 2] f32 log-probabilities of the chosen and rejected sequences, the model's aux).

    Without a pipeline the rows are pair by pair (chosen, rejected, chosen, ...). A pipeline
    splits its rows into microbatches by stride (row r in microbatch r % M,
    sharding/microbatches.py), which would put every chosen sequence in one microbatch and every
    rejected one in the other; MoE's router losses are means over microbatches, so which rows
    share one changes the loss. There the rows are all chosen sequences, then all rejected ones:
    microbatch m holds both sequences of pairs m, m + M, ..., as train.microbatches splits pairs
    (found by tests/test_pairs.py's dpo-circ-tp-ep row)."""
    pairs, _, seq = micro["inputs"].shape
    side_major = pipeline is not None

    def to_rows(v):
        return (v.swapaxes(0, 1) if side_major else v).reshape(2 * pairs, seq)

    rows = {k: sharding.constrain(to_rows(v), ("batch", "seq")) for k, v in micro.items()}
    with jax.named_scope("forward"):
        x, aux = model.hidden(
            rows["inputs"],
            positions=rows["positions"],
            segment_ids=rows["segment_ids"] if packs_documents else None,
            fp8=fp8,
            pipeline=pipeline,
            lora_key=lora_key,
        )
    with jax.named_scope("loss"):
        logps = sequence_logps(model.project(x), rows["targets"], rows["loss_mask"])
    if side_major:
        return logps.reshape(2, pairs).swapaxes(0, 1), aux
    return logps.reshape(pairs, 2), aux


def counted_pairs(loss_mask: jax.Array) -> jax.Array:
    """[pairs] bool: pairs whose chosen and rejected sequences both have a response token."""
    return jnp.all(jnp.sum(loss_mask.astype(_F32), axis=-1) > 0, axis=-1)


def dpo_sums(logps, ref_logps, counted, *, beta: float, label_smoothing: float) -> tuple:
    """(sum of the pair losses, number of counted pairs, metric sums) over the counted pairs.
    `logps`, `ref_logps`: [pairs, 2] (chosen, rejected); gradients flow through `logps`."""
    w = counted.astype(_F32)
    ratios = logps - jax.lax.stop_gradient(ref_logps)  # [pairs, 2]: log pi / pi_ref
    z = beta * (ratios[:, 0] - ratios[:, 1])
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
    rewards = beta * jax.lax.stop_gradient(ratios)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    sums = {
        "dpo/chosen_reward": jnp.sum(w * chosen),
        "dpo/rejected_reward": jnp.sum(w * rejected),
        "dpo/reward_margin": jnp.sum(w * (chosen - rejected)),
        "dpo/accuracy": jnp.sum(w * (chosen > rejected).astype(_F32)),
    }
    return jnp.sum(w * losses), jnp.sum(w), sums


def reference_logps(spec, reference: dict, micro: dict, fp8: dict | None) -> jax.Array:
    """[pairs, 2] log-probabilities of the micro batch's sequences under the reference model
    (a forward pass outside the differentiated function: no gradients, no residuals kept)."""
    model = models.merge(spec.graphdef, spec.abstract_params, reference)
    with lora.adapters_disabled():  # a LoRA run's reference is its base (no adapters: a no-op)
        logps, _ = pair_logps(model, micro, fp8, packs_documents=spec.packs_documents, pipeline=spec.pipeline)
    return jax.lax.stop_gradient(logps)


def pair_loss(spec, model, micro: dict, fp8: dict | None, ref_logps: jax.Array, dropout_key=None) -> tuple:
    """(sum of the pair losses, counted pairs, aux: the model's aux and the metric sums) of
    `model` (the policy) on one (micro)batch of pairs; `dropout_key`: model.lora's dropout."""
    logps, aux = pair_logps(
        model,
        micro,
        fp8,
        packs_documents=spec.packs_documents,
        pipeline=spec.pipeline,
        lora_key=dropout_key,
    )
    d = spec.cfg.dpo
    total, count, sums = dpo_sums(
        logps,
        ref_logps,
        counted_pairs(micro["loss_mask"]),
        beta=d.beta,
        label_smoothing=d.label_smoothing,
    )
    return total, count, {**aux, **sums}
