"""Which grouped matmul dropless MoE runs on a GPU (`model.moe.grouped_matmul: auto`).

One small table, chip -> implementation, filled from measured fwd+bwd speed at the MoE
shape (`benchmarks/moe.py --gpu`); a chip not in it gets the Pallas Triton kernel
(pallas_kernels/grouped_matmul_gpu.py), which runs on any GPU Triton targets. The Mosaic GPU
kernels (grouped_matmul_mgpu.py) are Hopper-only and take bf16/f16 with d_model and d_ff
multiples of 128, so the table's "mosaic" is only taken where those hold. fp8 experts keep
ragged_dot whatever this says (models/moe.py grouped_matmul_impl). Imports nothing heavy.
"""

from __future__ import annotations

__all__ = ["GPU_GROUPED_MATMUL", "HOPPER_CHIPS", "choose_gpu_grouped_matmul"]

# chip (sharding/hardware.py's name) -> "triton" | "mosaic" | "ragged_dot", as measured.
# H100 (2026-11-26, jax 0.11.2, `benchmarks/moe.py --gpu`, docs/benchmarks.md): the MoE step of
# gpu-peer.yaml with 8 experts of 1408, top-2: dropless triton 0.2053 s, mosaic 0.2325 s,
# capacity 1.25 0.2354 s (triton 0.1848 s against capacity's 0.2318 on 2026-11-27, once the
# row sort lost its scatter-adds); the grouped matmuls alone fwd+bwd: triton 429-555 TFLOP/s, mosaic
# 456-589, ragged_dot 91-100. The H200 is not measured (the Triton default).
GPU_GROUPED_MATMUL: dict[str, str] = {"h100": "triton"}
HOPPER_CHIPS = ("h100", "h200")


def mosaic_cannot(*, chip: str | None, d_model: int, d_ff: int, compute_dtype: str) -> str | None:
    """Why the Mosaic GPU kernels cannot run this layer, or None (grouped_matmul_mgpu.check_shapes
    with its default 128 x 128 x 64 blocks, in words)."""
    if chip not in HOPPER_CHIPS:
        return f"Mosaic GPU kernels are Hopper-only (chip {chip or 'unknown'})"
    if compute_dtype not in ("bfloat16", "float16"):
        return f"Mosaic GPU kernels take bf16/f16, compute dtype is {compute_dtype}"
    if d_model % 128 or d_ff % 128:
        return f"d_model {d_model} and expert d_ff {d_ff} must be multiples of 128"
    return None


def choose_gpu_grouped_matmul(
    *, chip: str | None, d_model: int, d_ff: int, compute_dtype: str
) -> tuple[str, str]:
    """(impl, why) for a GPU run."""
    impl = GPU_GROUPED_MATMUL.get(chip or "")
    if impl is None:
        return "triton", f"the Pallas Triton grouped matmul (no measured choice for {chip or 'this GPU'})"
    if impl == "mosaic":
        why_not = mosaic_cannot(chip=chip, d_model=d_model, d_ff=d_ff, compute_dtype=compute_dtype)
        if why_not:
            return "triton", f"the Pallas Triton grouped matmul; not mosaic: {why_not}"
    return impl, f"fastest measured grouped matmul on {chip}"
