"""Compile-only ("deviceless") TPU and GPU devices, and helpers to read compiled programs.

With ``libtpu`` (the ``jax[tpu]`` extra) or ``jax-cuda12-plugin`` installed, a
CPU-only host can build compile-only devices for a TPU slice or an H100 node,
lay a ``Mesh`` over them and run ``jit(f).lower(...).compile()`` through the
real TPU / XLA:GPU (+ Triton) compiler. Nothing can run on these devices; the
compiled program reports memory (``memory_analysis()``) and, on TPU, cost
(``cost_analysis()``).

Run such processes with ``JAX_PLATFORMS=cpu`` (for GPU targets this is
required: without it the CUDA plugin tries to load cuDNN and drops out).

This module imports only jax and numpy (and the stdlib-only hardware table).
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies

from jaxtrain.sharding import hardware

__all__ = [
    "A100_SXM_TARGET_CONFIG",
    "H100_SXM_TARGET_CONFIG",
    "DevicelessUnavailableError",
    "compiled_cost",
    "compiled_memory",
    "custom_call_targets",
    "a100_devices",
    "h100_devices",
    "has_custom_call",
    "tpu_available",
    "cuda_available",
    "tpu_topology_devices",
]

# GpuTargetConfigProto (text format) for one H100 SXM 80GB: XLA's upstream
# h100_sxm.txtpb. Embedded so the package does not read files at run time; the
# memory size comes from the hardware table (sharding/hardware.py).
H100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: HBM_BYTES
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
""".replace("HBM_BYTES", str(hardware.chip("h100").hbm_bytes))


