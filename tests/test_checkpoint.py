"""Checkpoints in-process: exact resume, corrupted/incomplete checkpoints, keep policy,
restore onto a smaller mesh (8 -> 4 devices), and model-shape changes.

Oracles: an uninterrupted run's own metrics (bit-for-bit on CPU: same program,
same inputs), and the arrays as saved (restored values compared exactly)."""

import gc
import hashlib
import json
import os
import shutil
import sys
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain import sharding
from jaxtrain.cli import main
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.recovery import read_errors
from jaxtrain.recovery.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnavailableError,
    abstract_state,
)
from jaxtrain.trainer import loop, train
from jaxtrain.trainer.program import build_program
from tests.conftest import REPO, tiny_config

pytestmark = pytest.mark.timeout(300)
COMPARED = ("loss", "grad_norm", "lr", "skipped_total")


def small(tmp_path, *overrides):
    """The tiny config, smaller and with a fixed decay horizon so that runs of different
    lengths share one learning-rate schedule."""
    return tiny_config(
        tmp_path,
        "model.d_model=64",
        "model.mlp_dim=128",
        "train.seq_len=32",
        "optimizer.decay_steps=20",
        *overrides,
    )


def by_step(metrics):
    return {r["step"]: tuple(r[k] for k in COMPARED) for r in metrics if "loss" in r}


def test_keep_policy_and_exact_resume_after_losing_newest_checkpoints(tmp_path):
    cfg = small(
        tmp_path,
        "train.steps=10",
        "checkpoint.every=2",
        "checkpoint.keep=2",
        "checkpoint.keep_every=4",
        "mesh.fsdp=2",
    )
    first = train(cfg, devices=jax.devices()[:2])
    ckpts = tmp_path / "checkpoints"
    # keep the newest 2 (8, 10) plus every multiple of 4 (4, 8)
    assert sorted(os.listdir(ckpts), key=int) == ["4", "8", "10"]
    shutil.rmtree(ckpts / "10")
    shutil.rmtree(ckpts / "8")
    # an interrupted write: Orbax's tmp directory must be ignored, not restored
    (ckpts / "9.orbax-checkpoint-tmp-1234").mkdir()
    second = train(cfg, devices=jax.devices()[:2])
    assert second.start_step == 4
    want = by_step(first.metrics)
    got = by_step(second.metrics)
    assert sorted(got) == list(range(5, 11))
    assert all(got[s] == want[s] for s in got), (got, want)  # bit for bit


def test_corrupted_latest_checkpoints_are_skipped_not_crash_looped(tmp_path, capsys, monkeypatch):
    # What the failed restores' abandoned reads report (errors of their coroutines, and
    # TensorStore threads finding Orbax's loop closed, some after the restore returned)
    # is dropped; anything else still reaches the hook beneath.
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    cfg = small(tmp_path, "train.steps=6", "checkpoint.every=2", "checkpoint.on_unreadable=skip")
    first = train(cfg, devices=jax.devices()[:1])
    ckpts = tmp_path / "checkpoints"
    # complete-looking but damaged: 6 has a truncated data file, 4 lost its metadata file
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckpts / "6" / "state") for f in fs]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    os.remove(ckpts / "4" / "state" / "_METADATA")
    second = train(cfg, devices=jax.devices()[:1])
    gc.collect()
    time.sleep(0.5)  # late reads end on TensorStore's threads
    assert reported == [], [f"{type(u.exc_value).__name__}: {u.exc_value} in {u.object!r}" for u in reported]
    user_error = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=main)
    sys.unraisablehook(user_error)

    async def users_coroutine():
        pass

    coroutine = users_coroutine()
    users_exit = types.SimpleNamespace(exc_value=GeneratorExit(), object=coroutine)
    sys.unraisablehook(users_exit)
    coroutine.close()
    assert reported == [user_error, users_exit]
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    for step in (6, 4):
        assert f"checkpoints/{step} is unreadable" in err and f"moved it to {step}.unreadable" in err, err
    assert second.start_step == 2
    assert by_step(second.metrics) == {s: v for s, v in by_step(first.metrics).items() if s > 2}
    assert sorted(os.listdir(ckpts)) == ["2", "4", "4.unreadable", "6", "6.unreadable"]
    third = train(cfg, devices=jax.devices()[:1])  # the rewritten 6 is fine: nothing to do
    assert third.start_step == 6 and third.metrics == []


def _program(cfg, devices):
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices)
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        return build_program(cfg, mesh, rules), mesh


