"""GRPO (train.objective=grpo): TRL's advantages, loss aggregations and clipping against
hand-computed cases; the prompts loader and the rewards; an end-to-end CLI run."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.trainer import grpo

# --- advantages -----------------------------------------------------------------------------


def test_advantages_scale_rewards_by_hand():
    # two groups of 3: [1, 2, 3] (mean 2, std with n-1 = 1) and [0, 0, 3] (mean 1, std sqrt(3))
    r = [1.0, 2.0, 3.0, 0.0, 0.0, 3.0]
    none = grpo.advantages(r, 3, "none")
    np.testing.assert_allclose(none, [-1, 0, 1, -1, -1, 2], atol=0)
    group = grpo.advantages(r, 3, "group")
    s = math.sqrt(3.0)
    np.testing.assert_allclose(
        group, [-1 / 1.0001, 0, 1 / 1.0001, -1 / (s + 1e-4), -1 / (s + 1e-4), 2 / (s + 1e-4)], rtol=1e-6
    )
    # batch: std over all six with n-1: mean 1.5, squares 0.25+0.25+2.25+2.25+2.25+2.25 = 9.5 -> var 1.9
    batch = grpo.advantages(r, 3, "batch")
    np.testing.assert_allclose(batch, np.array([-1, 0, 1, -1, -1, 2]) / (math.sqrt(1.9) + 1e-4), rtol=1e-6)
    # a group of equal rewards has zero advantage, not a division by zero
    np.testing.assert_array_equal(grpo.advantages([2.0, 2.0], 2, "group"), [0.0, 0.0])


# --- aggregation ---------------------------------------------------------------------------

# Two completions: row 0 has 2 completion tokens with per-token losses (a, b); row 1 has 1 (c).
_MASK = np.array([[0, 1, 1, 0], [0, 0, 1, 0]], np.float32)
_LOSS = np.array([[9.0, 1.0, 3.0, 9.0], [9.0, 9.0, 5.0, 9.0]], np.float32)  # 9: not counted


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((1 + 3) / 2 + 5 / 1) / 2),  # mean over completions of the token means: 3.5
        ("bnpo", (1 + 3 + 5) / 3),  # token sum / completion tokens
        ("dapo", (1 + 3 + 5) / 3),
        ("dr_grpo", (1 + 3 + 5) / (2 * 4)),  # / (completions x max_new_tokens=4)
    ],
)
def test_loss_type_normalisers_by_hand(loss_type, expected):
    weight, share = grpo.loss_weights(_MASK, loss_type, max_new_tokens=4)
    assert float(np.sum(weight * _LOSS)) == pytest.approx(expected, rel=1e-6)
    assert float(np.sum(share)) == pytest.approx(1.0, rel=1e-6)


def test_normaliser_is_global_whatever_the_split():
    """The weights of the whole batch, summed over any row split, give the whole batch's loss."""
    rng = np.random.default_rng(0)
    mask = (rng.random((8, 6)) < 0.6).astype(np.float32)
    loss = rng.normal(size=(8, 6)).astype(np.float32)
    for loss_type in grpo.LOSS_TYPES:
        w, _ = grpo.loss_weights(mask, loss_type, 6)
        whole = np.sum(w * loss)
        halves = np.sum(w[::2] * loss[::2]) + np.sum(w[1::2] * loss[1::2])
        assert halves == pytest.approx(whole, rel=1e-6, abs=1e-7)


# --- the clipped objective and the KL -------------------------------------------------------


def _terms(logp, old, ref, adv, **kw):
    f = lambda x: jnp.asarray([[x]], jnp.float32)
    args = {"epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.0, **kw}
    loss, kl, region = grpo.per_token_terms(f(logp), f(old), f(ref), f(adv), **args)
    return float(loss[0, 0]), (None if kl is None else float(kl[0, 0])), float(region[0, 0])


def test_clipping_and_kl_by_hand():
    # ratio = e^0.5 = 1.6487 > 1.2; A = 2 > 0: the clipped term 1.2 * 2 is the smaller -> loss -2.4
    loss, kl, region = _terms(0.5, 0.0, 0.0, 2.0)
    assert loss == pytest.approx(-2.4, rel=1e-6) and kl is None and region == 1.0
    # same ratio, A = -2: min(-3.2974, -2.4) = -3.2974 (unclipped) -> loss 3.2974, not in the region
    loss, _, region = _terms(0.5, 0.0, 0.0, -2.0)
    assert loss == pytest.approx(2.0 * math.exp(0.5), rel=1e-6) and region == 0.0
    # ratio e^-0.5 = 0.6065 < 0.8 with A = -1: clipped 0.8 * -1 -> loss 0.8, in the region
    loss, _, region = _terms(-0.5, 0.0, 0.0, -1.0)
    assert loss == pytest.approx(0.8, rel=1e-6) and region == 1.0
    # epsilon_high: ratio e^0.5 with epsilon_high 0.28 -> clipped at 1.28
    loss, _, _ = _terms(0.5, 0.0, 0.0, 1.0, epsilon_high=0.28)
    assert loss == pytest.approx(-1.28, rel=1e-6)
    # k3 KL: ref - logp = -0.3 -> e^-0.3 + 0.3 - 1 = 0.040818; beta 0.1 added to the ratio term
    loss, kl, _ = _terms(0.3, 0.3, 0.0, 1.0, beta=0.1)
    k3 = math.exp(-0.3) + 0.3 - 1.0
    assert kl == pytest.approx(k3, rel=1e-5)
    assert loss == pytest.approx(-1.0 + 0.1 * k3, rel=1e-5)


def test_token_logps_are_of_the_tempered_softmax():
    logits = jnp.asarray([[[1.0, 2.0, 0.5]]], jnp.float32)
    got = float(grpo.token_logps(logits, jnp.asarray([[1]]), 0.7)[0, 0])
    z = np.array([1.0, 2.0, 0.5]) / 0.7
    assert got == pytest.approx(z[1] - np.log(np.exp(z).sum()), rel=1e-6)
