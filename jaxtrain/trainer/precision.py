"""Dynamic loss scaling for float16 compute (`optimizer.loss_scale`, on when
`model.compute_dtype` is float16): the scale's state and its update after each step.

The objective is multiplied by the scale before the backward pass and the gradients
divided by it (trainer/step.py); a step whose gradients overflow at a scale above the
minimum is skipped and the scale backed off; after `growth_interval` clean steps in a row
it grows. The state is part of the train state, so it is checkpointed and a resumed run
scales exactly as an uninterrupted one.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.config import LossScaleConfig

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


def overflowed(loss, grad_norm, scale, cfg: LossScaleConfig):
    """Gradients that overflow (finite loss, non-finite gradients) at a scale above the
    minimum: the scaler's business (skip the update, lower the scale), not a numerical
    fault. At the minimum scale an overflow is a fault like any other."""
    return jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (scale > cfg.min_scale)
