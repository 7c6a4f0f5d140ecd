"""Choose the JAX platform and simulated CPU device count before the backend starts.

On a machine with no accelerator we pin JAX to the CPU (otherwise the CUDA
plugin and libtpu, installed for deviceless compiles, print errors at start)
and create as many simulated CPU devices as the mesh needs. A CPU run also gets
a host allocator that reuses XLA's buffers across steps (jaxtrain/host_malloc.py:
tcmalloc preloaded by the CLI, else glibc malloc settings).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

from jaxtrain import host_malloc


def has_accelerator() -> bool:
    """A cheap look for TPU or NVIDIA devices, without starting a JAX backend."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def runs_on_cpu() -> bool:
    """Whether this process will run XLA on the CPU (as configure_host will pin it)."""
    chosen = os.environ.get("JAX_PLATFORMS")
    return chosen == "cpu" if chosen else not has_accelerator()


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def configure_host(num_cpu_devices: int | None = None) -> None:
    """Pin to CPU when no accelerator is present and set the CPU device count.

    Safe to call more than once; once a backend is running it changes nothing
    (the caller then checks the device count against the mesh instead).
    """
    if "JAX_PLATFORMS" not in os.environ and runs_on_cpu():
        os.environ["JAX_PLATFORMS"] = "cpu"
    if os.environ.get("JAX_PLATFORMS") == "cpu" and not _backend_started():
        host_malloc.keep_freed_memory()  # before XLA's threads take their malloc arenas
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    flags = os.environ.get("XLA_FLAGS", "")
    if num_cpu_devices and "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))
