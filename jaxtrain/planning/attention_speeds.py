"""Which attention implementation `model.attention_impl: auto` runs on a GPU: the measured
speeds, kept in one table, and the rule that reads them.

Every row is a fwd+bwd timing of one implementation on one chip for one case (head_dim,
mask), from `benchmarks/attention.py --gpu` (or, for the first rows, `gpu_peer.py`'s attention
section): B4 S4096, 32 query / 8 kv heads (16 at head_dim 256), bf16, causal, or B2 S8192 with
a window of 1024 keys. `auto` takes, among the implementations that can express the run's
attention, the fastest measured on the run's chip at the nearest head_dim, or on any chip
where the run's chip has no row. cuDNN keeps the case unless another implementation measured
more than CUDNN_MARGIN faster: on the H100 of 2026-11-27 our Hopper kernel led cuDNN by 2% at
B4 S4096 and 14% at B8 S2048 in this micro-benchmark, yet the 0.886B training step
(`configs/gpu-peer.yaml`, seq 2048) ran 1.3% slower with it (0.1911 against 0.1887 s/step).
TPUs run the Pallas kernel (Mosaic TPU) and CPUs XLA: no table is needed there.

To add a chip or a case: run `benchmarks/attention.py --gpu` on it and add its rows.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.planning.grouped_matmul_choice import HOPPER_CHIPS


@dataclasses.dataclass(frozen=True)
class Speed:
    chip: str  # sharding/hardware.py chip name: "h100", "h200"
    head_dim: int
    window: bool  # a sliding window (causal) rather than plain causal attention
    impl: str  # "cudnn" | "pallas" (Triton) | "pallas_mosaic" (Hopper) | "xla"
    tflops: float  # fwd+bwd, causal FLOPs counted as half the dense ones
    source: str  # date, machine and command


_H200 = "2026-11-26, one H200, jax 0.11.2 + cuDNN (the figures of issue #31)"
_H100 = "2026-11-26, one H100 SXM, jax 0.11.2 + cuDNN, benchmarks/gpu_peer.py and flash_tune.py"
_H100_MGPU = "2026-11-27, one H100 SXM, jax 0.11.2 + cuDNN, bash benchmarks/gpu_session.sh"
_H100_D256 = "2026-11-28, one H100 SXM, jax 0.11.2, bash benchmarks/gpu_session.sh sweep"
SPEEDS: tuple[Speed, ...] = (
    Speed("h200", 128, False, "cudnn", 424.0, _H200),
    Speed("h200", 128, False, "pallas", 186.0, _H200),  # the tiles before the H100 tuning
    Speed("h200", 128, False, "xla", 43.0, _H200),
    Speed("h100", 128, False, "xla", 51.5, _H100),
    Speed("h100", 128, False, "cudnn", 415.0, _H100_MGPU),  # 407 the day before
    Speed("h100", 128, False, "pallas_mosaic", 424.0, _H100_MGPU),
    Speed("h100", 128, False, "pallas", 296.0, _H100_MGPU),  # the tuned tiles (175 before)
    Speed("h100", 64, False, "cudnn", 286.0, _H100_MGPU),
    Speed("h100", 64, False, "pallas_mosaic", 300.0, _H100_MGPU),
    # head_dim 256: cuDNN runs there only where this process sees a Hopper GPU (below)
    Speed("h100", 256, False, "cudnn", 339.0, _H100_MGPU),
    Speed("h100", 256, False, "pallas_mosaic", 219.0, _H100_D256),  # dK/dV split in two (116 before)
    Speed("h100", 256, False, "pallas", 102.0, _H100_MGPU),
    Speed("h100", 128, True, "cudnn", 281.0, _H100_MGPU),
    Speed("h100", 128, True, "pallas_mosaic", 317.0, _H100_MGPU),
)
# another implementation replaces cuDNN only when measured this much faster (module docstring)
CUDNN_MARGIN = 1.05

# cuDNN's fused attention (as jax checks it): Ampere or newer, 16-bit inputs, head_dim a
# multiple of 8 up to 128, or up to 256 on Hopper and newer (cudnn_max_head_dim)
CUDNN_DTYPES = ("bfloat16", "float16")


def cudnn_max_head_dim() -> int:
    """The largest head_dim jax lets cuDNN's attention take in this process: 256 where the
    process's GPU is Hopper or newer, else 128. jax decides it from the local device, not the
    compile target, so a deviceless compile for an H100 (no GPU in the process) gets 128: there
    `auto` keeps the Hopper flash kernel at head_dim 256, where a run on a real H100 takes cuDNN
    (339 against 219 TFLOP/s fwd+bwd, SPEEDS)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_compute_capability

        return 256 if check_compute_capability("9.0") else 128
    except (ImportError, RuntimeError):  # jax moved its check, or no backend: every GPU's limit
        return 128


