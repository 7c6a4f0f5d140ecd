"""The local checkpoint tier (`checkpoint.local_dir`, `local_every`, `local_keep`) in one
process: its layout and keep policy, the restore rule between the tiers, goodput's `lost`, a
corrupt local step skipped for the next one, and the bad inputs.

Oracles: an uninterrupted run's own metrics (bit for bit on CPU: same program, same inputs);
goodput's `lost` recomputed by hand from the killed attempt's own bucket snapshots. The
two-process kill -9 evidence is tests/test_local_checkpoint_multiprocess.py."""

import json
import os
import re
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.cli import main
from jaxtrain.config import ConfigError, load_config
from jaxtrain.observe.goodput import LOOP_BUCKETS
from jaxtrain.recovery import read_errors
from jaxtrain.recovery.checkpoint import CheckpointError, CheckpointMismatchError
from jaxtrain.recovery.local import LocalCheckpointer
from jaxtrain.trainer import train
from jaxtrain.trainer.step import TrainState
from tests.conftest import REPO
from tests.test_checkpoint import COMPARED, by_step, small
from tests.test_checkpoint_kill import records
from tests.test_multiprocess import assert_ok, launch, wait_all

pytestmark = pytest.mark.timeout(300)
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def tiered(tmp_path, *overrides):
    """8 steps on fsdp=2: persistent every 4 (steps 4, 8), local every 2 (2 and 6: a step the
    persistent tier saves is not saved locally too)."""
    return small(
        tmp_path,
        "train.steps=8",
        "mesh.fsdp=2",
        "checkpoint.every=4",
        f"checkpoint.local_dir={tmp_path / 'local'}",
        "checkpoint.local_every=2",
        *overrides,
    )


def resume_rows(out_dir):
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    return [r for r in rows if r.get("event") == "resume"]


