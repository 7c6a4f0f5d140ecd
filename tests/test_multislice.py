"""Multi-slice training (`mesh.dcn_data` / `mesh.dcn_fsdp`) with two CPU processes as two
slices: the DCN axis is the process boundary. Oracles: the single-process 8-device run of
the same (flattened) mesh, and the mesh's device layout computed by hand.

Also what the docs promise for preemption in multi-process jobs: SIGTERM to one
process makes both stop at the same step and save it."""

import os
import re
import signal
import time

import jax
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.trainer import train
from tests.conftest import tiny_config
from tests.test_checkpoint_kill import records
from tests.test_multiprocess import COMMON, RTOL, assert_ok, launch, wait_all

pytestmark = pytest.mark.timeout(600)


class _Dev:
    """A stand-in device: an id and the process it belongs to (CPU devices have no slices)."""

    def __init__(self, i, process):
        self.id, self.process_index = i, process

    def __repr__(self):
        return f"d{self.id}"


def test_dcn_axes_cross_the_process_boundary():
    """Devices 0-3 on process 0 and 4-7 on process 1, listed interleaved on purpose: a DCN
    degree must split the processes and each ICI degree stay inside one."""
    devices = [_Dev(i, i // 4) for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    ids = lambda m: np.vectorize(lambda d: d.id)(m.devices).squeeze().tolist()
    # dcn_data=2 x fsdp=4: data is the process
    assert ids(sharding.make_mesh({"fsdp": 4}, devices, dcn_axis_sizes={"data": 2})) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # data=2 x (dcn_fsdp=2 x fsdp=2): fsdp index = slice * 2 + local, so data stays in-process
    assert ids(sharding.make_mesh({"data": 2, "fsdp": 2}, devices, dcn_axis_sizes={"fsdp": 2})) == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]


@pytest.mark.slow  # two processes compile and train: minutes on a loaded 2-core machine
def test_two_slices_train_like_one_process(tmp_path):
    """mesh.fsdp=4 per slice x mesh.dcn_data=2 over two processes == data=2 x fsdp=4 in one."""
    ref_cfg = tiny_config(tmp_path / "ref", *COMMON, "train.steps=3", "checkpoint.every=0")
    ref = [r["loss"] for r in train(ref_cfg, devices=jax.devices()).metrics]
    results = wait_all(
        launch(tmp_path / "two", "train.steps=3", "checkpoint.every=0", "mesh.data=1", "mesh.dcn_data=2")
    )
    assert_ok(results)
    two = [r["loss"] for r in records(tmp_path / "two")]
    assert len(two) == 3
    np.testing.assert_allclose(two, ref, rtol=RTOL)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step_and_saves(tmp_path):
    procs = launch(tmp_path, "train.steps=500", "checkpoint.every=1000")
    deadline = time.monotonic() + 240
    while len(records(tmp_path)) < 2:  # a couple of steps trained by both
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("the two-process run never got going: " + procs[0].communicate()[1][-1500:])
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGTERM)  # the supervisor of process 1 only; it forwards it
    results = wait_all(procs, timeout=180)
    assert_ok(results)
    stops = []
    for code, out, err in results:
        m = re.search(r"preempted: stopped by (.+?) after step (\d+); checkpoint step (\d+) saved", out)
        assert m, f"exit {code}, no preemption line:\n{out[-2000:]}\n{err[-2000:]}"
        stops.append((int(m.group(2)), int(m.group(3))))
    (step, saved), (step1, saved1) = stops
    assert step == step1 == saved == saved1 and 2 <= step < 500, stops
    assert (tmp_path / "checkpoints" / str(step)).is_dir()
    assert records(tmp_path)[-1]["step"] == step