def test_reshard_8_to_4_devices(tmp_path):
    """A checkpoint from a (data 2, fsdp 2, tensor 2) mesh restores onto (fsdp 2, tensor 2)
    over 4 devices with identical values, and training continues with the same losses."""
    cfg8 = small(
        tmp_path / "8", "train.steps=6", "checkpoint.every=4", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"
    )
    run8 = train(cfg8, devices=jax.devices())
    dir4 = tmp_path / "4"
    shutil.copytree(tmp_path / "8" / "checkpoints", dir4 / "checkpoints")
    shutil.rmtree(dir4 / "checkpoints" / "6")
    cfg4 = small(dir4, "train.steps=6", "checkpoint.every=4", "mesh.fsdp=2", "mesh.tensor=2")

    prog8, _ = _program(cfg8, jax.devices())
    prog4, mesh4 = _program(cfg4, jax.devices()[:4])
    ckpt = Checkpointer(dir4 / "checkpoints")
    on8 = ckpt.restore(4, abstract_state(prog8)).state
    on4 = ckpt.restore(4, abstract_state(prog4)).state
    ckpt.close()
    wq = on4.params["blocks"]["attn"]["wq"]
    assert set(wq.sharding.device_set) == set(jax.devices()[:4])
    assert wq.sharding.spec == prog4.state_shardings.params["blocks"]["attn"]["wq"].spec
    same = jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), on8, on4
    )  # the loss window holds NaN for empty slots
    assert all(jax.tree.leaves(same))

    run4 = train(cfg4, devices=jax.devices()[:4])
    assert run4.start_step == 4
    ref = {r["step"]: r["loss"] for r in run8.metrics}
    # different mesh: only the reduction order differs (f32), cf. test_sharded_training
    np.testing.assert_allclose([r["loss"] for r in run4.metrics], [ref[5], ref[6]], rtol=1e-5)


