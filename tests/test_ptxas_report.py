"""The parser of ptxas' logs (pallas_kernels/ptxas_report.py) on a log ptxas wrote: the
deviceless H100 compile of flash_mgpu's head_dim-256 backward before its dK/dV kernel split
its accumulators (jaxlib 0.12.0.1), two kernels in one stream."""

# ruff: noqa: E501 (the log as ptxas wrote it)

from __future__ import annotations

from jaxtrain.pallas_kernels.ptxas_report import _entries, parse_ptxas_log

LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : Compile time = 845.113 ms
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'flash_dkv_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function 'flash_dkv_mosaic_gpu_kernel', 4120 bytes spill stores, 3660 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_dkv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_dkv_mosaic_gpu_kernel
    1656 bytes stack frame, 4120 bytes spill stores, 3660 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1656 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 1918.861 ms
"""


def test_each_kernel_gets_its_own_figures_and_warnings():
    kernels = [parse_ptxas_log(name, part) for name, part in _entries(LOG)]
    assert [k.name for k in kernels] == ["flash_fwd", "flash_dkv"]
    fwd, dkv = kernels
    assert (fwd.registers, fwd.spill_store_bytes, fwd.spill_load_bytes, fwd.stack_bytes) == (168, 0, 0, 0)
    assert not fwd.spills and not fwd.wgmma_serialized
    assert (dkv.spill_store_bytes, dkv.spill_load_bytes, dkv.stack_bytes) == (4120, 3660, 1656)
    assert dkv.spills and dkv.wgmma_serialized
    assert "wgmma serialised" in dkv.line() and "4120 B" in dkv.line()