# The same for one A100 SXM 80GB (compute capability 8.0, 108 SMs, 164 KiB opt-in
# shared memory per block, 40 MB L2, 2.04 TB/s); memory size from the hardware table.
A100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 166912
  shared_memory_per_core: 167936
  threads_per_core_limit: 2048
  core_count: 108
  fpus_per_core: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 2039000000000
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  device_memory_size: HBM_BYTES
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 8 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA A100-SXM4-80GB"
""".replace("HBM_BYTES", str(hardware.chip("a100").hbm_bytes))


class DevicelessUnavailableError(RuntimeError):
    """The compiler plugin for a deviceless target is not installed or not usable."""


def tpu_available() -> bool:
    """Whether libtpu is importable (deviceless TPU compiles possible)."""
    return importlib.util.find_spec("libtpu") is not None


def cuda_available() -> bool:
    """Whether the JAX CUDA PJRT plugin is importable (deviceless GPU compiles possible)."""
    return (
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
        or importlib.util.find_spec("jax_cuda12_plugin") is not None
    )


def tpu_topology_devices(
    topology_name: str = "v5p:2x2x2",
    chip_config_name: str = "megacore",
    chips_per_host_bounds: tuple[int, int, int] = (2, 2, 1),
    num_slices: int = 1,
    wrap: tuple[bool, ...] | None = None,
) -> list[Any]:
    """Compile-only TPU devices for ``topology_name`` (e.g. ``"v5p:2x2x2"`` = 8 chips).

    Raises DevicelessUnavailableError when libtpu is missing.
    """
    if not isinstance(topology_name, str) or ":" not in topology_name:
        raise ValueError(f"topology_name must look like 'v5p:2x2x2', got {topology_name!r}")
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    if not tpu_available():
        raise DevicelessUnavailableError(
            "deviceless TPU compiles need libtpu: pip install 'jax[tpu]' (the 'tpu' extra of this project)"
        )
    # libtpu takes a machine-wide lock file unless told otherwise; compile-only use
    # never touches a chip, so let several processes (tests, benchmarks) load it.

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology_name,
            chip_config_name=chip_config_name,
            chips_per_host_bounds=tuple(chips_per_host_bounds),
            num_slices=num_slices,
            **({} if wrap is None else {"wrap": tuple(wrap)}),
        )
    except Exception as e:  # libtpu reports bad names as generic errors
        raise DevicelessUnavailableError(
            f"could not build TPU topology {topology_name!r} "
            f"(chip_config_name={chip_config_name!r}, "
            f"chips_per_host_bounds={chips_per_host_bounds}): {e}"
        ) from e
    return list(topo.devices)


def a100_devices(num_hosts: int = 1, gpus_per_host: int = 8) -> list[Any]:
    """Compile-only A100 SXM 80GB devices: ``num_hosts`` x ``gpus_per_host`` GPUs."""
    return h100_devices(num_hosts, gpus_per_host, target_config=A100_SXM_TARGET_CONFIG)


def h100_devices(
    num_hosts: int = 1, gpus_per_host: int = 8, *, target_config: str = H100_SXM_TARGET_CONFIG
) -> list[Any]:
    """Compile-only H100 SXM devices: ``num_hosts`` x ``gpus_per_host`` GPUs.

    ``target_config`` (a GpuTargetConfigProto in text format) picks another GPU
    (see ``a100_devices``). Needs jax-cuda12-plugin and JAX_PLATFORMS=cpu (see
    module docstring). Raises DevicelessUnavailableError when the plugin is
    missing or unusable.
    """
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    if gpus_per_host < 1:
        raise ValueError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
    if not cuda_available():
        raise DevicelessUnavailableError(
            "deviceless GPU compiles need the CUDA PJRT plugin: pip install "
            "jax-cuda12-plugin jax-cuda12-pjrt (the 'gpu-aot' extra of this project)"
        )

    try:
        topo = topologies.get_topology_desc(
            platform="cuda",
            topology=f"{num_hosts}x1x{gpus_per_host}",
            target_config=target_config,
        )
    except Exception as e:
        raise DevicelessUnavailableError(
            "could not build a compile-only H100 topology (is JAX_PLATFORMS=cpu "
            f"set? the CUDA plugin drops out without it): {e}"
        ) from e
    return list(topo.devices)


def compiled_memory(compiled: Any) -> dict[str, int]:
    """Per-device byte counts from ``compiled.memory_analysis()``.

    Keys: argument, output, alias, temp, generated_code, total (= argument +
    output - alias + temp), and the same for host memory (host_argument, ...,
    host_total: pinned_host buffers). Missing fields read as 0.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("compiled.memory_analysis() returned None for this backend")
    if isinstance(stats, (list, tuple)):
        stats = stats[0]
    get = lambda name: int(getattr(stats, name, 0) or 0)
    out = {
        "argument": get("argument_size_in_bytes"),
        "output": get("output_size_in_bytes"),
        "alias": get("alias_size_in_bytes"),
        "temp": get("temp_size_in_bytes"),
        "generated_code": get("generated_code_size_in_bytes"),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    # Host (pinned_host memory kind) buffers: optimizer.offload state, offloaded remat.
    for kind in ("argument", "output", "alias", "temp"):
        out[f"host_{kind}"] = get(f"host_{kind}_size_in_bytes")
    out["host_total"] = out["host_argument"] + out["host_output"] - out["host_alias"] + out["host_temp"]
    return out


def compiled_cost(compiled: Any) -> dict[str, float] | None:
    """``compiled.cost_analysis()`` as a flat dict (None where unavailable, e.g. GPU).

    Common keys: 'flops', 'transcendentals', 'bytes accessed', and on TPU
    'optimal_seconds' (XLA's estimate of run time, not a measurement).
    """
    try:
        cost = compiled.cost_analysis()
    except (jax.errors.JaxRuntimeError, NotImplementedError):  # a backend without cost analysis
        return None
    if cost is None:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
        if cost is None:
            return None
    return {str(k): float(v) for k, v in cost.items() if isinstance(v, (int, float, np.floating, np.integer))}


def custom_call_targets(compiled_text: str) -> set[str]:
    """The custom-call target names appearing in optimized HLO text."""
    return set(re.findall(r'custom_call_target="([^"]+)"', compiled_text))


def kernel_names(compiled_text: str) -> set[str]:
    """Names of the kernel calls (Mosaic TPU, Triton) in optimized HLO text, without their
    .N suffixes: "gmm", "splash_mha_fwd...", and XLA's own "ragged-dot-none" (XLA:TPU runs
    ragged_dot as a Mosaic kernel too, so the target alone does not say whose it is)."""
    names = set()
    for line in compiled_text.splitlines():
        if ("tpu_custom_call" in line or "triton" in line) and " = " in line:
            match = re.match(r"\s*(?:ROOT\s+)?%?([A-Za-z_][\w-]*?)(?:\.\d+)*\s*=", line)
            if match:
                names.add(match.group(1))
    return names


def has_custom_call(compiled_text: str, name_substring: str) -> bool:
    """Whether the optimized HLO text holds a custom call whose target contains ``name_substring``.

    Pallas kernels appear as ``tpu_custom_call`` (Mosaic TPU) and
    ``__gpu$xla.gpu.triton`` (Triton).
    """
    return any(name_substring in t for t in custom_call_targets(compiled_text))
