"""The multi-token prediction loss (model.mtp; the modules are models/mtp.py).

Module k's cross-entropy is the mean over its counted targets (token t + k + 1 at position t,
in t's document and inside the row), through the main model's output head, plain or chunked
as the main loss (`train.loss_chunk`). `mtp_loss` is the mean of those over the depths, as
DeepSeek-V3's L_MTP before its weight; the step adds `count x model.mtp.loss_weight x
mtp_loss` to the objective, as it adds the router losses (trainer/step.py `objective`), and
logs `mtp_loss` unweighted beside `loss`.

On MoE models the prediction blocks are MoE layers too: their router losses and load join the
main layers' in the averages the step weights and logs (`moe_aux_loss`, ...: means over all
MoE layers, `moe_max_load` the max), and their expert load comes back apart
(`moe_mtp_expert_load` [depth, experts]) for their own selection-bias update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models import mtp
from jaxtrain.trainer.loss import chunked_cross_entropy, cross_entropy

_F32 = jnp.float32


def mtp_loss(
    model, residual: jax.Array, micro: dict, *, segment_ids, chunk: int
) -> tuple[jax.Array, dict | None]:
    """(mean over depths of each module's mean cross-entropy (f32), the prediction blocks'
    MoE stats stacked on depth or None) on one (micro)batch. `residual`: the main model's last
    residual stream (`hidden(..., normed=False)`); `segment_ids`: what the main layers' attention
    took (None: one document per row); `chunk`: train.loss_chunk (0: the plain loss)."""
    depth = model.cfg.mtp.depth
    normed, stats = model.predict_ahead(
        residual, micro["inputs"], micro["targets"], positions=micro["positions"], segment_ids=segment_ids
    )
    targets = mtp.lookahead_targets(micro["targets"], depth)
    masks = mtp.lookahead_mask(micro["loss_mask"], micro["segment_ids"], depth)
    means = []
    for k in range(depth):
        if chunk:
            total, count = chunked_cross_entropy(normed[k], model.head(), targets[k], masks[k], chunk=chunk)
        else:
            total, count = cross_entropy(model.project(normed[k]), targets[k], masks[k])
        means.append(total / jnp.maximum(count, 1.0))
    return jnp.mean(jnp.stack(means)), stats


def with_prediction_stats(aux: dict, stats: dict | None, n_moe_layers: int) -> dict:
    """The main model's MoE `aux` (models/transformer.py `hidden`) with the prediction blocks'
    stats `stats` ([depth] per layer, `expert_load` [depth, experts]) joined in: means over
    all n_moe_layers + depth MoE layers, the max of the max loads, and their expert load as
    `moe_mtp_expert_load`. Dense models (`stats` None): `aux` as it is."""
    if stats is None:
        return aux
    depth = stats["expert_load"].shape[0]
    out = dict(aux)
    for k, v in stats.items():
        if k == "expert_load":
            out["moe_mtp_expert_load"] = v
        elif k == "max_load":
            out["moe_max_load"] = jnp.maximum(aux["moe_max_load"], jnp.max(v))
        else:
            total = n_moe_layers * aux[f"moe_{k}"] + jnp.sum(v.astype(_F32))
            out[f"moe_{k}"] = total / (n_moe_layers + depth)
    return out
