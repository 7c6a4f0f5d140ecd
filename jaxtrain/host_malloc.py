"""Keep freed host memory inside the process when XLA runs on the CPU (glibc malloc).

XLA:CPU takes each execution's temporary and output buffers from malloc. glibc serves a
block over its mmap threshold (32 MiB at most), and any block a thread's own arena (64 MiB
heaps) cannot hold, with a fresh `mmap`, and gives it back with `munmap` when it is freed.
So every train step the kernel maps, zero-fills and faults in the same hundreds of MiB
again: on the bench-peer step (8 simulated devices) that was about 200,000 page faults
and 0.4 s of system time per step. Three settings keep the memory in one heap that is
reused from step to step, as tcmalloc or jemalloc would:

- `M_ARENA_MAX=1`: every thread allocates from the main (brk) arena, which can grow
  without limit, instead of per-thread arenas that fall back to mmap for big blocks;
- `M_MMAP_MAX=0`: no block is served by its own mmap;
- `M_TRIM_THRESHOLD` at its maximum: free memory at the top of the heap is not returned.

The cost is that the process's resident memory stays at its high-water mark: on bench-peer
2.16 GiB in steady state against 1.64-1.76 GiB with glibc's defaults. Measured in README.md,
*Host memory on CPU*.

Applied by `jaxtrain.platform.configure_host` when the run is pinned to the CPU and the
backend has not started yet (XLA's threads take their arena on their first malloc). Not on
TPU and GPU hosts, where device memory is not malloc's. Left alone where the user chose
malloc settings already (`MALLOC_*`, these knobs in `GLIBC_TUNABLES`, or an allocator in
`LD_PRELOAD`), outside glibc, or with `JAXTRAIN_HOST_MALLOC=system` (any other value than
those in SYSTEM_VALUES and TUNED_VALUES is refused).
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (transparent huge pages for the heap; glibc
reads it only at process start) combines with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

OPT_OUT = "JAXTRAIN_HOST_MALLOC"
# OPT_OUT's values: keep glibc's defaults, or apply the settings (unset means apply)
SYSTEM_VALUES = ("system", "off", "0")
TUNED_VALUES = ("tuned", "on", "1")
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
# process we do not control (benchmarks/throughput.py gives them to the peer trainer).
ENVIRONMENT = {name: str(value) for _, name, value in _TABLE}

_KNOBS = ("arena_max", "arena_test", "mmap_max", "mmap_threshold", "trim_threshold", "top_pad")

_applied: str | None = None


class UnknownSettingError(ValueError):
    """OPT_OUT holds a value that is neither an opt-out nor an opt-in (a typo, say)."""


def _user_chose() -> str | None:
    """Why the user's own settings win, or None. A misspelt OPT_OUT is an error, not a
    silent default: `sytem` must not quietly keep the tuned heap."""
    choice = os.environ.get(OPT_OUT, "")
    if choice.lower() in SYSTEM_VALUES:
        return f"{OPT_OUT}={choice}"
    if choice and choice.lower() not in TUNED_VALUES:
        raise UnknownSettingError(
            f"{OPT_OUT}={choice!r}: expected one of {', '.join(SYSTEM_VALUES)} (keep glibc's malloc "
            f"defaults) or {', '.join(TUNED_VALUES)} (the tuned heap, also the default when unset)"
        )
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{knob}" in tunables for knob in _KNOBS):  # hugetlb=1 alone combines
        chosen.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc
        chosen.append("LD_PRELOAD")
    return ", ".join(chosen) or None


def keep_freed_memory() -> str | None:
    """Apply SETTINGS once per process; returns the log line saying so, or None when
    they do not apply (not glibc, or the user's own malloc settings). Raises
    UnknownSettingError for an OPT_OUT value it does not know."""
    global _applied
    if _applied is not None:
        return _applied
    if _user_chose() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
    except (OSError, AttributeError):
        return None
    if not ok:
        return None
    _applied = (
        "host malloc: one glibc arena that keeps freed memory (no mmap, no trim), so XLA:CPU's "
        f"buffers are reused across steps instead of faulted in again; {OPT_OUT}=system to opt out"
    )
    return _applied


def note() -> str | None:
    """The log line if SETTINGS were applied in this process, else None."""
    return _applied
