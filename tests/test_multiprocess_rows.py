"""Multi-process beside every other feature (issue #62): each row of jaxtrain/compose.py's
PROCESS_ROWS switches on many features at once and trains two steps on two processes, 4 CPU
devices each (coordinator on 127.0.0.1, gloo collectives), with the data axis across them
(mesh.dcn_data=2) and the rest of the row's mesh inside each. Oracle: the same config in this
one process on 8 devices, the data axis in place (mesh.data=2): the same global mesh, the same
batches, so every logged step and the final weights must match. A row tests multiprocess with
each of its features (compose.process_pairs); the features' own oracles are elsewhere.

Each process loads its own rows of each batch (synthetic, chat and preference token
directories written here by `jaxtrain tokenize`), so what the rows check is what crosses the
process boundary: the data each process feeds, the collectives, the host-side reads of
metrics and the checkpoint each process writes its shards of.

The two processes train all rows in one launch (tests/multiprocess_rows_worker.py): one start-up
and one coordinator for seven configs. Tolerances: float32 rows as tests/test_multiprocess.py
(gloo may sum in another order: losses and gradient norms rtol 1e-5) and tests/test_pairs.py
(each parameter's move over the two steps from the seed's weights, rtol 2e-4 / atol 1e-6, with
lr=1 and Adam's eps=1, so a move is close to the gradient itself); rows with 16-bit compute or
state as tests/test_pairs.py's LOW_* (another order of sums can round a value to the next
16-bit number)."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain import compose
from jaxtrain.trainer import train
from tests.conftest import REPO, child_env, tiny_config
from tests.corpora import chatml_token_dirs
from tests.test_checkpoint_kill import records
from tests.test_multiprocess import assert_ok, final_params, free_port, wait_all
from tests.test_pairs import (
    BASE,
    GRAD_ATOL,
    GRAD_RTOL,
    LOW_LOSS_RTOL,
    LOW_MOVE_TOL,
    LOW_PRECISION,
    MUON_MOVE_TOL,
    OVERRIDES,
)
from tests.test_post_training_kill import flatten

pytestmark = pytest.mark.timeout(900)

STEPS = 2
RTOL = 1e-5


def _param(row):
    pairs = [f"{a}+{b}" for a, b in compose.process_pairs(compose.PROCESS_ROWS[row])]
    return pytest.param(row, id=row, marks=pytest.mark.composes(*pairs))


def row_overrides(row: str, data: dict) -> list[str]:
    """The row's config over configs/tiny.yaml (without the mesh's data axis); `data`: the token
    directories of chat and dpo."""
    features = compose.PROCESS_ROWS[row]
    out = [*BASE, "model.vocab_size=320", f"train.steps={STEPS}", f"checkpoint.every={STEPS}"]
    for f in features:
        if f in ("chat", "dpo"):
            out += [o for o in OVERRIDES[f] if not o.startswith("data.paths")]
            out += (
                [f"data.paths=[{data[f]}]", "data.packing=windows"]
                if f == "chat"
                else [f"data.paths=[{data[f]}]"]
            )
        else:
            out += OVERRIDES[f]
    if "dpo" in features:
        out.append("train.seq_len=48")  # each pair's prompt and both responses fit
    if "moe" in features and any(f in compose.SCHEDULES for f in features):
        out.append("train.microbatches=1")  # the pipeline's microbatches take MoE's
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat and preference token directories (chatml), from the test assets."""
    return chatml_token_dirs(tmp_path_factory.mktemp("mp_rows_data"))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, data):
    """Every row trained on two processes, in one launch; {row: output_dir}."""
    tmp = tmp_path_factory.mktemp("mp_rows")
    port = free_port()
    dirs = {row: tmp / row for row in compose.PROCESS_ROWS}
    spec = {
        "config": os.path.join(REPO, "configs", "tiny.yaml"),
        "coordinator": f"127.0.0.1:{port}",
        "devices": 4,
        "rows": {
            row: [
                *row_overrides(row, data),
                "mesh.dcn_data=2",
                f"output_dir={dirs[row]}",
                "logging.progress=false",
                "logging.tensorboard=false",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                "distributed.num_processes=2",
            ]
            for row in compose.PROCESS_ROWS
        },
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = child_env()
    env.update(JAX_PLATFORMS="cpu")
    worker = os.path.join(REPO, "tests", "multiprocess_rows_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(tmp / "spec.json"), str(pid)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for pid in range(2)
    ]
    assert_ok(wait_all(procs, timeout=800))
    return dirs


def _seed_params(result) -> dict:
    """The weights train() started from (the seed's): its own program's init, run again on its
    mesh (no second program to trace)."""
    with jax.set_mesh(result.mesh):
        return flatten(jax.device_get(result.program.init().params))


@pytest.mark.parametrize("row", [_param(r) for r in compose.PROCESS_ROWS])
def test_two_processes_equal_one(row, two_processes, data, tmp_path):
    features = compose.PROCESS_ROWS[row]
    two_dir = two_processes[row]
    errors = sorted(two_dir.glob("ERROR.*")) if two_dir.exists() else []
    assert not errors, errors[0].read_text()[-3000:]
    cfg = tiny_config(tmp_path, *row_overrides(row, data), "mesh.data=2")
    assert math.prod(cfg.mesh.sizes().values()) == 8
    result = train(cfg, devices=jax.devices())
    low = bool(LOW_PRECISION & set(features))

    want, got = records(tmp_path), records(two_dir)  # metrics.jsonl: process 0 only
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for w, g in zip(want, got):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                g[key], w[key], rtol=LOW_LOSS_RTOL if low else RTOL, err_msg=f"step {g['step']} {key}"
            )
    start = _seed_params(result)
    # this run's final weights as it holds them; the two processes' from the checkpoint they wrote
    want, got = flatten(jax.device_get(result.state.params)), final_params(two_dir, STEPS)
    assert want.keys() == got.keys() == start.keys()
    for k in want:
        moved, want_moved = got[k] - start[k], want[k] - start[k]
        assert np.abs(want_moved).max() > 0, f"{k} did not move"
        if low:
            error = np.linalg.norm(moved - want_moved) / np.linalg.norm(want_moved)
            assert error <= LOW_MOVE_TOL, (k, error)
        elif "muon" in features:  # Newton-Schulz amplifies the f32 rounding of a gradient
            atol = MUON_MOVE_TOL * np.abs(want_moved).max() + GRAD_ATOL
            np.testing.assert_allclose(moved, want_moved, rtol=0, atol=atol, err_msg=k)
        else:
            np.testing.assert_allclose(moved, want_moved, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=k)


def test_each_row_switches_on_exactly_its_features(data):
    """A row's two-process config switches on what the row says, and nothing else (no compiles)."""
    from jaxtrain.config import validate

    for row, features in compose.PROCESS_ROWS.items():
        cfg = tiny_config(None, *row_overrides(row, data), "mesh.dcn_data=2")
        validate(cfg, 8)
        assert set(compose.active(cfg)) == {*features, "multiprocess"}, row
