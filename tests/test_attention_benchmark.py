"""benchmarks/attention.py without Tokamax, and its table cells.

Tokamax is an optional extra (``bench``): without it the benchmark must still
compile the other kernels and say in Tokamax's columns how to install it. The
deviceless case compiles one small kernel (jax's upstream Pallas TPU flash at
seq 1024), so it needs libtpu and takes seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

from benchmarks import attention  # noqa: E402
from jaxtrain.sharding import targets  # noqa: E402


def test_cells_name_skips_and_footnote_failures():
    notes = attention.Notes()
    oom = {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED: CompileTimeHbmOom: 120G of 95G", "seconds": 1.0}
    other = {"error": "NotImplementedError: Only supported for sm80, sm90 and sm100 GPUs.", "seconds": 1.0}
    assert attention.mem_cell(oom, notes) == "out of memory [1]"
    assert attention.mem_cell(other, notes) == "fails [2]"
    assert attention.mem_cell(oom, notes) == "out of memory [1]"  # one note per message
    assert notes.texts == [oom["error"], other["error"]]
    assert attention.mem_cell({"memory": {"temp": 3 * 2**30 // 2}}, notes) == "1.50 GiB"
    assert attention.mem_cell({"memory": {"temp": 225 * 2**20}}, notes) == "225 MiB"
    gpu_only = attention.KERNELS["tokamax-triton"]
    assert attention.skip_reason(gpu_only, "tpu") == "n/a (H100 only)"
    assert attention.skip_reason(gpu_only, "gpu") in (None, f"tokamax not installed: {attention.TOKAMAX_PIP}")


@pytest.mark.deviceless
def test_runs_without_tokamax(monkeypatch, capsys):
    if not targets.tpu_available():
        pytest.skip("libtpu not installed")
    monkeypatch.setattr(attention, "tokamax_available", lambda: False)
    argv = ["--seqs", "1024", "--targets", "tpu", "--kernels", "tokamax,upstream", "--chunks", "1"]
    rc = attention.main(argv)
    assert rc == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1024 | "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"tokamax not installed: {attention.TOKAMAX_PIP}"
    assert cells[2].endswith("MiB"), cells  # upstream still compiled


def test_gpu_timing_counts_attended_pairs_and_checks_errors():
    """benchmarks/attention_gpu.py (`attention.py --gpu`): its FLOP count is the number of allowed
    (query, key) pairs (counted here from the mask itself), and on CPU its check path compares
    our interpreted kernel with the f32 XLA reference, while a column this device lacks is a row
    saying why."""
    import argparse

    import numpy as np

    from benchmarks import attention_gpu

    for seq, window in [(7, None), (7, 3), (16, 16), (16, 20), (33, 5)]:
        i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
        allowed = (j <= i) & ((j > i - window) if window else True)
        assert attention_gpu.attended_pairs(seq, window) == allowed.sum(), (seq, window)

    args = argparse.Namespace(iters=1, check=True, xla_max_seq=8192)
    rows = attention_gpu.run_case("tiny-win", attention_gpu.TINY["tiny-win"], ["triton", "cudnn"], args)
    ours, cudnn = rows
    assert max(ours[k] for k in ("err_out", "err_dq", "err_dk", "err_dv")) < 2e-2, ours
    assert ours["fwd_bwd_tflops"] > 0
    assert "error" in cudnn and "fwd_s" not in cudnn
    lines = attention_gpu.table(rows).splitlines()
    assert lines[2].startswith("| tiny-win | 1, 256, 2, 1, 64 | 64 | triton |")
    assert lines[3].startswith("| tiny-win | 1, 256, 2, 1, 64 | 64 | cudnn | NotImplementedError")


def test_gpu_check_reads_every_batch_row_and_head_of_the_timed_calls():
    """`attention.py --gpu --check` (what benchmarks/gpu_session.sh reads before it trusts the
    Hopper kernel) compares the whole output and gradients of the calls it then times. Oracle:
    XLA's own bf16 attention is within bf16's tolerance of the f32 reference, and the same with
    batch row 1's last query head (kv head 1's group) scaled by 1.25 is not: a fault the former
    check, batch row 0 and the first kv head's group only, could not see. Our Triton kernel
    (interpreted) passes at two batch rows and two kv heads with groups of 4."""
    import argparse

    import jax
    import jax.numpy as jnp

    from benchmarks import attention_gpu

    shape = attention_gpu.TINY["tiny-gqa"]
    q, k, v, cot = attention_gpu._inputs(*shape[:5])
    exact = attention_gpu.implementation("xla", None, on_cpu=True)
    scaled = jnp.ones(q.shape[:3] + (1,), q.dtype).at[1, :, -1].set(1.25)
    faulty = lambda q, k, v: exact(q, k, v) * scaled

    def errors(f):
        return attention_gpu.check_errors(jax.jit(f), attention_gpu.gpu_peer.fwd_bwd(f), q, k, v, cot, None)

    good, bad = errors(exact), errors(faulty)
    assert set(good) == {"err_out", "err_dq", "err_dk", "err_dv"}
    assert max(good.values()) < 2e-2, good
    assert bad["err_out"] > 0.05 and bad["err_dq"] > 0.05, bad

    args = argparse.Namespace(iters=1, check=True, xla_max_seq=8192)
    (row,) = attention_gpu.run_case("tiny-gqa", shape, ["triton"], args)
    assert max(row[k] for k in good) < 2e-2, row
