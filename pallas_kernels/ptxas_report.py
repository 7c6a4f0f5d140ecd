"""What ptxas says about each Mosaic GPU kernel a compile builds: registers, spills, and
whether wgmma had to be serialised. Works in deviceless compiles, so on a machine without a GPU.

Why: a Hopper kernel whose accumulators do not fit the registers its warpgroup asks for
(``plgpu.set_max_registers``) spills them to local memory, and ptxas then also serialises the
asynchronous wgmma instructions (its warning C7512). That costs more than any tile choice: the
head_dim-256 backward of ``flash_mgpu`` ran 12x slower than its forward on an H100 while
ptxas reported both. jaxlib compiles Mosaic GPU kernels to cubins itself (PTX through its own
ptxas library), also for a deviceless target, and prints ptxas' log to its standard output when
``MOSAIC_GPU_DUMP_PTXAS`` is set (``jaxlib/mosaic/gpu/dump.cc``; ``MOSAIC_GPU_DUMP_TO`` would
also write every MLIR pass, 100 MB a kernel). jaxlib's C++ reads the variable at each kernel's
compile, so this module sets it around one compile, catches file descriptor 1 and parses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax

__all__ = ["KernelResources", "mosaic_kernel_resources", "parse_ptxas_log"]

_ENV = "MOSAIC_GPU_DUMP_PTXAS"  # without MOSAIC_GPU_DUMP_TO: the log alone, on stdout


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One kernel's ptxas figures. ``name`` is the kernel body's function name
    (``flash_dq``)."""

    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    wgmma_serialized: bool

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)

    def line(self) -> str:
        flags = " (wgmma serialised)" if self.wgmma_serialized else ""
        return (
            f"{self.name}: {self.registers} registers, spill stores {self.spill_store_bytes} B, "
            f"spill loads {self.spill_load_bytes} B{flags}"
        )


def parse_ptxas_log(name: str, text: str) -> KernelResources:
    """The figures of one ptxas ``-v`` log (one entry function)."""
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    if spill is None or regs is None:
        raise ValueError(f"{name}: no register or spill figures in the ptxas log:\n{text}")
    stack, stores, loads = (int(x) for x in spill.groups())
    return KernelResources(
        name=name,
        registers=int(regs.group(1)),
        spill_store_bytes=stores,
        spill_load_bytes=loads,
        stack_bytes=stack,
        wgmma_serialized="C7512" in text,
    )


@contextlib.contextmanager
def _stdout_to(path: Path) -> Iterator[None]:
    """File descriptor 1 (where jaxlib's C++ prints the logs) into ``path``."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _entries(text: str) -> list[tuple[str, str]]:
    """(kernel name, its part of the log) for each entry function ptxas compiled: a kernel's
    log (its warnings first) ends with its "Compile time" line."""
    out = []
    for block in re.split(r"(?<=Compile time = )[^\n]*\n", text):
        m = re.search(r"Compiling entry function '([^']+)'", block)
        if m:
            out.append((m.group(1).removesuffix("_mosaic_gpu_kernel"), block))
    return out


def mosaic_kernel_resources(compile_fn: Callable[[], object]) -> list[KernelResources]:
    """Runs ``compile_fn`` (which must compile, e.g. ``jax.jit(f).lower(...).compile()``, for a
    GPU target, deviceless or not) with ptxas' logs on, and returns one entry per Mosaic GPU
    kernel compiled, in compile order. The persistent compilation cache is off meanwhile (an
    executable loaded from it compiles no kernel)."""
    old, old_cache = os.environ.get(_ENV), jax.config.jax_enable_compilation_cache
    os.environ[_ENV] = "1"
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with tempfile.TemporaryDirectory(prefix="ptxas-") as tmp:
            log = Path(tmp) / "stdout"
            with _stdout_to(log):
                compile_fn()
            text = log.read_text(errors="replace")
    finally:
        jax.config.update("jax_enable_compilation_cache", old_cache)
        if old is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = old
    return [parse_ptxas_log(name, part) for name, part in _entries(text)]