def _tree_digest(path):
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            p = os.path.join(d, f)
            h.update(p.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


def test_model_shape_change_is_a_clear_error_and_leaves_checkpoint(tmp_path, capsys):
    cfg = small(tmp_path, "train.steps=2", "checkpoint.every=2")
    train(cfg, devices=jax.devices()[:1])
    before = _tree_digest(tmp_path / "checkpoints")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"parameter 'blocks/mlp/w_down' has shape "
        r"\(2, 128, 64\) in the checkpoint but \(2, 256, 64\) in the model",
    ):
        train(
            small(tmp_path, "train.steps=4", "checkpoint.every=2", "model.mlp_dim=256"),
            devices=jax.devices()[:1],
        )
    # the spike detector's window is train state too: a different length is named, not "unreadable"
    with pytest.raises(
        CheckpointMismatchError,
        match=r"loss window \(spike detection\) holds 32 "
        r"losses, the run expects faults.spike_window=8",
    ):
        train(
            small(tmp_path, "train.steps=4", "checkpoint.every=2", "faults.spike_window=8"),
            devices=jax.devices()[:1],
        )
    assert _tree_digest(tmp_path / "checkpoints") == before
    # the CLI: exit 2 and one line
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    code = main(
        [
            "train",
            tiny,
            f"output_dir={tmp_path}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "model.d_model=64",
            "model.mlp_dim=128",
            "train.seq_len=32",
            "checkpoint.every=2",
            "model.n_layers=3",
            "mesh.data=8",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: error")]
    assert code == 2 and len(err) == 1 and "'blocks/attn/wk' has shape (2, " in err[0], err
    assert "left untouched" in err[0]
    # a fresh start into a directory with checkpoints would mix two runs: refused
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint.resume=false but .* already holds "
        r"checkpoints \[2\]",
    ):
        train(
            small(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.resume=false"),
            devices=jax.devices()[:1],
        )
    assert _tree_digest(tmp_path / "checkpoints") == before


UNAVAILABLE = 'UNAVAILABLE: Error reading "params.embedding/0.0" in OCDBT database: HTTP response code: 503'


def test_read_errors_prove_damage_only_from_the_bytes():
    """recovery/read_errors.verdict: damage only on proof (the status codes TensorStore gives a
    cut or missing file, unparsable or missing metadata, as test_corrupted_latest_checkpoints...
    and test_storage_faults produce them for real); storage, credentials and memory never."""
    wrapped = Exception("Encountered error while reading array index: (slice(0, 2, 1),)")
    wrapped.__cause__ = ValueError(
        'OUT_OF_RANGE: Error reading "params.blocks.attn.wo/0.0.0.0": Requested byte range'
    )
    unreadable = [
        wrapped,
        ValueError('FAILED_PRECONDITION: Error reading "x": Truncated Zstd-compressed stream'),
        ValueError(
            'NOT_FOUND: Error opening "zarr" driver: Metadata at "loss_window/.zarray" does not exist'
        ),
        ValueError("DATA_LOSS: checksum mismatch"),
        json.JSONDecodeError("Expecting value", "{", 1),
        FileNotFoundError("File gs://b/run/checkpoints/8/meta/metadata not found."),
        read_errors.UnreadableBytes("state/_METADATA is missing"),
    ]
    unavailable = [
        ValueError(UNAVAILABLE),
        ValueError("DEADLINE_EXCEEDED: Error reading: timed out"),
        ValueError("PERMISSION_DENIED: HTTP response code: 403"),
        OSError("Forbidden: b/jaxtrain-test/o\ninjected 403"),
        ConnectionResetError(104, "Connection reset by peer"),
        RuntimeError("something else entirely"),
    ]
    oom = [
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB."),
        MemoryError(),
    ]
    for errors, want in (
        (unreadable, read_errors.UNREADABLE),
        (unavailable, read_errors.UNAVAILABLE),
        (oom, read_errors.OUT_OF_MEMORY),
    ):
        for e in errors:
            assert read_errors.verdict(e) == want, (e, read_errors.VERDICT_NAMES[read_errors.verdict(e)])
    assert read_errors.summary(wrapped).startswith("OUT_OF_RANGE: Error reading")


def test_reads_that_prove_nothing_are_retried_then_stop_with_nothing_moved(tmp_path, monkeypatch):
    """A restore error that says nothing about the checkpoint's bytes never costs a checkpoint:
    one that passes is retried and the run resumes exactly; one that persists stops the run
    (CheckpointUnavailableError) with every file as it was, after checkpoint.read_retries
    retries; out of memory at once. The errors are raised at Orbax's CheckpointManager.restore
    (the library's boundary) with the messages TensorStore and XLA give; test_storage_faults
    meets real ones through the GCS emulator."""
    cfg = small(tmp_path, "train.steps=6", "checkpoint.every=2", "checkpoint.read_retries=2")
    first = train(cfg, devices=jax.devices()[:1])
    ckpts = tmp_path / "checkpoints"
    shutil.rmtree(ckpts / "6")  # the run resumes from 4
    before = {s: _tree_digest(ckpts / s) for s in ("2", "4")}
    monkeypatch.setattr(loop, "retry_delays", lambda n: (0.01,) * n)  # the test's time, not the backoff
    real, calls = ocp.CheckpointManager.restore, []

    def restore_failing(*errors):
        pending = list(errors)

        def restore(self, step, *args, **kwargs):
            calls.append(step)
            if pending:
                raise pending.pop(0)
            return real(self, step, *args, **kwargs)

        monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
        calls.clear()

    restore_failing(*[ValueError(UNAVAILABLE)] * 3)  # more than the retries: stop
    with pytest.raises(
        CheckpointUnavailableError, match=r"could not read checkpoint .*/4 \(UNAVAILABLE: .*2 retries"
    ):
        train(cfg, devices=jax.devices()[:1])
    assert calls == [4, 4, 4]
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.")
    restore_failing(oom)
    with pytest.raises(
        CheckpointUnavailableError, match="out of memory restoring checkpoint .*nothing was moved"
    ):
        train(cfg, devices=jax.devices()[:1])
    assert calls == [4]
    assert sorted(os.listdir(ckpts)) == ["2", "4"]
    assert {s: _tree_digest(ckpts / s) for s in ("2", "4")} == before

    restore_failing(ValueError(UNAVAILABLE), ValueError(UNAVAILABLE))  # within the retries: resumes
    second = train(cfg, devices=jax.devices()[:1])
    assert calls == [4, 4, 4] and second.start_step == 4
    assert by_step(second.metrics) == {s: v for s, v in by_step(first.metrics).items() if s > 4}

    ckpt = Checkpointer(ckpts, retry_delays=(0.01,))  # a listing storage does not serve
    monkeypatch.setattr(ocp.CheckpointManager, "reload", lambda self: (_ for _ in ()).throw(OSError("503")))
    with pytest.raises(CheckpointUnavailableError, match="listing .* failed 2 times"):
        ckpt.steps()