def cudnn_cannot(
    *,
    chip: str | None,
    head_dim: int,
    compute_dtype: str,
    softcap: bool = False,
    max_head_dim: int | None = None,
    sinks: bool = False,
    v_head_dim: int | None = None,
) -> str | None:
    """Why cuDNN's attention cannot run this case (None: it can). `max_head_dim`: None asks
    this process (`cudnn_max_head_dim`); `sinks`: sink logits (GPT-OSS); `v_head_dim`: the
    value head dim where it differs from `head_dim` (MLA)."""
    if softcap:
        return "a logit softcap (jax.nn.dot_product_attention's cuDNN path takes none)"
    if sinks:
        return "attention sinks (jax.nn.dot_product_attention's cuDNN path takes none)"
    if v_head_dim not in (None, head_dim):
        return (
            f"value head_dim {v_head_dim} != query/key head_dim {head_dim} "
            "(jax.nn.dot_product_attention wants v shaped like k)"
        )
    if chip is None:  # every GPU of the hardware table is Ampere or newer
        return "the GPU is unknown to sharding/hardware.py (cuDNN's attention needs Ampere or newer)"
    if compute_dtype not in CUDNN_DTYPES:
        return f"model.compute_dtype={compute_dtype}: cuDNN attention takes bfloat16 or float16"
    limit = cudnn_max_head_dim() if max_head_dim is None else max_head_dim
    if head_dim % 8 or head_dim > limit:
        return (
            f"head_dim={head_dim}: cuDNN takes multiples of 8 up to {limit} in this process "
            "(256 where it sees a Hopper GPU, 128 elsewhere)"
        )
    return None


def _mosaic_can(
    *, chip: str | None, head_dim: int, compute_dtype: str, softcap: bool, sinks=False, v_head_dim=None
) -> bool:  # `sinks`: the kernel takes them (flash_mgpu._with_sinks)
    """The Hopper flash kernel (pallas_kernels/flash_mgpu.py, `pallas_mosaic`) can run the case:
    an sm90 chip and what the kernel itself accepts."""
    from jaxtrain.pallas_kernels.flash_mgpu import unsupported_reason

    reason = unsupported_reason(
        head_dim=head_dim, dtype=compute_dtype, softcap=softcap or None, v_head_dim=v_head_dim
    )
    return chip in HOPPER_CHIPS and reason is None