def test_local_tier_layout_restore_rule_goodput_and_corruption(tmp_path, capsys):
    cfg = tiered(tmp_path)
    devices = jax.devices()[:2]
    first = train(cfg, devices=devices)
    want = by_step(first.metrics)
    assert sorted(want) == list(range(1, 9))
    local = tmp_path / "local" / "process_0"
    assert sorted(os.listdir(local), key=int) == ["2", "6"]  # local_keep=2
    assert sorted(os.listdir(local / "6")) == ["arrays.bin", "manifest.json"]
    assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == ["4", "8"]

    # a kill after step 7: the persistent tier's newest is 4, the local tier holds 6
    shutil.rmtree(tmp_path / "checkpoints" / "8")
    capsys.readouterr()
    second = train(cfg, devices=devices)
    assert second.start_step == 6
    assert by_step(second.metrics) == {s: v for s, v in want.items() if s > 6}  # bit for bit
    err = " ".join(capsys.readouterr().err.split())
    assert "restore: step 6 from the local tier" in err and "persistent tier's newest: step 4 (" in err, err
    row = resume_rows(tmp_path)[-1]
    assert (row["step"], row["tier"], row["checkpoint"]) == (6, "local", str(local / "6"))

    # goodput: the first attempt's steps 6..8 are lost, measured by its own snapshots at the
    # local save of step 6 and at its last logged step (8); those since step 4 would be more
    attempts = json.load(open(tmp_path / "goodput.json"))["attempts"]
    assert len(attempts) == 2
    prev = attempts[0]
    last_step, at_last = prev["last_logged"]
    assert last_step == 8
    by_hand = sum(at_last[k] - prev["at_save"]["6"][k] for k in LOOP_BUCKETS)
    since_4 = sum(at_last[k] - prev["at_save"]["4"][k] for k in LOOP_BUCKETS)
    assert prev["seconds"]["lost"] == pytest.approx(by_hand, rel=1e-9, abs=1e-12)
    assert 0 < prev["seconds"]["lost"] < since_4

    # equal steps in both tiers: the persistent one wins
    capsys.readouterr()
    assert train(cfg, devices=devices).start_step == 8  # persistent 8 again, local {2, 6}
    assert "restore: step 8 (or the newest readable before it) from the persistent tier" in " ".join(
        capsys.readouterr().err.split()
    )

    # no persistent checkpoint left; local 6 is corrupt (one byte of a shard flipped): proved
    # by its CRC-32, set aside, and the next step every process holds (2) restored
    shutil.rmtree(tmp_path / "checkpoints")
    with open(local / "6" / "arrays.bin", "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    third = train(cfg, devices=devices)
    err = " ".join(capsys.readouterr().err.split())
    assert third.start_step == 2, err
    assert re.search(r"local checkpoint \S+/process_0/6 is unreadable \(.*fails its CRC-32 check", err), err
    assert "moved it to 6.unreadable" in err
    assert by_step(third.metrics) == {s: v for s, v in want.items() if s > 2}
    assert sorted(os.listdir(local)) == ["2", "6", "6.unreadable"]


def test_local_tier_of_another_model_or_mesh_is_one_clean_line(tmp_path, capsys):
    devices = jax.devices()[:2]
    train(tiered(tmp_path, "train.steps=2", "checkpoint.every=0"), devices=devices)
    assert os.listdir(tmp_path / "local" / "process_0") == ["2"]
    with pytest.raises(
        CheckpointMismatchError,
        match=r"local checkpoint \S+/process_0/2: array 'params/blocks/mlp/w_down' has shape "
        r"\(2, 128, 64\) in the local checkpoint but \(2, 256, 64\) in the run",
    ):
        train(tiered(tmp_path, "checkpoint.every=0", "model.mlp_dim=256"), devices=devices)
    # another mesh shape, through the CLI: exit 2 and one line
    small_model = ("model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "optimizer.decay_steps=20")
    quiet = ("logging.progress=false", "logging.tensorboard=false")
    local_tier = (f"checkpoint.local_dir={tmp_path / 'local'}", "checkpoint.local_every=2")
    run = (f"output_dir={tmp_path}", "train.steps=4", "mesh.data=8")
    code = main(["train", TINY, *quiet, *small_model, *run, *local_tier])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: error")]
    assert code == 2 and len(err) == 1, err
    assert "it was written on mesh {'fsdp': 2} by 1 process(es); the run has mesh {'data': 8} on 1" in err[0]
    assert os.listdir(tmp_path / "local" / "process_0") == ["2"]  # nothing touched
    # a fresh start over local steps would mix two runs: refused, as over persistent ones
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=false but checkpoint.local_dir=.* holds"):
        train(tiered(tmp_path, "checkpoint.every=0", "checkpoint.resume=false"), devices=devices)
    assert os.listdir(tmp_path / "local" / "process_0") == ["2"]


def _state(mesh, scale=1.0):
    """A small TrainState: an fsdp-sharded float32 matrix, a replicated bfloat16 vector, the
    int32 step and a loss window with NaN (empty) slots."""
    shard = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec)))  # noqa: E731
    return TrainState(
        step=shard(jnp.int32(7), ()),
        params={
            "w": shard(scale * jnp.arange(32.0).reshape(8, 4), ("fsdp", None)),
            "b": shard(jnp.linspace(-1, 1, 4).astype(jnp.bfloat16), (None,)),
        },
        opt_state=(),
        loss_window=shard(jnp.array([2.5, jnp.nan, jnp.nan]), (None,)),
    )


