"""The tiny config's loss curve, two ways.

1. Against a textbook training loop written here, not with jaxtrain's step: the naive jnp
   Llama of tests/reference_llama.py, a masked mean cross-entropy, jax.grad, global-norm
   clipping and AdamW with decoupled weight decay written out by hand (as in Loshchilov &
   Hutter; the learning rate warmed up linearly, then cosine to min_lr_ratio x lr), from the
   same initial parameters and the same batches. This is the oracle: it would catch a wrong
   step that a stored curve, written by that step, would have blessed.
2. Against a stored curve (tests/golden/tiny_loss_curve.json): a drift guard only, so that a
   numerical change never goes unnoticed. The test never writes it; after an intended
   change, regenerate it with tests/golden/regenerate.py (which refuses to run in CI) and
   say so in the commit.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.trainer import train
from tests.conftest import program_on_mesh, tiny_config
from tests.reference_llama import forward as reference_forward

GOLDEN = Path(__file__).parent / "golden" / "tiny_loss_curve.json"
STEPS = 20
# Same pinned XLA on CPU: differences come only from CPU vector width / thread
# count changing reduction order, far below 1e-4 relative.
GOLDEN_RTOL = 1e-4
# The textbook loop: f32 in a different operation order (repeated K/V heads, a Python loop
# over layers); over 20 steps the losses agree to about 1e-6 relative.
TEXTBOOK_RTOL = 2e-5


def textbook_losses(cfg, params, batches) -> list[float]:
    """Losses of STEPS steps of AdamW on the reference model (module docstring)."""
    m, o = cfg.model, cfg.optimizer

    def loss(p, batch):
        logits = reference_forward(p, batch["inputs"], m, batch["positions"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    def lr(t):  # warmup from 0, then cosine from lr to min_lr_ratio x lr over train.steps
        if t < o.warmup_steps:
            return o.lr * t / o.warmup_steps
        frac = (t - o.warmup_steps) / (cfg.train.steps - o.warmup_steps)
        end = o.lr * o.min_lr_ratio
        return end + (o.lr - end) * 0.5 * (1 + math.cos(math.pi * frac))

    # Weight decay: every matmul weight and embedding, never a norm scale.
    decay = jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)

    @jax.jit
    def step(p, mu, nu, t, rate, batch):
        value, g = jax.value_and_grad(loss)(p, batch)
        norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g)))
        g = jax.tree.map(lambda x: x * jnp.minimum(1.0, o.clip_norm / norm), g)
        mu = jax.tree.map(lambda m_, x: o.b1 * m_ + (1 - o.b1) * x, mu, g)
        nu = jax.tree.map(lambda v_, x: o.b2 * v_ + (1 - o.b2) * x * x, nu, g)

        def update(x, m_, v_, d):
            m_hat, v_hat = m_ / (1 - o.b1**t), v_ / (1 - o.b2**t)
            return x - rate * (m_hat / (jnp.sqrt(v_hat) + o.eps) + (o.weight_decay * x if d else 0.0))

        return value, jax.tree.map(update, p, mu, nu, decay), mu, nu

    zeros = jax.tree.map(jnp.zeros_like, params)
    mu, nu, losses = zeros, zeros, []
    for t, batch in enumerate(batches):
        value, params, mu, nu = step(params, mu, nu, t + 1, lr(t), batch)
        losses.append(float(value))
    return losses


@pytest.mark.composes("lm+dense", "lm+adamw", "dense+adamw")
def test_tiny_config_loss_curve_matches_a_textbook_loop_and_the_stored_curve(tmp_path):
    cfg = tiny_config(tmp_path)
    losses = [r["loss"] for r in train(cfg, devices=jax.devices()[:1]).metrics][:STEPS]

    # the same initial parameters and batches as the run above (seeded)
    with program_on_mesh(cfg) as (_, state, data):
        params = jax.device_get(state.params)
    batches = [{k: jnp.asarray(v) for k, v in next(data).items()} for _ in range(STEPS)]
    np.testing.assert_allclose(losses, textbook_losses(cfg, params, batches), rtol=TEXTBOOK_RTOL)

    golden = json.loads(GOLDEN.read_text())["losses"]
    np.testing.assert_allclose(losses, golden, rtol=GOLDEN_RTOL)
    assert golden[-1] < golden[0] - 1.0, "the tiny model should learn the synthetic task"
