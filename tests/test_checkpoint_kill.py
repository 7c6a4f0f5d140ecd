"""Kill and preempt the CLI as a scheduler would: `kill -9` at random moments (one of
them while an asynchronous checkpoint write is in flight) and SIGTERM; rerunning the
same command must continue exactly where an uninterrupted run would be.

Oracle: the same command run once without interruption; on CPU the resumed losses,
gradient norms and learning rates must be equal bit for bit, step by step."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, child_env

TINY = os.path.join(REPO, "configs", "tiny.yaml")
COMPARED = ("loss", "grad_norm", "lr", "skipped_total")
RUN_TIMEOUT = 240  # one CLI run, seconds (startup + compile + 40 tiny steps is ~20 s)
pytestmark = pytest.mark.timeout(900)


def command(out_dir, *extra):
    return [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        TINY,
        f"output_dir={out_dir}",
        "train.steps=40",
        "mesh.fsdp=2",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


def env():
    """The CLI's environment: this one (with tests/conftest.py's shared compilation cache)
    less the simulated device count (the CLI sets its own)."""
    e = child_env()
    e.update(JAX_PLATFORMS="cpu")
    return e


def start(out_dir, *extra):
    return subprocess.Popen(
        command(out_dir, *extra),
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc, timeout=RUN_TIMEOUT):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"jaxtrain did not finish within {timeout} s")
    return proc.returncode, out, err


def records(out_dir):
    """metrics.jsonl of every run so far (a line cut by kill -9 is skipped)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path).read().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in rows if "loss" in r]


def wait_for(predicate, proc, timeout=RUN_TIMEOUT, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"jaxtrain exited early ({proc.returncode}): {err[-2000:]}")
        if predicate():
            return
        time.sleep(poll)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("timed out waiting for the moment to interrupt")


def in_flight_writes(ckpt_dir):
    return [n for n in os.listdir(ckpt_dir) if "orbax-checkpoint-tmp" in n] if os.path.isdir(ckpt_dir) else []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = finish(start(out, "checkpoint.every=5"))
    assert code == 0, err[-3000:]
    rows = records(out)
    assert [r["step"] for r in rows] == list(range(1, 41))
    return {r["step"]: tuple(r[k] for k in COMPARED) for r in rows}


def assert_matches(rows, reference):
    assert rows, "no metrics"
    for r in rows:
        assert tuple(r[k] for k in COMPARED) == reference[r["step"]], (r, reference[r["step"]])


def finalized_steps(ckpt_dir):
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if os.path.isdir(ckpt_dir) else []


@pytest.mark.slow
def test_kill_9_at_random_moments_then_rerun_gives_identical_metrics(tmp_path, uninterrupted):
    seed = int(os.environ.get("JAXTRAIN_CHAOS_SEED", random.SystemRandom().randrange(10**6)))
    rng = random.Random(seed)
    ckpt_dir = tmp_path / "checkpoints"
    moments = ["steps", "steps", "async write"]
    rng.shuffle(moments)
    for moment in moments:
        done = len(records(tmp_path))
        furthest = max((r["step"] for r in records(tmp_path)), default=0)
        proc = start(tmp_path, "checkpoint.every=5")
        if moment == "async write":
            # past startup (which removes tmp leftovers of earlier kills), a write is in flight
            wait_for(lambda: len(records(tmp_path)) > done and in_flight_writes(ckpt_dir), proc)
        else:  # a random step beyond anything reached so far
            target = min(38, furthest + rng.randint(2, 12))
            wait_for(lambda: any(r["step"] >= target for r in records(tmp_path)[done:]), proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if moment == "async write":
            assert in_flight_writes(ckpt_dir), f"seed {seed}: the write finished before the kill"
    newest = finalized_steps(ckpt_dir)
    code, out, err = finish(start(tmp_path, "checkpoint.every=5"))
    assert code == 0, f"seed {seed}: {err[-3000:]}"
    assert (f"resumed from step {newest[-1]}" in out) if newest else ("resumed" not in out), (
        f"seed {seed}: checkpoints {newest}, output {out!r}"
    )
    rows = records(tmp_path)
    assert {r["step"] for r in rows} == set(range(1, 41)), f"seed {seed}"
    assert_matches(rows, uninterrupted)
    assert not in_flight_writes(ckpt_dir), f"seed {seed}"  # cleaned up by the rerun


def test_sigterm_finishes_step_saves_and_exits_0_then_resumes(tmp_path, uninterrupted):
    # checkpoint.every=1000: the only checkpoint is the one SIGTERM asks for
    proc = start(tmp_path, "checkpoint.every=1000")
    wait_for(lambda: len(records(tmp_path)) >= 3, proc, poll=0.05)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, err[-3000:]
    line = [l for l in out.splitlines() if l.startswith("preempted:")]
    assert line, out
    step = int(line[0].split("after step ")[1].split(";")[0])
    assert f"checkpoint step {step} saved" in line[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [str(step)]
    assert max(r["step"] for r in records(tmp_path)) == step
    code, out, err = finish(start(tmp_path, "checkpoint.every=1000"))
    assert code == 0, err[-3000:]
    assert f"resumed from step {step}" in out
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert_matches(rows, uninterrupted)
