"""Pipeline parallelism (sharding/pipeline.py, mesh.stage, pipeline.*).

Oracles: a plain `lax.scan` over the same layers (the transform alone), and the
single-device run of the same model (training: loss and gradients at the
tolerances of tests/test_sharded_training.py)."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.sharding.pipeline import bubble_fraction, run_pipeline
from jaxtrain.trainer.batches import batch_to_device
from tests.conftest import REPO, child_env, program_on_mesh, replace, tiny_config

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


# --- the model and train step: loss and gradients equal one device ----------------------

# f32, as tests/test_sharded_training.py: sharding changes the summation order only.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6
SMALL = ("model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128")


def dense_cfg():
    return tiny_config(None, *SMALL, "model.n_layers=8")


def moe_cfg():
    return load_config(
        os.path.join(REPO, "configs", "tiny-moe.yaml"),
        ["logging.progress=false", "logging.tensorboard=false", *SMALL, "model.moe.expert_mlp_dim=64"],
    )


def loss_and_grads(cfg, hlo=False):
    """(loss, {param path: gradient}) of one batch, and the compiled step's HLO text if asked."""
    validate(cfg, math.prod(cfg.mesh.sizes().values()))
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        flat = {jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
        text = program.loss_and_grads.lower(state.params, batch).compile().as_text() if hlo else None
        return (float(loss), flat, text) if hlo else (float(loss), flat)


def assert_matches(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=LOSS_RTOL)
    assert got[1].keys() == ref[1].keys()
    for path, g in got[1].items():
        np.testing.assert_allclose(g, ref[1][path], rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=path)


@pytest.fixture(scope="module")
def dense_single_device():
    return loss_and_grads(dense_cfg())


@pytest.mark.composes("lm+gpipe", "dense+gpipe", "data+gpipe", "fsdp+gpipe")
def test_gpipe_stage2_with_fsdp_equals_one_device(dense_single_device):
    """The cheap model-level check: also reads the compiled step for the stage shift."""
    cfg = replace(dense_cfg(), mesh=dict(stage=2, fsdp=2, data=2), pipeline=dict(microbatches=2))
    loss, grads, hlo = loss_and_grads(cfg, hlo=True)
    assert_matches((loss, grads), dense_single_device)
    assert "collective-permute" in hlo


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, pipeline",
    [
        (dict(stage=4, tensor=2), dict(microbatches=4)),
        pytest.param(
            dict(stage=2, data=2, tensor=2),
            dict(microbatches=2, schedule="circular", repeats=2),
            marks=pytest.mark.composes("lm+circular", "dense+circular", "data+circular", "tensor+circular"),
        ),
        pytest.param(
            dict(stage=4, fsdp=2),
            dict(microbatches=4, schedule="circular", repeats=2),
            marks=pytest.mark.composes("fsdp+circular"),
        ),
    ],
    ids=["gpipe-s4-tensor", "circular-s2-r2-tensor", "circular-s4-r2-fsdp"],
)
def test_pipelines_equal_one_device(dense_single_device, mesh, pipeline):
    assert_matches(loss_and_grads(replace(dense_cfg(), mesh=mesh, pipeline=pipeline)), dense_single_device)


@pytest.mark.slow
@pytest.mark.composes("moe+gpipe", "expert+gpipe")
def test_moe_in_stages_with_expert_parallelism_equals_one_device():
    """MoE layers inside the stages, experts over `expert`. Router losses are per
    microbatch, so the oracle splits its batch the same way (train.microbatches)."""
    ref = loss_and_grads(replace(moe_cfg(), train=dict(microbatches=2)))
    got = loss_and_grads(replace(moe_cfg(), mesh=dict(stage=2, expert=4), pipeline=dict(microbatches=2)))
    assert_matches(got, ref)


@pytest.mark.slow
def test_five_axis_meshes_equal_one_device():
    """data x stage x fsdp x tensor x context (dense) and x expert (MoE): 32 simulated
    devices, so in a subprocess (tests/pipeline_mesh_check.py)."""
    env = child_env()
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "pipeline_mesh_check.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "dense" in proc.stdout and "moe" in proc.stdout


@pytest.mark.slow
def test_train_logs_the_bubble(tmp_path, capfd):
    """`jaxtrain train` with stages: the bubble is printed at start and in every metrics row."""
    from jaxtrain.trainer import train

    cfg = replace(
        dense_cfg(),
        mesh=dict(stage=4, data=2),
        pipeline=dict(microbatches=4, schedule="circular", repeats=2),
        train=dict(steps=2),
    )
    cfg = dataclasses.replace(cfg, output_dir=str(tmp_path))
    records = train(cfg, devices=jax.devices()[:8]).metrics
    expected = 3 / (4 * 2 + 3)
    assert [r["pipeline_bubble"] for r in records] == [pytest.approx(expected)] * 2
    assert all(np.isfinite(r["loss"]) for r in records)
    assert f"bubble (idle share of its tick table) = {expected:.3f}" in capfd.readouterr().err


# --- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.stage=3"], "model.n_layers=8: expected a multiple of mesh.stage x pipeline.repeats = 3"),
        (["mesh.stage=2", "pipeline.schedule=zigzag"], "pipeline.schedule='zigzag'"),
        (["mesh.stage=2", "pipeline.repeats=2"], "pipeline.repeats=2: schedule gpipe"),
        (["mesh.stage=2", "pipeline.schedule=circular"], "pipeline.repeats=1: schedule circular"),
        (
            ["mesh.stage=4", "pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=2"],
            "pipeline.microbatches=2: the circular schedule expects >= mesh.stage=4",
        ),
        (["mesh.stage=2", "pipeline.microbatches=16"], "x pipeline.microbatches \\(16\\) = 16"),
        (["mesh.stage=2", "model.fp8=true"], "model.fp8=true with mesh.stage=2"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):  # load_config validates
        cfg = tiny_config(None, *SMALL, "model.n_layers=8", *overrides)
        validate(cfg, math.prod(cfg.mesh.sizes().values()))