def choose_gpu_attention(
    *,
    chip: str | None,
    head_dim: int,
    window: bool,
    compute_dtype: str,
    softcap: bool = False,
    cudnn_head_dim_max: int | None = None,
    sinks: bool = False,
    v_head_dim: int | None = None,
) -> tuple[str, str]:
    """(impl, why) for a GPU run: the fastest measured implementation that can run the case.
    `cudnn_head_dim_max`: cudnn_cannot's `max_head_dim`; `sinks`, `v_head_dim`: as for
    cudnn_cannot (cases the Triton kernel takes and cuDNN does not)."""
    case = dict(
        head_dim=head_dim, compute_dtype=compute_dtype, softcap=softcap, sinks=sinks, v_head_dim=v_head_dim
    )
    why_not = cudnn_cannot(chip=chip, max_head_dim=cudnn_head_dim_max, **case)
    candidates = {"pallas", "xla"} | (set() if why_not else {"cudnn"})
    if _mosaic_can(chip=chip, **case):
        candidates.add("pallas_mosaic")
    rows = [s for s in SPEEDS if s.impl in candidates and s.window == window] or [
        s for s in SPEEDS if s.impl in candidates
    ]
    mine = [s for s in rows if s.chip == chip] or rows
    if not mine:
        return "pallas", "no measured attention speeds for this case: the Pallas flash kernel"
    nearest = min(abs(s.head_dim - head_dim) for s in mine)
    at = [s for s in mine if abs(s.head_dim - head_dim) == nearest]
    best = max(at, key=lambda s: s.tflops)
    cudnn = next((s for s in at if s.impl == "cudnn" and s.chip == best.chip), None)
    kept = cudnn is not None and best is not cudnn and best.tflops < CUDNN_MARGIN * cudnn.tflops
    chosen = cudnn if kept else best
    where = (
        "this chip" if best.chip == chip else f"{best.chip.upper()} (none measured on {chip or 'this GPU'})"
    )
    if kept:
        why = (
            f"within {CUDNN_MARGIN - 1:.0%} of the fastest measured on {where} at head_dim "
            f"{best.head_dim} ({best.impl} {best.tflops:g} against {cudnn.tflops:g} TFLOP/s fwd+bwd)"
        )
    else:
        why = f"fastest measured on {where} at head_dim {best.head_dim}: {best.tflops:g} TFLOP/s fwd+bwd"
    if why_not:
        why += f"; not cudnn: {why_not}"
    return chosen.impl, why


def choose_gpu_flash_kernel(
    *,
    chip: str | None,
    head_dim: int,
    compute_dtype: str,
    softcap: bool = False,
    sinks: bool = False,
    v_head_dim: int | None = None,
) -> tuple[str, str]:
    """(kernel, why): which of our Pallas flash kernels a GPU run uses where it runs one
    (`model.gpu_flash_kernel: auto`): the Hopper kernel ("mosaic") on an sm90 chip where it
    takes the case and the table does not measure it slower than Triton at the nearest
    head_dim; "triton" otherwise."""
    case = dict(
        head_dim=head_dim, compute_dtype=compute_dtype, softcap=softcap, sinks=sinks, v_head_dim=v_head_dim
    )
    if not _mosaic_can(chip=chip, **case):
        return "triton", "the Triton kernel: the Hopper kernel needs an sm90 chip, 16-bit compute, " + (
            "head_dim 64/128/256 (v's as q/k's) and no softcap"
        )
    pairs: dict[tuple[str, int], dict[str, float]] = {}  # (chip, head_dim) -> impl -> TFLOP/s
    for row in SPEEDS:
        if row.impl in ("pallas", "pallas_mosaic") and not row.window:
            pairs.setdefault((row.chip, row.head_dim), {})[row.impl] = row.tflops
    both = [key for key, speeds in pairs.items() if len(speeds) == 2]
    keys = [k for k in both if k[0] == chip] or [k for k in both if k[0] in HOPPER_CHIPS]
    if not keys:
        return "mosaic", "the Hopper kernel (never measured beside the Triton one)"
    key = min(keys, key=lambda k: abs(k[1] - head_dim))
    mosaic, triton = pairs[key]["pallas_mosaic"], pairs[key]["pallas"]
    where = "this chip" if key[0] == chip else key[0].upper()
    figures = f"on {where} at head_dim {key[1]}: {mosaic:g} against Triton's {triton:g} TFLOP/s fwd+bwd"
    if mosaic < triton:
        return "triton", f"the Triton kernel, faster than the Hopper one {figures}"
    return "mosaic", f"the Hopper kernel, faster than the Triton one {figures}"