def _target(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_local_checkpointer_roundtrip_keep_atomicity_and_proofs(tmp_path):
    """Saved arrays come back exactly (the oracle: the arrays saved), onto their shardings;
    the newest `keep` steps stay; a killed write's tmp folder is never listed and is removed
    by the next run; a failed write is one warning line; damaged bytes are proof."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    lines = []
    (tmp_path / "process_0" / "5.tmp-123").mkdir(parents=True)  # a write killed earlier
    ckpt = LocalCheckpointer(tmp_path, keep=2, log=lines.append)
    assert not (tmp_path / "process_0" / "5.tmp-123").exists()
    for step in (2, 4, 6):
        ckpt.save(step, _state(mesh, step), {"batch": step}, {"mesh": {"fsdp": 2}})
    ckpt.wait()
    assert ckpt.steps() == [4, 6]
    state = _state(mesh, 6)
    target = _target(state)
    assert ckpt.mismatch(6, target, {"fsdp": 2}) is None
    restored = ckpt.read(6, target)
    assert (restored.step, restored.tier, restored.data_state) == (6, "local", {"batch": 6})
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
        assert got.dtype == want.dtype and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # exact, NaN == NaN
    wider = target._replace(params={**target.params, "w": jax.ShapeDtypeStruct((8, 5), jnp.float32)})
    assert ckpt.mismatch(6, wider, {"fsdp": 2}) == (
        "array 'params/w' has shape (8, 4) in the local checkpoint but (8, 5) in the run"
    )
    assert "it was written on mesh {'fsdp': 2}" in ckpt.mismatch(6, target, {"data": 2})

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    ckpt._write = full_disk
    ckpt.save(8, state, {"batch": 8}, {"mesh": {"fsdp": 2}})
    ckpt.wait()
    assert ckpt.steps() == [4, 6] and len(lines) == 1
    assert lines[0].startswith("warning: local checkpoint step 8 was not written") and "No space" in lines[0]

    arrays = tmp_path / "process_0" / "6" / "arrays.bin"
    arrays.write_bytes(arrays.read_bytes()[:-3])  # cut short
    with pytest.raises(read_errors.UnreadableBytes, match="holds .* bytes, its manifest names"):
        ckpt.read(6, target)
    os.remove(tmp_path / "process_0" / "4" / "manifest.json")
    with pytest.raises(FileNotFoundError) as missing:
        ckpt.read(4, target)
    assert read_errors.verdict(missing.value) == read_errors.UNREADABLE


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            "checkpoint.local_dir=gs://bucket/local checkpoint.local_every=2",
            "checkpoint.local_dir='gs://bucket/local': expected a path on each host",
        ),
        (
            "checkpoint.local_dir=/tmp/l checkpoint.local_every=10 checkpoint.every=10",
            "checkpoint.local_every=10: expected below checkpoint.every=10",
        ),
        ("checkpoint.local_every=2", "checkpoint.local_every=2: expected checkpoint.local_dir to be set too"),
        ("checkpoint.local_dir=/tmp/l", "checkpoint.local_dir='/tmp/l': expected checkpoint.local_every > 0"),
        (
            "checkpoint.local_dir=/tmp/l checkpoint.local_every=2 checkpoint.local_keep=0",
            "checkpoint.local_keep=0: expected a positive integer",
        ),
    ],
)
def test_local_tier_config_errors(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(TINY, overrides.split())


def test_local_dir_on_object_storage_exits_2_with_one_line(tmp_path, capsys):
    code = main(
        [
            "train",
            TINY,
            f"output_dir={tmp_path}",
            "checkpoint.local_dir=gs://bucket/local",
            "checkpoint.local_every=2",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("jaxtrain: error: checkpoint.local_dir="), err
    assert not os.listdir(tmp_path)


def _kill_after(procs, out_dir, step, skip_rows):
    """SIGKILL both process groups once process 0 has logged `step` (after `skip_rows`
    earlier rows); returns each process's stderr, whitespace-normalised."""
    deadline = time.monotonic() + 300
    while not any(r["step"] >= step for r in records(out_dir)[skip_rows:]):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(
                f"never reached step {step}: " + " | ".join(p.communicate()[1][-1500:] for p in procs)
            )
        time.sleep(0.01)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    return [" ".join(p.communicate()[1].split()) for p in procs]


def _choices(errs):
    """Each process's restore line: (step, tier)."""
    found = [
        re.search(r"restore: step (\d+) (?:\(or the newest readable before it\) )?from the (\w+) tier", e)
        for e in errs
    ]
    assert all(found), errs
    return [(int(m.group(1)), m.group(2)) for m in found]


@pytest.mark.multiprocess
@pytest.mark.slow  # four two-process runs: about two minutes on a loaded 2-core machine
def test_two_processes_kill_9_resume_from_the_local_tier_then_without_process_1s_folder(tmp_path):
    """The issue's evidence: two processes (mesh.dcn_data=2), persistent every 10, local every
    2. kill -9 both after step 13; the rerun restores from the local tier at a step past 10;
    kill again, delete process_1/, and the rerun restores the same step on both processes:
    process 0's newest local step, its replica sent to process 1. Oracle: the uninterrupted
    two-process run; every logged step of every attempt equals its row bit for bit (same
    program, same inputs, same collectives)."""
    args = [
        "mesh.data=1",
        "mesh.dcn_data=2",
        "train.steps=20",
        "checkpoint.every=10",
        "checkpoint.local_every=2",
    ]
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    assert_ok(wait_all(launch(ref_dir, *args, f"checkpoint.local_dir={tmp_path / 'ref_local'}")))
    ref = {r["step"]: tuple(r[k] for k in COMPARED) for r in records(ref_dir)}
    assert sorted(ref) == list(range(1, 21))
    local = tmp_path / "local"
    args.append(f"checkpoint.local_dir={local}")

    _kill_after(launch(out, *args), out, 13, 0)
    rows = len(records(out))
    errs = _kill_after(launch(out, *args), out, 17, rows)
    (step, tier), other = _choices(errs)
    assert other == (step, tier) and tier == "local" and step > 10 and step % 2 == 0, errs
    assert resume_rows(out)[-1]["step"] == step and resume_rows(out)[-1]["tier"] == "local"
    # goodput: the killed first attempt lost only its time since its local save of `step`
    # (its own bucket snapshots there and at its last logged step), less than since step 10
    first = json.load(open(out / "goodput.json"))["attempts"][0]
    at_last = first["last_logged"][1]
    since = lambda s: sum(at_last[k] - first["at_save"][str(s)][k] for k in LOOP_BUCKETS)  # noqa: E731
    # (nothing when the kill came after the resumed step was logged and before the next one:
    # observe/goodput.py charge_restart; that race once made this test flaky)
    expected = since(step) if first["last_logged"][0] > step else 0.0
    assert first["seconds"]["lost"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert first["seconds"]["lost"] < since(10)

    # a replaced host: process 1's shards are gone, but with dcn_data=2 the state is replicated
    # across the two processes (slices), so process 0's copy of its newest step is sent to it
    shutil.rmtree(local / "process_1")
    newest = max(int(n) for n in os.listdir(local / "process_0") if n.isdigit())
    assert newest > 10
    results = wait_all(launch(out, *args))
    assert_ok(results)
    errs = [" ".join(err.split()) for _, _, err in results]
    assert _choices(errs) == [(newest, "local")] * 2
    assert all(f"local step {newest}: replica 0 along mesh axis data sent to process [1]" in e for e in errs)
    assert (resume_rows(out)[-1]["step"], resume_rows(out)[-1]["tier"]) == (newest, "local")
    got = records(out)
    assert {r["step"] for r in got} == set(range(1, 21))
    for r in got:
        assert tuple(r[k] for k in COMPARED) == ref[r["step"]], (r, ref[r["step"]])


@pytest.mark.multiprocess
@pytest.mark.slow  # three two-process runs: about two minutes on a loaded 2-core machine
def test_two_processes_sharded_state_corrupt_or_missing_local_step_falls_back_together(tmp_path):
    """fsdp=8 across both processes: each holds half of every array, so no process can stand
    in for the other. Process 1's local step 4 corrupt: both skip it (the next candidate, 2,
    is older than persistent 3) and restore persistent step 3; process 1 alone sets its copy
    aside. process_1/ deleted: both restore persistent step 3 again. Oracle: the first run's
    rows, bit for bit."""
    out, local = tmp_path / "run", tmp_path / "local"
    args = [
        "mesh.data=1",
        "mesh.fsdp=8",
        "train.steps=8",
        "checkpoint.every=3",
        "checkpoint.local_every=2",
        f"checkpoint.local_dir={local}",
    ]
    assert_ok(wait_all(launch(out, *args)))  # persistent 3, 6, 8; local 2, 4 on each process
    ref = {r["step"]: tuple(r[k] for k in COMPARED) for r in records(out)}
    assert sorted(ref) == list(range(1, 9))
    assert sorted(os.listdir(local / "process_1"), key=int) == ["2", "4"]

    def rerun():
        for step in ("6", "8"):
            shutil.rmtree(out / "checkpoints" / step)
        before = len(records(out))
        results = wait_all(launch(out, *args))
        assert_ok(results)
        errs = [" ".join(err.split()) for _, _, err in results]
        assert _choices(errs) == [(3, "persistent")] * 2, errs
        assert (resume_rows(out)[-1]["step"], resume_rows(out)[-1]["tier"]) == (3, "persistent")
        rows = records(out)[before:]
        assert [r["step"] for r in rows] == list(range(4, 9))
        for r in rows:
            assert tuple(r[k] for k in COMPARED) == ref[r["step"]], (r, ref[r["step"]])
        return errs

    arrays = local / "process_1" / "4" / "arrays.bin"
    data = bytearray(arrays.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrays.write_bytes(bytes(data))
    errs = rerun()
    assert "is unreadable" in errs[1] and "fails its CRC-32 check" in errs[1]
    assert "is unreadable" not in errs[0]
    assert "4.unreadable" in os.listdir(local / "process_1")

    shutil.rmtree(local / "process_1")  # a replaced host
    errs = rerun()
    assert "process 1: none" in errs[0], errs[0]
