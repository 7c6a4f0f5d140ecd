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
`LD_PRELOAD`), outside glibc, or with `JAXTRAIN_HOST_MALLOC=system` (a value it does not
take is refused, not ignored).
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (transparent huge pages for the heap; glibc
reads it only at process start) combines with them.

One glibc arena fragments, though: on bench-peer its heap grew from 1.8 to 4-5 GiB over
the first tens of steps, and each growth faulted pages in again. gperftools' tcmalloc
keeps freed blocks by size instead, which is what XLA's same-sized buffers step after
step want: 1.76 GiB flat, no page faults, and the bf16 step 4-5% faster (README.md, *Host
memory on CPU*). An allocator must be preloaded before the process starts, so the CLI
(`python -m jaxtrain`, the `jaxtrain` script) re-executes itself once with tcmalloc in
`LD_PRELOAD` when it runs on the CPU and finds the library (`preload_tcmalloc`): the copy
`make venv` puts in the virtual environment (Debian's libtcmalloc-minimal4, see
.ci/fetch_tcmalloc.sh) or a system one. Without it, or in a process that did not start
through the CLI (tests, notebooks, `jaxtrain.trainer.train` from Python), the glibc
settings above apply. `JAXTRAIN_HOST_MALLOC=glibc` asks for the glibc settings only,
`tcmalloc` for tcmalloc (an error where it is not found).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path

OPT_OUT = "JAXTRAIN_HOST_MALLOC"
# OPT_OUT's values: keep glibc's defaults; the best the host has (tcmalloc where the CLI
# finds it, else the glibc settings; also what unset means); only the glibc settings;
# only tcmalloc
SYSTEM_VALUES = ("system", "off", "0")
TUNED_VALUES = ("tuned", "on", "1")
GLIBC_VALUES = ("glibc",)
TCMALLOC_VALUES = ("tcmalloc",)
# Where the CLI looks for tcmalloc, in order: the virtual environment's copy (make venv),
# then the system's (Debian/Ubuntu libtcmalloc-minimal4 or libgoogle-perftools4, RHEL
# gperftools-libs)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
VENV_DIR = Path(sys.prefix) / "lib" / "jaxtrain-host"
SYSTEM_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
# Set in the re-executed process: the library the CLI preloaded (and no second re-exec)
PRELOADED = "JAXTRAIN_TCMALLOC_PRELOADED"
# gperftools reports every allocation over 1 GiB on stderr by default; a large model's
# host buffers are routinely that big
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**40)}
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


def _choice() -> str:
    """OPT_OUT's value, lower-cased ("" when unset); a value it does not take is an error."""
    choice = os.environ.get(OPT_OUT, "").lower()
    known = SYSTEM_VALUES + TUNED_VALUES + GLIBC_VALUES + TCMALLOC_VALUES
    if choice and choice not in known:
        raise UnknownSettingError(
            f"{OPT_OUT}={os.environ[OPT_OUT]!r}: expected one of {', '.join(SYSTEM_VALUES)} (keep glibc's "
            f"malloc defaults), {', '.join(TUNED_VALUES)} (tcmalloc where the CLI finds it, else the tuned "
            f"glibc heap; also the default when unset), {', '.join(GLIBC_VALUES)} (the tuned glibc heap "
            f"only) or {', '.join(TCMALLOC_VALUES)} (tcmalloc only)"
        )
    return choice


def _user_chose() -> str | None:
    """Why the user's own settings win, or None. A misspelt OPT_OUT is an error, not a
    silent default: `sytem` must not quietly keep the tuned heap."""
    choice = _choice()
    if choice in SYSTEM_VALUES:
        return f"{OPT_OUT}={choice}"
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{knob}" in tunables for knob in _KNOBS):  # hugetlb=1 alone combines
        chosen.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc, mimalloc
        chosen.append("LD_PRELOAD")
    return ", ".join(chosen) or None


def _linux_glibc() -> bool:
    """Whether this process runs on Linux with glibc, where both the mallopt settings and
    the tcmalloc preload apply."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> str | None:
    """Apply SETTINGS once per process; returns the log line saying so, or None when
    they do not apply (not glibc, or the user's own malloc settings). Raises
    UnknownSettingError for an OPT_OUT value it does not know."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(PRELOADED) and _loaded(os.environ[PRELOADED]):
        _applied = (
            f"host malloc: tcmalloc ({os.environ[PRELOADED]}), preloaded by the CLI, keeps XLA:CPU's "
            f"freed buffers by size for the next step; {OPT_OUT}=glibc or =system to opt out"
        )
        return _applied
    if _user_chose() or not _linux_glibc():
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


def _loaded(library: str) -> bool:
    """Whether `library` is mapped into this process (so it is the allocator in use)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return os.path.realpath(library) in maps or library in maps


def find_tcmalloc() -> str | None:
    """The path of a tcmalloc library to preload, or None: the virtual environment's copy
    first, then the system's."""
    for directory in (VENV_DIR, *map(Path, SYSTEM_DIRS)):
        for name in TCMALLOC_NAMES:
            if (directory / name).is_file():
                return str(directory / name)
    return None


def environment() -> dict[str, str]:
    """The environment that gives a process we do not start ourselves (benchmarks/throughput.py's
    peer trainer) the allocator a CLI run of ours gets: tcmalloc preloaded where it is found,
    else the glibc settings as variables."""
    library = find_tcmalloc()
    return {**_QUIET, "LD_PRELOAD": library} if library else dict(ENVIRONMENT)


def preload_tcmalloc(cpu: bool) -> None:
    """Re-execute this process (a CLI start) with tcmalloc preloaded, when it will run XLA on
    the CPU (`cpu`), the user made no malloc choice of their own, and the library is found.
    Returns without doing anything otherwise; does not return when it re-executes. Raises
    UnknownSettingError for an OPT_OUT value it does not know, or `tcmalloc` asked for and
    not found."""
    choice = _choice()
    if os.environ.get(PRELOADED) or not cpu or choice in GLIBC_VALUES or _user_chose() or not _linux_glibc():
        return
    library = find_tcmalloc()
    if library is None:
        if choice in TCMALLOC_VALUES:
            where = ", ".join(str(d) for d in (VENV_DIR, *SYSTEM_DIRS))
            raise UnknownSettingError(
                f"{OPT_OUT}={os.environ[OPT_OUT]!r}: no tcmalloc library ({' or '.join(TCMALLOC_NAMES)}) "
                f"in {where}; `make venv` fetches one, or install libtcmalloc-minimal4"
            )
        return
    preload = os.environ.get("LD_PRELOAD", "")
    preload = f"{library}:{preload}" if preload else library
    env = {**_QUIET, **os.environ, PRELOADED: library, "LD_PRELOAD": preload}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
