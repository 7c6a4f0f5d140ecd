"""Numerical faults: the jitted step skips non-finite updates; the loop counts skips,
rolls back past a streak of bad batches, or stops, by policy; spike detection.

Faults are injected with the testing hook `faults.testing_poison_batches` (those
global batches get loss_mask = inf, so loss and gradients are NaN)."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.cli import main
from jaxtrain.config import ConfigError, FaultsConfig, load_config
from jaxtrain.data import make_data_iterator
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.recovery.checkpoint import Checkpointer, abstract_state
from jaxtrain.recovery.faults import FAULT_NONE, FAULT_NONFINITE, FAULT_SPIKE, FaultMonitor, TrainingFault
from jaxtrain.trainer import train
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.step import judge_step
from tests.conftest import REPO, program_on_mesh, tiny_config

pytestmark = pytest.mark.timeout(300)


def small(tmp_path, *overrides):
    return tiny_config(tmp_path, "model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", *overrides)


def test_nonfinite_update_is_skipped_inside_the_step(tmp_path):
    cfg = small(tmp_path, "mesh.fsdp=2")
    with program_on_mesh(cfg) as (program, state, data):
        good = next(data)
        state, _ = program.step(state, batch_to_device(good, program.batch_sharding))  # non-trivial opt state
        before = jax.device_get(state)
        bad = dict(good, loss_mask=np.full_like(good["loss_mask"], np.inf))
        after, metrics = program.step(state, batch_to_device(bad, program.batch_sharding))
        after, metrics = jax.device_get((after, metrics))
    assert int(metrics["skipped"]) == 1 and not math.isfinite(float(metrics["loss"]))
    assert int(after.step) == int(before.step) + 1
    same = jax.tree.map(np.array_equal, (after.params, after.opt_state), (before.params, before.opt_state))
    assert all(jax.tree.leaves(same))


def test_nan_streak_is_skipped_counted_then_rolled_back(tmp_path):
    # batches 9, 10, 11 are poisoned: steps 10, 11, 12 skip; the third skip in a row rolls
    # back to checkpoint 8 (the newest before step 10) and continues with batch 12.
    cfg = small(
        tmp_path,
        "train.steps=12",
        "checkpoint.every=4",
        "mesh.fsdp=2",
        "faults.testing_poison_batches=[9, 10, 11]",
        "faults.max_consecutive=3",
        "faults.on_too_many=rollback",
    )
    result = train(cfg, devices=jax.devices()[:2])
    records = result.metrics
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [*range(1, 12), 9, 10, 11, 12]
    skipped = {r["step"]: r["skipped"] for r in records[:11]}
    assert [s for s, k in skipped.items() if k] == [10, 11]  # 12's record is never written: rollback
    events = [r for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"rollback"' in r]
    assert len(events) == 1 and '"to_step": 8' in events[0] and '"resume_batch": 12' in events[0]
    after = records[11:]
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in after)
    assert after[-1]["skipped_total"] == 3
    # oracle for the first step after the rollback: checkpoint 8's params on batch 12
    mesh = result.mesh
    with jax.set_mesh(mesh), sharding.axis_rules(axis_rules(resolve_for_mesh(cfg, mesh))):
        ckpt = Checkpointer(tmp_path / "checkpoints")
        assert ckpt.steps() == [4, 8, 12]  # 12 is the new timeline's, saved after the rollback
        params8 = ckpt.restore(8, abstract_state(result.program)).state.params
        ckpt.close()
        data = make_data_iterator(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            seq_len=cfg.train.seq_len,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.seed,
        )
        loss, _, _ = result.program.loss_and_grads(
            params8, batch_to_device(data.batch_at(12), result.program.batch_sharding)
        )
    # separately compiled program: fusion may differ in the last bits
    np.testing.assert_allclose(after[0]["loss"], float(loss), rtol=1e-6)


def test_stop_policy_and_rollback_without_checkpoint_stop_with_a_clear_error(tmp_path):
    poison = ["train.steps=8", "faults.testing_poison_batches=[3, 4]", "faults.max_consecutive=2"]
    with pytest.raises(
        TrainingFault,
        match=r"2 consecutive faulty steps 4\.\.5 \(batches 3\.\.4\): "
        r"step 4: nonfinite .*stopping \(faults.on_too_many=stop\)",
    ):
        train(small(tmp_path / "a", *poison, "faults.on_too_many=stop"), devices=jax.devices()[:1])
    with pytest.raises(
        TrainingFault, match="no checkpoint from before step 4 to roll back to; checkpoint.every=0"
    ):
        train(small(tmp_path / "b", *poison, "faults.on_too_many=rollback"), devices=jax.devices()[:1])


def test_cli_exit_code_3_for_a_training_fault(monkeypatch, capsys):
    import jaxtrain.trainer

    def fault(cfg):
        raise TrainingFault("2 consecutive faulty steps 4..5; stopping")

    monkeypatch.setattr(jaxtrain.trainer, "train", fault)
    code = main(["train", f"{REPO}/configs/tiny.yaml", "mesh.data=8", "logging.progress=false"])
    assert code == 3
    assert capsys.readouterr().err.splitlines() == [
        "jaxtrain: error: 2 consecutive faulty steps 4..5; stopping"
    ]


def test_judge_step_spike_and_nonfinite_verdicts():
    """The in-step verdict against hand-computed medians: window (3, 2.5, 2, 1.9) has
    median 2.25, so with factor 2 a loss above 4.5 is a spike."""
    judge = jax.jit(functools.partial(judge_step, skip_nonfinite=True, spike_factor=2.0))
    window = jnp.array([3.0, 2.5, 2.0, 1.9])
    cases = [
        (5.0, 1.0, False, FAULT_SPIKE),
        (4.0, 1.0, True, FAULT_NONE),
        (float("nan"), 1.0, False, FAULT_NONFINITE),
        (1.0, float("inf"), False, FAULT_NONFINITE),
    ]
    for loss, gnorm, applied, fault in cases:
        apply, code, new = jax.device_get(judge(jnp.float32(loss), jnp.float32(gnorm), window))
        assert (bool(apply), int(code)) == (applied, fault), (loss, gnorm)
        expected = [2.5, 2.0, 1.9, loss] if applied else [3.0, 2.5, 2.0, 1.9]
        np.testing.assert_array_equal(new, np.float32(expected))
    # a window that is not full yet judges no spikes
    partial = jnp.array([jnp.nan, jnp.nan, 1.0, 1.0])
    apply, code, _ = judge(jnp.float32(100.0), jnp.float32(1.0), partial)
    assert bool(apply) and int(code) == FAULT_NONE
    # skip_nonfinite=False: a non-finite step is reported but its update applied
    keep = functools.partial(judge_step, skip_nonfinite=False, spike_factor=None)
    apply, code, _ = keep(jnp.float32(jnp.nan), jnp.float32(1.0), window)
    assert bool(apply) and int(code) == FAULT_NONFINITE


def test_loss_spike_update_is_skipped_inside_the_step(tmp_path):
    """A spike never reaches the weights: with a window of losses 1.0 (threshold 1.5)
    the tiny model's first loss (about ln 512 = 6.2) is a spike, params and
    optimizer state stay as they were; with a window of 5.0 (threshold 7.5) it is not."""
    cfg = small(tmp_path, "faults.spike_factor=1.5", "faults.spike_window=3")
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        low = state._replace(loss_window=jnp.ones(3, jnp.float32))
        before = jax.device_get(low)
        after, metrics = jax.device_get(program.step(low, batch))
        assert (int(metrics["fault"]), int(metrics["skipped"])) == (FAULT_SPIKE, 1)
        assert 1.5 < float(metrics["loss"]) < 7.5
        same = jax.tree.map(
            np.array_equal,
            (after.params, after.opt_state, after.loss_window),
            (before.params, before.opt_state, before.loss_window),
        )
        assert all(jax.tree.leaves(same))
        high = program.init()._replace(loss_window=jnp.full(3, 5.0, jnp.float32))
        after, metrics = jax.device_get(program.step(high, batch))
        assert (int(metrics["fault"]), int(metrics["skipped"])) == (FAULT_NONE, 0)
        np.testing.assert_array_equal(after.loss_window, np.float32([5.0, 5.0, metrics["loss"]]))
        changed = jax.tree.map(np.array_equal, after.opt_state, before.opt_state)
        assert not all(jax.tree.leaves(changed))  # applied (lr is 0 at step 0: look at Adam's moments)


def test_monitor_streaks_policy_and_state_roundtrip():
    cfg = FaultsConfig(
        spike_factor=2.0, spike_window=4, max_consecutive=2, on_too_many="rollback", max_rollbacks=1
    )
    m = FaultMonitor(cfg)
    for step, loss in enumerate([4.0, 3.0, 2.5, 2.0, 1.9], start=1):
        assert m.observe(step, step - 1, loss, False, FAULT_NONE) is None
    assert m.observe(6, 5, 9.0, True, FAULT_SPIKE) is None and m.spikes_total == 1
    copy = FaultMonitor(cfg)
    copy.load_state_dict(m.state_dict())
    for mon in (m, copy):  # same verdicts after a checkpoint round trip
        assert mon.observe(7, 6, float("nan"), True, FAULT_NONFINITE) == "rollback"
        assert mon.streak.first_step == 6 and mon.streak.last_batch == 6
        assert "step 6: spike (loss 9)" in mon.describe_streak()
    m.after_rollback(None)
    assert m.rollbacks == 1 and m.streak is None and m.skipped_total == 2
    m.observe(8, 9, 50.0, True, FAULT_SPIKE)
    assert m.observe(9, 10, 50.0, True, FAULT_SPIKE) == "stop"  # max_rollbacks used up
    assert "faults.max_rollbacks=1" in str(m.stop_error())


@pytest.mark.parametrize(
    "override,expected",
    [
        ("faults.on_too_many=retry", "faults.on_too_many='retry': expected rollback or stop"),
        ("faults.spike_factor=0.5", "faults.spike_factor=0.5: expected a number > 1 or null"),
        ("faults.max_consecutive=0", "faults.max_consecutive=0: expected a positive integer"),
        ("checkpoint.keep=0", "checkpoint.keep=0: expected a positive integer"),
        ("checkpoint.every=-1", "checkpoint.every=-1: expected >= 0"),
        (
            "distributed.num_processes=2",
            "distributed.num_processes=2: expected distributed.coordinator_address, "
            "distributed.process_id to be set too",
        ),
        (
            "distributed.coordinator_address=localhost distributed.num_processes=2 distributed.process_id=0",
            "distributed.coordinator_address='localhost': expected host:port",
        ),
        ("distributed.heartbeat_timeout=0", "distributed.heartbeat_timeout=0: expected a positive number"),
    ],
)
def test_fault_tolerance_config_errors(override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(f"{REPO}/configs/tiny.yaml", override.split())
