"""The optimizer from config: global-norm clipping over every gradient, then AdamW (Optax)
with warmup + cosine decay and weight decay by parameter role (`decays`): matmul weights
and embeddings decay; norm scales and biases never do, whether stacked on a `layers` axis
or not. With `optimizer.name: muon`, the hidden weight matrices (trainer/muon.py
`matrix_view`) go to Muon instead, on the same schedule; the rest stays AdamW's.
`optimizer.state_dtype` sets the dtype Adam's moments and Muon's momentum are stored in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import OptimizerConfig
from jaxtrain.trainer import muon, state_store

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


def muon_labels(param_axes: dict) -> dict:
    """Nested dict of "muon" / "adamw" (the structure of `param_axes`): which optimizer
    updates each parameter with optimizer.name muon."""
    return jax.tree.map(
        lambda axes: "muon" if muon.is_muon_param(axes) else "adamw",
        param_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


class ScaleByAdamCompensatedState(NamedTuple):
    """Adam's state with its moments stored as bfloat16 plus int8 error terms
    (trainer/state_store.py)."""

    count: jax.Array
    mu: optax.Updates  # bfloat16
    nu: optax.Updates
    mu_err: optax.Updates  # int8
    nu_err: optax.Updates


def scale_by_adam_stored(b1: float, b2: float, eps: float, state_dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with its moments stored in `state_dtype`: each update reads them in
    float32, computes as optax does, and stores them back (optimizer.state_dtype; bfloat16
    with an int8 error term each, else b2 near 1 freezes nu: trainer/state_store.py)."""
    compensated = state_store.compensated(state_dtype)

    def init(params):
        count = jnp.zeros([], jnp.int32)
        if compensated:
            mu, mu_err = state_store.zeros_like_tree(params)
            nu, nu_err = state_store.zeros_like_tree(params)
            return ScaleByAdamCompensatedState(count, mu, nu, mu_err, nu_err)
        zeros = lambda p: jnp.zeros(p.shape, state_dtype)
        mu, nu = jax.tree.map(zeros, params), jax.tree.map(zeros, params)
        return optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        f32 = lambda x: x.astype(jnp.float32)
        if compensated:
            decoded = (
                state_store.decode_tree(state.mu, state.mu_err),
                state_store.decode_tree(state.nu, state.nu_err),
            )
            state = state._replace(mu=decoded[0], nu=decoded[1])
        mu = jax.tree.map(lambda g, m: (1 - b1) * f32(g) + b1 * f32(m), updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * jnp.square(f32(g)) + b2 * f32(v), updates, state.nu)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        new = jax.tree.map(
            lambda g, m, v: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), updates, mu, nu
        )
        if compensated:
            (mu, mu_err), (nu, nu_err) = state_store.encode_tree(mu), state_store.encode_tree(nu)
            return new, ScaleByAdamCompensatedState(count, mu, nu, mu_err, nu_err)
        store = lambda t: jax.tree.map(lambda x: x.astype(state_dtype), t)
        return new, optax.ScaleByAdamState(count=count, mu=store(mu), nu=store(nu))

    return optax.GradientTransformation(init, update)


def adamw(cfg: OptimizerConfig, schedule: optax.Schedule, mask) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay where `mask`; moments in optimizer.state_dtype (null:
    optax.adamw itself, the moments in the parameters' dtype)."""
    if cfg.state_dtype is None:
        return optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    return optax.chain(
        scale_by_adam_stored(cfg.b1, cfg.b2, cfg.eps, jnp.dtype(cfg.state_dtype)),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(schedule),
    )


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, *, param_axes: dict
) -> optax.GradientTransformation:
    """The optimizer for params whose logical axes are `param_axes` (`models.logical_axes`)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm is not None else []
    if cfg.name == "adamw":
        chain.append(adamw(cfg, schedule, decay_mask(param_axes)))
        return optax.chain(*chain)
    labels = muon_labels(param_axes)
    is_axes = lambda x: isinstance(x, tuple)
    # Muon's leaves as their matrix views, AdamW's masked out (optax.partition hands each
    # transformation its own leaves, the others as MaskedNode)
    views = jax.tree.map(
        lambda axes, label: muon.matrix_view(axes) if label == "muon" else optax.MaskedNode(),
        param_axes,
        labels,
        is_leaf=is_axes,
    )
    m = cfg.muon
    peak = cfg.lr if m.lr is None else m.lr
    muon_schedule = lambda count: schedule(count) * (peak / cfg.lr)
    chain.append(
        optax.partition(
            {
                "adamw": adamw(cfg, schedule, decay_mask(param_axes)),
                "muon": muon.muon(
                    m,
                    muon_schedule,
                    cfg.weight_decay if m.weight_decay is None else m.weight_decay,
                    views,
                    None if cfg.state_dtype is None else jnp.dtype(cfg.state_dtype),
                ),
            },
            labels,
        )
    )
    return optax.chain(*chain)
