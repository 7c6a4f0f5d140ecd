"""Which attention implementation `model.attention_impl: auto` runs on a GPU: the measured
speeds, kept in one table, and the rule that reads them.

Every row is a fwd+bwd timing of one implementation on one chip for one case (head_dim,
mask), from `benchmarks/gpu_peer.py`'s attention section (B4 S4096, 32 query / 8 kv heads,
bf16, causal unless said). `auto` takes, among the implementations that can express the
run's attention, the fastest measured on the run's chip at the nearest head_dim, or on any
chip where the run's chip has no row (the order has so far been the same on every GPU
measured). TPUs run the Pallas kernel (Mosaic TPU) and CPUs XLA: no table is needed there.

To add a chip or a case: run `benchmarks/gpu_peer.py --only attention` on it and add its rows.
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
SPEEDS: tuple[Speed, ...] = (
    Speed("h200", 128, False, "cudnn", 424.0, _H200),
    Speed("h200", 128, False, "pallas", 186.0, _H200),  # the tiles before the H100 tuning
    Speed("h200", 128, False, "xla", 43.0, _H200),
    Speed("h100", 128, False, "cudnn", 407.0, _H100),
    Speed("h100", 128, False, "pallas", 284.0, _H100),  # the tuned tiles (175 before)
    Speed("h100", 128, False, "xla", 51.5, _H100),
)

# cuDNN's fused attention (as jax checks it): Ampere or newer, 16-bit inputs, head_dim a
# multiple of 8 up to 128 (jax allows 256 on Hopper, but asks the device which it is, so a
# deviceless compile refuses it; and no head_dim over 128 has been measured here)
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DTYPES = ("bfloat16", "float16")


def cudnn_cannot(*, chip: str | None, head_dim: int, compute_dtype: str, softcap: bool = False) -> str | None:
    """Why cuDNN's attention cannot run this case (None: it can)."""
    if softcap:
        return "a logit softcap (jax.nn.dot_product_attention's cuDNN path takes none)"
    if chip is None:  # every GPU of the hardware table is Ampere or newer
        return "the GPU is unknown to sharding/hardware.py (cuDNN's attention needs Ampere or newer)"
    if compute_dtype not in CUDNN_DTYPES:
        return f"model.compute_dtype={compute_dtype}: cuDNN attention takes bfloat16 or float16"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim={head_dim}: cuDNN is used for multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


def _mosaic_can(*, chip: str | None, head_dim: int, compute_dtype: str, softcap: bool) -> bool:
    """The Hopper flash kernel (pallas_kernels/flash_mgpu.py, `pallas_mosaic`) can run the case:
    an sm90 chip and what the kernel itself accepts. It has no row above yet (never timed on a
    GPU), so `auto` does not pick it; its first rows come from `benchmarks/attention.py --gpu`."""
    from jaxtrain.pallas_kernels.flash_mgpu import unsupported_reason

    reason = unsupported_reason(head_dim=head_dim, dtype=compute_dtype, softcap=softcap or None)
    return chip in HOPPER_CHIPS and reason is None


def choose_gpu_attention(
    *, chip: str | None, head_dim: int, window: bool, compute_dtype: str, softcap: bool = False
) -> tuple[str, str]:
    """(impl, why) for a GPU run: the fastest measured implementation that can run the case."""
    why_not = cudnn_cannot(chip=chip, head_dim=head_dim, compute_dtype=compute_dtype, softcap=softcap)
    candidates = {"pallas", "xla"} | (set() if why_not else {"cudnn"})
    if _mosaic_can(chip=chip, head_dim=head_dim, compute_dtype=compute_dtype, softcap=softcap):
        candidates.add("pallas_mosaic")
    rows = [s for s in SPEEDS if s.impl in candidates and s.window == window] or [
        s for s in SPEEDS if s.impl in candidates
    ]
    mine = [s for s in rows if s.chip == chip] or rows
    if not mine:
        return "pallas", "no measured attention speeds for this case: the Pallas flash kernel"
    nearest = min(abs(s.head_dim - head_dim) for s in mine)
    best = max((s for s in mine if abs(s.head_dim - head_dim) == nearest), key=lambda s: s.tflops)
    where = (
        "this chip" if best.chip == chip else f"{best.chip.upper()} (none measured on {chip or 'this GPU'})"
    )
    why = f"fastest measured on {where} at head_dim {best.head_dim}: {best.tflops:g} TFLOP/s fwd+bwd"
    if why_not:
        why += f"; not cudnn: {why_not}"
    return best.impl, why
