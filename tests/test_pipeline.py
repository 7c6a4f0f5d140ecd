"""Pipeline parallelism (sharding/pipeline.py, mesh.stage, pipeline.*).

Oracles: a plain `lax.scan` over the same layers (the transform alone), and the
single-device run of the same model (training: loss and gradients at the
tolerances of tests/test_sharded_training.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.sharding.pipeline import bubble_fraction, run_pipeline

# --- the transform alone, on a toy layer -------------------------------------------

L, B, D = 8, 8, 16


def toy_layer(p, h, ex):
    """A matmul layer that also reads a per-row side input and reports an aux sum."""
    y = jnp.tanh(h @ p["w"] + p["b"]) + h * ex[..., None]
    return y, {"sum": jnp.sum(y)}


@pytest.fixture(scope="module")
def toy():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (L, D, D)) / 4, "b": jax.random.normal(k[1], (L, D))}
    x = jax.random.normal(k[2], (B, 4, D))
    ex = jax.random.uniform(k[3], (B, 4))

    def sequential(params, x):
        return jax.lax.scan(lambda h, p: toy_layer(p, h, ex), x, params)

    loss = lambda p: jnp.sum(sequential(p, x)[0] ** 2)
    y, aux = sequential(params, x)
    return params, x, ex, y, aux, jax.grad(loss)(params)


def _pipelined(ex, S, M, R):
    return lambda p, x: run_pipeline(toy_layer, p, x, ex, stages=S, microbatches=M, repeats=R)


# (stages, microbatches, repeats): GPipe with M = 1, M < S, M > S; circular with M = S.
SCHEDULES = [(2, 1, 1), (4, 2, 1), (4, 8, 1), (2, 2, 2), (4, 4, 2)]


@pytest.mark.parametrize("S,M,R", SCHEDULES, ids=str)
def test_schedule_equals_sequential_layers(toy, S, M, R):
    """Without a mesh: the schedule alone (order of layers, microbatch bookkeeping, aux)."""
    params, x, ex, ref_y, ref_aux, ref_grads = toy
    f = _pipelined(ex, S, M, R)
    y, aux = jax.jit(f)(params, x)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    assert aux["sum"].shape == (L, M)  # [layer, microbatch]; the sequential run sums all rows
    np.testing.assert_allclose(aux["sum"].sum(axis=1), ref_aux["sum"], rtol=1e-4)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(f(p, x)[0] ** 2)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), grads, ref_grads)


@pytest.mark.parametrize("S,M,R", [(4, 4, 1), (2, 4, 2)], ids=str)
def test_on_stage_mesh_equals_sequential_and_shifts_by_collective_permute(toy, S, M, R):
    params, x, ex, ref_y, _, ref_grads = toy
    f = _pipelined(ex, S, M, R)
    mesh = sharding.make_mesh({"stage": S, "data": 8 // S})
    with jax.set_mesh(mesh):
        y, _ = jax.jit(f)(params, x)
        grads = jax.jit(jax.grad(lambda p: jnp.sum(f(p, x)[0] ** 2)))(params)
        hlo = jax.jit(f).lower(params, x).compile().as_text()
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), grads, ref_grads)
    assert "collective-permute" in hlo  # the stage shift is a device-to-device send, not a gather


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stages=3, microbatches=4), "8 layers do not split into stages=3"),
        (dict(stages=2, microbatches=3), "not a multiple of microbatches=3"),
        (dict(stages=4, microbatches=2, repeats=2), "needs microbatches >= stages"),
        (dict(stages=0, microbatches=2), "stages=0"),
    ],
)
def test_bad_arguments_are_named(toy, kwargs, message):
    params, x, ex, *_ = toy
    with pytest.raises(ValueError, match=message):
        run_pipeline(toy_layer, params, x, ex, **kwargs)
