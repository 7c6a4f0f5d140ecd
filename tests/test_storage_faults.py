"""Checkpoints under storage faults, against the GCS emulator behind a proxy of ours that fails
chosen requests (tests/gcs_emulator.py: 503s, 403s, dropped connections).

What must hold (recovery/checkpoint.py, recovery/read_errors.py): a save or restore that meets
transient faults completes, and the resumed run is bit-identical to an uninterrupted one on
local disk; reads storage keeps refusing stop the run with exit 5 and one line, with every
object left as it was, and the same command resumes exactly once the faults stop; a
checkpoint whose bytes are damaged stops the run (exit 2) naming it, nothing moved, unless
`checkpoint.on_unreadable=skip`. Never a restart from step 0.

Oracles: an uninterrupted run on local disk (losses, gradient norms and learning rates equal
bit for bit: same program, same inputs) and the bucket's object list with MD5s, read through
the emulator's own API.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.gcs_emulator import BUCKET, FaultProxy, cli_env, start_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, EVERY = 12, 4
COMPARED = ("loss", "grad_norm", "lr", "skipped_total")


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """(emulator, proxy): the emulator hands out the proxy's address, so that every request a
    run makes (resumable uploads included) goes through the proxy."""
    proxy = FaultProxy()
    server, emulator, log = start_emulator(tmp_path_factory.mktemp("gcs"), external_url=proxy.url)
    proxy.upstream = emulator.url
    yield emulator, proxy
    proxy.close()
    server.terminate()
    server.wait(timeout=10)
    log.close()


def run(proxy, output_dir, *overrides):
    env = cli_env(proxy.url)
    args = [
        "train",
        os.path.join(REPO, "configs", "tiny.yaml"),
        f"output_dir={output_dir}",
        f"checkpoint.every={EVERY}",
        "checkpoint.read_retries=1",
        "optimizer.decay_steps=20",  # one learning-rate schedule for runs of any length
        "logging.progress=false",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "-m", "jaxtrain", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def metrics(text):
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {r["step"]: tuple(r[k] for k in COMPARED) for r in rows if "loss" in r}


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("jaxtrain: error: ")]


def test_faults_during_save_and_restore_lose_nothing_and_resume_exactly(proxied, tmp_path):
    gcs, proxy = proxied
    reference = run(proxy, tmp_path / "local", f"train.steps={STEPS}")  # local disk, no faults
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = metrics((tmp_path / "local" / "metrics.jsonl").read_text())
    ckpts = "run/checkpoints"
    url = f"gs://{BUCKET}/run"

    # 1. saves meet 503s and dropped connections on every 13th and 29th checkpoint request
    # (TensorStore and gcsfs back off a second or more per retry: denser faults cost minutes)
    proxy.fail("503", "/checkpoints/", every=13)
    proxy.fail("drop", "/checkpoints/", every=29)
    saved = run(proxy, url, "train.steps=8")
    proxy.clear()
    assert saved.returncode == 0, saved.stderr[-3000:]
    save_faults = proxy.injected()
    assert save_faults > 0
    assert gcs.committed_steps(ckpts) == [4, 8]

    # 2. storage refuses the checkpoint's reads (expired credentials): exit 5, one line, nothing moved
    before = gcs.objects(ckpts + "/")
    proxy.fail("403", "/checkpoints/8/", method="GET")
    refused = run(proxy, url, f"train.steps={STEPS}")
    proxy.clear()
    assert refused.returncode == 5, refused.stderr[-3000:]
    errors = error_lines(refused.stderr)
    assert len(errors) == 1 and "nothing was moved or deleted" in errors[0], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert gcs.objects(ckpts + "/") == before

    # 3. the restore meets 503s on every 9th read: it resumes from 8, exactly
    refused_faults = proxy.injected()
    proxy.fail("503", "/checkpoints/8/", method="GET", every=9)
    resumed = run(proxy, url, f"train.steps={STEPS}")
    proxy.clear()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert proxy.injected() > refused_faults
    tail = resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stderr and "(step 8," in resumed.stderr, tail
    got = metrics(gcs.read("run/metrics.jsonl").decode())
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # bit for bit: steps 1-8 from the faulted saves' run, 9-12 after the restore

    # 4. a damaged checkpoint (an array object gone) stops the run naming it, nothing moved
    data = [n for n in gcs.names(f"{ckpts}/12/state/") if "/d/" in n]
    gcs.delete(data[0])
    before = gcs.objects(ckpts + "/")
    damaged = run(proxy, url, f"train.steps={STEPS + 4}")
    assert damaged.returncode == 2, damaged.stderr[-3000:]
    errors = error_lines(damaged.stderr)
    assert len(errors) == 1 and f"{ckpts}/12 is unreadable" in errors[0], damaged.stderr[-3000:]
    assert "checkpoint.on_unreadable=skip" in errors[0]
    assert gcs.objects(ckpts + "/") == before
