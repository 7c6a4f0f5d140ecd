"""Weight decay by role (jaxtrain.optimizer.decays): the mask parameter by parameter
for the tiny dense and MoE models, written out by hand; and one AdamW step through
make_optimizer against the update computed by hand in float64 numpy."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models
from jaxtrain.config import OptimizerConfig, load_config
from jaxtrain.trainer.optimizer import decay_mask, decays, learning_rate_schedule, make_optimizer
from tests.conftest import REPO


def mask_of(config: str, *overrides: str) -> dict:
    cfg = load_config(os.path.join(REPO, "configs", config), list(overrides))
    _, state = models.abstract_model(lambda: models.Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return decay_mask(models.logical_axes(state))


# Stacked layers: every leaf under blocks / moe_blocks has a leading `layers` axis, so
# the norm scales are [layers, d_model] and the router bias [layers, experts]: 2-D,
# and still never decayed.
ATTENTION = {"wq": True, "wk": True, "wv": True, "wo": True}

TINY_DENSE_MASK = {
    "embedding": True,
    "blocks": {
        "attn_norm": {"scale": False},
        "attn": ATTENTION,
        "mlp_norm": {"scale": False},
        "mlp": {"w_gate": True, "w_up": True, "w_down": True},
    },
    "final_norm": {"scale": False},
    "lm_head": True,
}

TINY_MOE_MASK = {
    "embedding": True,
    "moe_blocks": {
        "attn_norm": {"scale": False},
        "attn": ATTENTION,
        "mlp_norm": {"scale": False},
        "mlp": {
            "w_router": True,  # a matmul weight (embed x experts)
            "router_bias": False,  # aux-loss-free balancing state: decay would pull it to 0
            "w_gate": True,
            "w_up": True,
            "w_down": True,
            "shared_gate": True,
            "shared_up": True,
            "shared_down": True,
        },
    },
    "final_norm": {"scale": False},
    "lm_head": True,
}


def test_decay_mask_tiny_dense():
    assert mask_of("tiny.yaml") == TINY_DENSE_MASK


def test_decay_mask_tiny_moe_with_score_bias_and_shared_experts():
    mask = mask_of("tiny-moe.yaml", "model.moe.score_bias=true", "model.moe.num_shared_experts=1")
    assert mask == TINY_MOE_MASK


def test_a_parameter_without_a_role_is_refused():
    assert decays(("layers", "norm")) is False and decays(("embed", None)) is True
    with pytest.raises(
        ValueError, match=r"parameter \['blocks'\]\['gain'\]: logical axes \('layers', None\)"
    ):
        decay_mask({"blocks": {"gain": ("layers", None)}})


# float32 optimizer arithmetic against a float64 oracle: a few ulp of values of
# order lr * (1 + wd * |p|) ~ 0.1.
ADAMW_RTOL, ADAMW_ATOL = 1e-6, 1e-8


def test_one_adamw_step_matches_hand_computed_update():
    # warmup_steps=0: the step-0 learning rate is the peak lr (checked below). eps is
    # large so that the update depends on the gradient's scale, and so on the clipping
    # (global norm ~4.5 > clip_norm): with eps ~ 0 the first Adam step is sign(g).
    cfg = OptimizerConfig(lr=0.1, warmup_steps=0, b1=0.9, b2=0.95, eps=0.1, weight_decay=0.2, clip_norm=0.5)
    rng = np.random.default_rng(0)
    params = {
        "blocks": {"attn_norm": {"scale": 1.0 + 0.1 * rng.standard_normal((2, 4))}},
        "w": rng.standard_normal((4, 3)),
        "router_bias": rng.standard_normal((2, 3)),
    }
    axes = {
        "blocks": {"attn_norm": {"scale": ("layers", "norm")}},
        "w": ("embed", "mlp"),
        "router_bias": ("layers", "bias"),
    }
    grads = {
        "blocks": {"attn_norm": {"scale": rng.standard_normal((2, 4))}},
        "w": rng.standard_normal((4, 3)),
        "router_bias": np.zeros((2, 3)),  # not trained by gradients
    }
    f32 = lambda tree: jax.tree.map(lambda x: np.float32(x), tree)
    tx = make_optimizer(cfg, total_steps=10, param_axes=axes)
    updates, _ = jax.jit(tx.update)(f32(grads), tx.init(f32(params)), f32(params))

    lr = 0.1
    np.testing.assert_allclose(float(learning_rate_schedule(cfg, 10)(0)), lr, rtol=1e-7)
    p64, g64 = jax.tree.map(np.float64, params), jax.tree.map(np.float64, grads)
    norm = np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(g64)))
    assert norm > cfg.clip_norm, "the case should clip"
    decayed = {"blocks": {"attn_norm": {"scale": False}}, "w": True, "router_bias": False}

    def adamw(p, g, decay):
        g = g * cfg.clip_norm / norm
        m, v = (1 - cfg.b1) * g, (1 - cfg.b2) * g**2
        m_hat, v_hat = m / (1 - cfg.b1), v / (1 - cfg.b2)
        return -lr * (m_hat / (np.sqrt(v_hat) + cfg.eps) + (cfg.weight_decay * p if decay else 0.0))

    expected = jax.tree.map(adamw, p64, g64, decayed)
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=ADAMW_RTOL, atol=ADAMW_ATOL)
    # The norm scale and the router bias move by their (clipped) gradients only.
    assert np.all(np.asarray(updates["router_bias"]) == 0.0)
