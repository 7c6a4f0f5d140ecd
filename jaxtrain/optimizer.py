"""AdamW (Optax) with warmup + cosine decay, global-norm clipping, and weight
decay only on >= 2-D weights (norm scales are left alone, as in Llama/GPT)."""

from __future__ import annotations

import jax
import optax

from jaxtrain.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm is not None else []
    chain.append(
        optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*chain)
