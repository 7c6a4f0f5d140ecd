"""Kill -9 mid-run and rerun, with float16 loss scaling and with fp8 delayed scaling: the
resumed run continues exactly as an uninterrupted one (metrics bit for bit, and the
final loss scale / fp8 amax histories and scales in the last checkpoint bit for bit),
because that state is part of the checkpointed train state."""

import os
import re
import signal

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.test_checkpoint_kill import finish, records, start, wait_for

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring"),
]
STEPS = 20
PRECISIONS = {
    # 2^24 overflows on the tiny model: the scale changes (backs off) during the run
    "fp16": ("model.compute_dtype=float16", f"optimizer.loss_scale.init={2**24}"),
    "fp8": ("model.compute_dtype=bfloat16", "model.fp8=true", "model.fp8_amax_history=8"),
}
COMPARED = ("loss", "grad_norm", "lr", "skipped_total")


def run_args(*extra):
    return (
        f"train.steps={STEPS}",
        "train.seq_len=64",
        "checkpoint.every=5",
        "checkpoint.async_save=false",
        *extra,
    )


def final_state(out_dir):
    state = ocp.PyTreeCheckpointer().restore(os.path.join(out_dir, "checkpoints", str(STEPS), "state"))
    return {k: state[k] for k in ("loss_scale", "fp8", "params")}


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_kill_9_and_rerun_is_bit_identical(tmp_path, precision):
    extra = run_args(*PRECISIONS[precision])
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    code, _, err = finish(start(ref_dir, *extra))
    assert code == 0, err[-3000:]
    # fp16: the logged loss scale and overflow count too (they resume with the state)
    compared = COMPARED + (("loss_scale", "loss_scale_overflows") if precision == "fp16" else ())
    reference = {r["step"]: tuple(r[k] for k in compared) for r in records(ref_dir)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    proc = start(run_dir, *extra)
    wait_for(lambda: any(r["step"] >= 12 for r in records(run_dir)), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    reached = max(r["step"] for r in records(run_dir))
    assert reached < STEPS, "the run finished before the kill"
    code, out, err = finish(start(run_dir, *extra))
    assert code == 0, err[-3000:]
    resumed = int(re.search(r"resumed from step (\d+)", out).group(1))
    assert resumed <= reached and resumed % 5 == 0, out
    rows = records(run_dir)
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))
    for r in rows:
        assert tuple(r[k] for k in compared) == reference[r["step"]], (r, reference[r["step"]])

    ref, got = final_state(ref_dir), final_state(run_dir)
    key = "loss_scale" if precision == "fp16" else "fp8"
    assert ref[key] is not None
    if precision == "fp16":
        assert int(ref[key]["overflows"]) > 0  # the scale did change during the run
    a, b = _flatten(ref), _flatten(got)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix: np.asarray(tree)} if tree is not None else {}
