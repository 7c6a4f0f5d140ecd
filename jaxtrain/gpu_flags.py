"""The XLA:GPU flags a jaxtrain process on NVIDIA GPUs starts with, unless the user set them.

These are the launch settings the GPU anchors use for multi-GPU runs (MaxText's GPU guides,
NVIDIA's JAX-Toolbox "GPU performance" page): the latency-hiding scheduler, which overlaps
FSDP's all-gathers and reduce-scatters with compute; collectives combined up to large
buffers, so that a scanned layer's many small gathers become a few big ones; FSDP's
collectives pipelined across loop iterations, with the layer loop double-buffered; and the
collectives on the highest-priority stream. On one GPU there are no collectives, and the
scheduler changes nothing measurable (docs/gpu.md has the figures). Left out: MaxText's
`--xla_gpu_enable_triton_gemm=false` (slower here: 0.2401 s against 0.2286 on the H200) and
`--xla_gpu_enable_command_buffer=` (CUDA graphs stay on).

A flag named in the user's own `XLA_FLAGS` wins whatever its value, and
`JAXTRAIN_GPU_XLA_FLAGS=off` leaves `XLA_FLAGS` exactly as it was. Every flag here is known
to the XLA of jax 0.11 and 0.12 (an unknown flag aborts XLA at start):
tests/test_gpu_flags.py parses them with the installed jaxlib's GPU compiler.
"""

from __future__ import annotations

import os

OPT_OUT = "JAXTRAIN_GPU_XLA_FLAGS"
_COMBINE = 128 * 2**20  # bytes: all-gathers and all-reduces combined up to this size
DEFAULTS: tuple[tuple[str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true"),
    ("xla_gpu_enable_highest_priority_async_stream", "true"),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(_COMBINE)),
    ("xla_gpu_all_reduce_combine_threshold_bytes", str(_COMBINE)),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(_COMBINE // 2)),
    ("xla_gpu_enable_pipelined_all_gather", "true"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
    ("xla_gpu_enable_pipelined_all_reduce", "true"),
    ("xla_gpu_enable_while_loop_double_buffering", "true"),
)

_note: str | None = None


def merged(user_flags: str) -> tuple[str, list[str]]:
    """(XLA_FLAGS with DEFAULTS added before the user's, the names added): a default whose
    name the user's flags mention is not added."""
    given = {token.lstrip("-").split("=", 1)[0] for token in user_flags.split()}
    added = [(name, value) for name, value in DEFAULTS if name not in given]
    ours = " ".join(f"--{name}={value}" for name, value in added)
    return " ".join(filter(None, [ours, user_flags.strip()])), [name for name, _ in added]


def apply() -> str:
    """Put DEFAULTS into this process's XLA_FLAGS (before the GPU backend starts); returns the
    log line saying what was done."""
    global _note
    if _note is not None:
        return _note
    if os.environ.get(OPT_OUT, "").lower() in ("off", "0", "false", "none"):
        _note = f"GPU XLA flags: left as given ({OPT_OUT}={os.environ[OPT_OUT]})"
        return _note
    flags, added = merged(os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = flags
    kept = len(DEFAULTS) - len(added)
    _note = (
        f"GPU XLA flags: {len(added)} launch defaults added (docs/gpu.md)"
        + (f", {kept} left as XLA_FLAGS gives them" if kept else "")
        + f"; {OPT_OUT}=off to opt out"
    )
    return _note


def note() -> str | None:
    """The log line if apply() ran in this process, else None."""
    return _note
