"""benchmarks/moe_gpu.py (`moe.py --gpu`): its grouped-matmul section on CPU with tiny shapes.

Oracle: `jax.lax.ragged_dot` in f32 (output, dA and dW), which the section itself reports
against; the tiles a `triton+key=value` column names reach the kernel (a stand-in kernel
records them), and bad tiles are refused before any child process starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from benchmarks import moe_gpu  # noqa: E402
from jaxtrain.pallas_kernels import grouped_matmul_gpu  # noqa: E402


def test_each_column_agrees_with_ragged_dot_in_output_and_both_gradients():
    tiled = "triton+block_m=64+block_n=64+tgmm_m=32"
    result = moe_gpu.matmul_worker(tiny=True, iters=1, impls=["triton", tiled])
    rows = [r for r in result["rows"] if r["impl"] != "dense einsum"]
    assert len(rows) == 4 and not any("failed" in r for r in rows), rows
    for r in rows:  # bf16 outputs against f32 sums
        assert max(r["error"], r["error_da"], r["error_dw"]) < 1e-2, r
    table = moe_gpu.matmul_table(result)
    assert f"| 128 x 128 | skewed | {tiled} |" in table


def test_a_tiled_column_runs_the_triton_kernel_with_its_tiles(monkeypatch):
    seen = []
    monkeypatch.setattr(
        grouped_matmul_gpu, "triton_grouped_matmul", lambda a, w, gs, *, full, blocks: seen.append(blocks)
    )
    moe_gpu.grouped("triton+block_n=256+num_stages=4")(None, None, None)
    assert seen == [grouped_matmul_gpu.GroupedMatmulBlocks(block_n=256, num_stages=4)]


@pytest.mark.parametrize(
    "impls,only,message",
    [
        ("triton+block_x=4", "matmul", "unexpected keyword argument 'block_x'"),
        ("triton+block_n=100", "matmul", "block_n must be a power of two >= 16, got 100"),
        ("mosaic+block_n=128", "matmul", "only triton takes tiles"),
        ("triton+block_n=256", "matmul,step", "tiles are for the matmul section"),
        ("cutlass", "matmul", "unknown ['cutlass']"),
    ],
)
def test_bad_columns_are_refused_by_name(impls, only, message, capsys):
    with pytest.raises(SystemExit):
        moe_gpu.main(["--gpu", "--only", only, "--impls", impls, "--tiny"])
    assert message in capsys.readouterr().err
