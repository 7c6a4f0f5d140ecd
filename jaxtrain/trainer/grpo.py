"""Group relative policy optimisation (train.objective=grpo): advantages, the loss, its metrics.

TRL's definitions (GRPOTrainer, TRL 1.16), as the `grpo` config section names them:

- advantages, per group of `group_size` completions of one prompt: ``A = r - mean(group)``,
  divided by ``std + 1e-4`` where std is the group's (``scale_rewards=group``), the whole
  batch's (``batch``) or not at all (``none``); std with n - 1, as torch computes it;
- per completion token, with ``logp`` the log-probability of ``logits / temperature``:
  ``ratio = exp(logp - old_logp)`` against the policy that sampled the rollout, and
  ``loss = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)``, plus with
  ``beta > 0`` the k3 KL estimate ``beta (exp(ref - logp) - (ref - logp) - 1)`` against the
  frozen initial weights (the plain estimator: no ratio correction);
- aggregation (`loss_type`): grpo, the mean over completions of each one's token mean;
  dapo, the token sum over the global batch divided by its completion tokens; bnpo, each
  microbatch's token sum divided by that microbatch's completion tokens, averaged over the
  ``train.microbatches`` (TRL's "local batch": one process's batch of one accumulation step);
  dr_grpo, the token sum divided by (completions x max_new_tokens);
- MoE models: the router losses beside the policy loss, as TRL adds
  ``router_aux_loss_coef x aux_loss``: each microbatch's weighted router losses divided by
  the microbatches (trainer/step.py `objective`), not scaled by any token count.

Every normaliser but bnpo's is over the whole global batch, so the loss is the same on any
mesh and for any ``train.microbatches`` (bnpo's alone depends on ``train.microbatches``,
never on the mesh): the rollout (trainer/rollout.py) gives each completion token its weight,
``loss_weight`` (the aggregation's factor) and ``token_share`` (1 / the batch's completion
tokens, for the token means of the metrics), and the step sums ``weight x per-token value``
over whatever part of the batch it holds. The batch fields (all ``[batch,
seq]``, `GRPO_KEYS`): ``advantages`` (each row's advantage, repeated along the row),
``old_logps`` and the two weights, besides the LM fields.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import models, sharding
from jaxtrain.config import Config
from jaxtrain.models import lora

_F32 = jnp.float32
#: The float fields a GRPO batch carries besides the LM ones.
GRPO_KEYS = ("advantages", "old_logps", "loss_weight", "token_share")
#: The step's metrics, already token means over the global batch (summed over microbatches).
METRICS = ("grpo/clip_ratio", "grpo/kl")
SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def is_grpo(cfg: Config) -> bool:
    return cfg.train.objective == "grpo"


# --- the host side: advantages and weights --------------------------------------------------


def advantages(rewards, group_size: int, scale_rewards: str) -> np.ndarray:
    """[completions] f32 advantages from the rewards, completions grouped by prompt in
    consecutive runs of `group_size` (TRL: std with n - 1, + 1e-4 in the denominator)."""
    r = np.asarray(rewards, np.float32)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards={scale_rewards!r}: expected one of {', '.join(SCALE_REWARDS)}")
    groups = r.reshape(-1, group_size)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = np.repeat(groups.std(axis=1, ddof=1) if group_size > 1 else np.zeros(len(groups)), group_size)
    else:
        std = np.full_like(r, r.std(ddof=1) if r.size > 1 else 0.0)
    return (centred / (std + np.float32(1e-4))).astype(np.float32)


def reward_std(rewards) -> float:
    """grpo/reward_std as TRL 1.16 logs it (`nanstd(rewards)`): the standard deviation of the
    whole batch's rewards, NaNs left out, with n - 1 as torch's; whatever `scale_rewards`."""
    r = np.asarray(rewards, np.float64)
    r = r[~np.isnan(r)]
    return float(r.std(ddof=1)) if r.size > 1 else float("nan")


def loss_weights(
    mask: np.ndarray, loss_type: str, max_new_tokens: int, microbatches: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(loss_weight, token_share) [completions, seq] f32 for a global batch's completion-token
    `mask` (module docstring). `microbatches`: train.microbatches, which bnpo's normaliser
    follows; each is the rows m, m + n, ... as trainer/step.py `split_microbatches` takes them."""
    mask = np.asarray(mask, np.float32)
    n = mask.shape[0]
    tokens = max(float(mask.sum()), 1.0)
    if loss_type == "grpo":
        per_row = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        weight = mask / (per_row * n)
    elif loss_type == "bnpo":  # each microbatch by its own tokens, then the mean over them
        weight = np.empty_like(mask)
        for m in range(microbatches):
            part = mask[m::microbatches]
            weight[m::microbatches] = part / (max(float(part.sum()), 1.0) * microbatches)
    elif loss_type == "dapo":
        weight = mask / tokens
    elif loss_type == "dr_grpo":
        weight = mask / float(n * max_new_tokens)
    else:
        raise ValueError(f"grpo.loss_type={loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    return weight.astype(np.float32), (mask / tokens).astype(np.float32)


# --- the device side: log-probabilities and the loss ----------------------------------------


def token_logps(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
    """[rows, seq] f32 log p(target) under softmax(logits / temperature)."""
    scaled = logits.astype(_F32) / temperature
    logz = jax.nn.logsumexp(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return picked - logz


def per_token_terms(logps, old_logps, ref_logps, adv, *, epsilon, epsilon_high, beta) -> tuple:
    """(per-token loss, per-token k3 KL or None, clipped-region indicator), all [rows, seq].
    Gradients flow through `logps` alone."""
    old_logps = jax.lax.stop_gradient(old_logps)
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    kl = None
    if beta:
        d = jax.lax.stop_gradient(ref_logps) - logps
        kl = jnp.exp(d) - d - 1.0
        loss = loss + beta * kl
    ratio_now = jax.lax.stop_gradient(ratio)
    region = ((ratio_now < 1.0 - epsilon) & (adv < 0)) | ((ratio_now > 1.0 + epsilon_high) & (adv > 0))
    return loss, kl, region.astype(_F32)


def grpo_sums(logps, micro: dict, ref_logps, g) -> tuple:
    """(weighted loss sum, completion tokens, metric sums) of one (micro)batch; `g`: the
    `grpo` config section."""
    loss, kl, region = per_token_terms(
        logps,
        micro["old_logps"],
        ref_logps,
        micro["advantages"],
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high if g.epsilon_high is not None else g.epsilon,
        beta=g.beta,
    )
    share = micro["token_share"]
    sums = {"grpo/clip_ratio": jnp.sum(share * region)}
    if kl is not None:
        sums["grpo/kl"] = jnp.sum(share * jax.lax.stop_gradient(kl))
    return jnp.sum(micro["loss_weight"] * loss), jnp.sum(micro["loss_mask"].astype(_F32)), sums


def policy_logps(model, micro: dict, fp8, spec, lora_key=None) -> tuple:
    """([rows, seq] log-probs of the targets at grpo.temperature, the model's aux)."""
    with jax.named_scope("forward"):
        x, aux = model.hidden(
            micro["inputs"],
            positions=micro["positions"],
            segment_ids=micro["segment_ids"],
            fp8=fp8,
            pipeline=spec.pipeline,
            lora_key=lora_key,
        )
    with jax.named_scope("loss"):
        logps = token_logps(model.project(x), micro["targets"], spec.cfg.grpo.temperature)
    return sharding.constrain(logps, ("batch", "seq")), aux


def reference_logps(spec, reference: dict, micro: dict, fp8) -> jax.Array:
    """[rows, seq] log-probs under the frozen reference (no gradients; LoRA: the base)."""
    model = models.merge(spec.graphdef, spec.abstract_params, reference)
    with lora.adapters_disabled():
        logps, _ = policy_logps(model, micro, fp8, spec)
    return jax.lax.stop_gradient(logps)


def completion_loss(spec, model, micro: dict, fp8, ref_logps, dropout_key=None) -> tuple:
    """(weighted loss sum, completion tokens, aux: the model's aux and the metric sums)."""
    logps, aux = policy_logps(model, micro, fp8, spec, dropout_key)
    total, count, sums = grpo_sums(logps, micro, ref_logps, spec.cfg.grpo)
    return total, count, {**aux, **sums}
