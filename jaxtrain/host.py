"""This process's host: which platform JAX runs on, how many CPU devices it simulates, how
malloc treats XLA:CPU's buffers, and on NVIDIA GPUs the XLA flags it starts with
(jaxtrain/gpu_flags.py). Called before the JAX backend starts.

On a machine with no accelerator we pin JAX to the CPU (otherwise the CUDA plugin and
libtpu, installed for deviceless compiles, print errors at start) and create as many
simulated CPU devices as the mesh needs.

The CPU heap. XLA:CPU takes each execution's temporary and output buffers from malloc.
glibc serves a block over its mmap threshold (32 MiB at most), and any block a thread's own
arena (64 MiB heaps) cannot hold, with a fresh `mmap`, and unmaps it when it is freed, so
every step the kernel maps, zero-fills and faults in the same hundreds of MiB again (on the
bench-peer step about 200,000 page faults and 0.4 s of system time per step). Three
`mallopt` settings keep that memory in one heap that is reused from step to step:

- `M_ARENA_MAX=1`: every thread allocates from the main (brk) arena, which can grow
  without limit, instead of per-thread arenas that fall back to mmap for big blocks;
- `M_MMAP_MAX=0`: no block is served by its own mmap;
- `M_TRIM_THRESHOLD` at its maximum: free memory at the top of the heap is not returned.

The cost is that resident memory stays at its high-water mark. The measured benefit is on
the docs' CPU page. They are set in this process, for CPU runs only (device memory on TPU
and GPU hosts is not malloc's), before the backend starts, and left alone where the user
chose malloc settings already (`MALLOC_*`, these knobs in `GLIBC_TUNABLES`, an allocator in
`LD_PRELOAD` such as tcmalloc or jemalloc, which is the user's deployment choice), outside
glibc, or with `JAXTRAIN_HOST_MALLOC=system` (a value it does not take is refused, not
ignored). The run's log says which applied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import shutil
import sys

from jaxtrain import gpu_flags

OPT_OUT = "JAXTRAIN_HOST_MALLOC"
SYSTEM_VALUES = ("system", "off", "0")  # keep glibc's defaults
TUNED_VALUES = ("tuned", "on", "1")  # the settings below (also what unset means)
# (mallopt(3) parameter number from glibc's malloc.h, the same knob's environment variable,
# value): one table for both ways of setting them
_TABLE = (
    (-8, "MALLOC_ARENA_MAX", 1),  # M_ARENA_MAX
    (-4, "MALLOC_MMAP_MAX_", 0),  # M_MMAP_MAX
    (-1, "MALLOC_TRIM_THRESHOLD_", 2**31 - 1),  # M_TRIM_THRESHOLD
    (-2, "MALLOC_TOP_PAD_", 64 << 20),  # M_TOP_PAD
)
SETTINGS = tuple((param, value) for param, _, value in _TABLE)
# The same settings as environment variables, which glibc reads at process start: for a
# process we do not start ourselves (benchmarks/throughput.py gives them to the peer trainer).
ENVIRONMENT = {name: str(value) for _, name, value in _TABLE}
_KNOBS = ("arena_max", "arena_test", "mmap_max", "mmap_threshold", "trim_threshold", "top_pad")

_heap_note: str | None = None


class UnknownSettingError(ValueError):
    """OPT_OUT holds a value that is neither an opt-out nor an opt-in (a typo, say)."""


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_nvidia_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def has_accelerator() -> bool:
    """A cheap look for TPU or NVIDIA devices, without starting a JAX backend."""
    return _has_tpu() or _has_nvidia_gpu()


def runs_on_cpu() -> bool:
    """Whether this process will run XLA on the CPU (as configure_host will pin it)."""
    chosen = os.environ.get("JAX_PLATFORMS")
    return chosen == "cpu" if chosen else not has_accelerator()


def runs_on_nvidia_gpu() -> bool:
    """Whether this process will run XLA on NVIDIA GPUs: JAX_PLATFORMS names cuda or gpu, or
    is unset on a host with NVIDIA devices and no TPU."""
    chosen = os.environ.get("JAX_PLATFORMS")
    if chosen:
        return chosen.split(",")[0] in ("cuda", "gpu")
    return not _has_tpu() and _has_nvidia_gpu()


def _backend_started() -> bool:
    # sys.modules: only ask JAX when it is already imported (this runs before it is)
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def configure_host(num_cpu_devices: int | None = None) -> None:
    """Pin to CPU when no accelerator is present, tune the CPU heap, set the CPU device count.

    Safe to call more than once; once a backend is running it changes nothing (the caller
    then checks the device count against the mesh instead). Raises UnknownSettingError for
    a JAXTRAIN_HOST_MALLOC value it does not take."""
    if "JAX_PLATFORMS" not in os.environ and runs_on_cpu():
        os.environ["JAX_PLATFORMS"] = "cpu"
    if os.environ.get("JAX_PLATFORMS") == "cpu" and not _backend_started():
        keep_freed_memory()  # before XLA's threads take their malloc arenas
    elif runs_on_nvidia_gpu() and not _backend_started():
        gpu_flags.apply()  # XLA reads XLA_FLAGS once, when the backend starts
    # jax is imported here, after the platform is chosen: importing it earlier starts nothing,
    # but the CLI's light commands (tokenize, config errors) never need it
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    flags = os.environ.get("XLA_FLAGS", "")
    if num_cpu_devices and "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))


def _choice() -> str:
    """OPT_OUT's value, lower-cased ("" when unset); a value it does not take is an error."""
    choice = os.environ.get(OPT_OUT, "").lower()
    if choice and choice not in SYSTEM_VALUES + TUNED_VALUES:
        raise UnknownSettingError(
            f"{OPT_OUT}={os.environ[OPT_OUT]!r}: expected one of {', '.join(SYSTEM_VALUES)} (keep glibc's "
            f"malloc defaults) or {', '.join(TUNED_VALUES)} (the tuned heap; also the default when unset)"
        )
    return choice


def _user_chose() -> str | None:
    """Which of the user's own malloc settings win, or None. A misspelt OPT_OUT is an error,
    not a silent default: `sytem` must not quietly keep the tuned heap."""
    choice = _choice()
    if choice in SYSTEM_VALUES:
        return f"{OPT_OUT}={choice}"
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{knob}" in tunables for knob in _KNOBS):  # hugetlb=1 alone combines
        chosen.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc
        chosen.append(f"LD_PRELOAD={os.environ['LD_PRELOAD']}")
    return ", ".join(chosen) or None


def _linux_glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> str | None:
    """Apply SETTINGS once per process (module docstring); returns the log line saying what
    the heap is, or None outside glibc. Raises UnknownSettingError for an OPT_OUT value it
    does not know."""
    global _heap_note
    if _heap_note is not None:
        return _heap_note
    user = _user_chose()
    if user:
        _heap_note = f"host malloc: left as chosen ({user})"
        return _heap_note
    if not _linux_glibc():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
    except (OSError, AttributeError) as e:
        _heap_note = f"host malloc: glibc's defaults (mallopt failed: {e})"
        return _heap_note
    _heap_note = (
        "host malloc: one glibc arena that keeps freed memory (no mmap, no trim), so XLA:CPU's "
        f"buffers are reused across steps instead of faulted in again; {OPT_OUT}=system to opt out"
        if ok
        else "host malloc: glibc's defaults (mallopt refused the settings)"
    )
    return _heap_note


def note() -> str | None:
    """The heap's (CPU) or the GPU flags' log line if configure_host set one up in this
    process, else None."""
    return _heap_note or gpu_flags.note()
