"""AdamW (Optax) with warmup + cosine decay, global-norm clipping, and weight
decay by parameter role (`decays`): matmul weights and embeddings decay; norm
scales and biases never do, whether stacked on a `layers` axis or not."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax

from jaxtrain.config import OptimizerConfig

#: Logical axes of matmul weights and embeddings (models/layers.py, models/moe.py).
WEIGHT_AXES = frozenset(
    {"embed", "head_embed", "vocab", "head_vocab", "heads", "kv_heads", "head_dim", "mlp", "expert"}
)
#: Logical axes that only norm scales ("norm") and biases ("bias", and the attention sinks'
#: per-head logits, "sink_heads") carry.
NO_DECAY_AXES = frozenset({"norm", "bias", "sink_heads"})


def decays(logical_axes: Sequence[str | None]) -> bool:
    """Whether a parameter with these logical axis names gets weight decay.

    The rule, by role rather than by rank (a stacked norm scale is 2-D):
      * any axis in NO_DECAY_AXES: a norm scale or a bias (e.g. the MoE router score
        bias, which aux-loss-free balancing moves and decay would pull to 0): never;
      * otherwise any axis in WEIGHT_AXES: a matmul weight or an embedding: decays;
      * otherwise: ValueError. The `layers` stacking axis and unnamed (None) axes say
        nothing about the role, and a new parameter should not get one by default.
    """
    axes = set(logical_axes)
    if axes & NO_DECAY_AXES:
        return False
    if axes & WEIGHT_AXES:
        return True
    raise ValueError(
        f"logical axes {tuple(logical_axes)}: no role for weight decay; expected one of "
        f"{sorted(WEIGHT_AXES)} (matmul weight / embedding: decays) or of {sorted(NO_DECAY_AXES)} "
        "(norm scale / bias: never decays)"
    )


def decay_mask(param_axes: dict) -> dict:
    """Nested dict of bools (the structure of `param_axes`, which is that of the
    params): True where `decays`. Errors name the parameter's path."""

    def one(path, axes):
        try:
            return decays(axes)
        except ValueError as e:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)}: {e}") from None

    return jax.tree_util.tree_map_with_path(one, param_axes, is_leaf=lambda x: isinstance(x, tuple))


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, *, param_axes: dict
) -> optax.GradientTransformation:
    """The optimizer for params whose logical axes are `param_axes` (`models.logical_axes`)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm is not None else []
    chain.append(
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask(param_axes),
        )
    )
    return optax.chain(*chain)
