"""One table of accelerator figures: peak FLOP/s per dtype, HBM bytes, chips per host.

Read by MFU (`jaxtrain.planning.flops`), `jaxtrain compile`'s targets (`jaxtrain.planning.compile`)
and the compile-only GPU target configs (`sharding.targets`), so that the three
can never disagree. Imports only the standard library.

Peaks are dense (no sparsity) per device, i.e. per chip (one megacore device on
TPU v4/v5p) or per GPU, from the vendors' spec sheets; None where the vendor
gives no figure or the chip has no such unit.

HBM is the byte count the device reports as its memory, which is what the
compiler plans against: on TPU the generation's nominal GiB (v5p: 95 GiB), on
GPU the `device_memory_size` of XLA's GpuTargetConfigProto for that card
(xla/backends/gpu/target_config/specs/*.txtpb, recorded from the CUDA driver's
total-memory figure). That is a little less than the nominal 80 GiB of an
"80GB" card: the A100 SXM 80GB reports 85100068864 bytes (79.26 GiB), not
85899345920 (80 GiB); the H100 SXM 84942979072 (79.11 GiB).
"""

from __future__ import annotations

import dataclasses

__all__ = ["CHIPS", "Chip", "chip", "chip_for_device_kind", "peak_flops_for_device_kind"]

GiB = 1024**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator generation, as a device of a JAX mesh."""

    name: str  # the `jaxtrain compile --target` generation: "v5p", "h100"
    platform: str  # "tpu" | "gpu"
    description: str  # for people: "TPU v5p", "H100 SXM 80GB"
    device_kinds: tuple[str, ...]  # lower-case substrings of `jax.Device.device_kind`
    bf16_flops: float  # dense peak FLOP/s per device, bfloat16 inputs
    fp32_flops: float | None = None  # IEEE fp32 (GPU: CUDA cores; TF32 tensor cores are faster)
    fp8_flops: float | None = None
    hbm_bytes: int
    hbm_bytes_per_s: float = 0.0  # memory bandwidth (the remat policy's cost model, remat_cost.py)
    chips_per_host: int  # devices per host (TPU VM / GPU node)
    cores_per_chip: int = 1  # TensorCores per chip (v4/v5p: 2, fused as one megacore device)
    torus_dims: int | None = None  # TPU ICI torus dimensions (3D or 2D); None on GPU
    # Bytes/s one device moves in a collective over one mesh axis inside a slice / host
    # (the planner's communication model): TPU, 2 x the one-way ICI link bandwidth (a ring
    # on one torus axis uses both directions; the scaling book's table); GPU, NVLink one way.
    ici_bytes_per_s: float = 0.0
    # Across hosts (GPU: the NIC per GPU, 400 Gb/s on H100 nodes, 200 Gb/s on A100 nodes).
    dcn_bytes_per_s: float = 0.0

    def peak_flops(self, dtype: str = "bfloat16") -> float | None:
        """Dense peak FLOP/s per device for `dtype` ("bfloat16", "float32", "float8"); None if unknown."""
        peaks = {"bfloat16": self.bf16_flops, "float32": self.fp32_flops, "float8": self.fp8_flops}
        if dtype not in peaks:
            raise ValueError(f"dtype={dtype!r}: expected one of {sorted(peaks)}")
        return peaks[dtype]


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip(
            name="v4",
            platform="tpu",
            description="TPU v4",
            device_kinds=("tpu v4",),
            bf16_flops=275e12,
            hbm_bytes=32 * GiB,
            hbm_bytes_per_s=1.2e12,  # spec sheet
            chips_per_host=4,
            cores_per_chip=2,
            torus_dims=3,
            ici_bytes_per_s=9e10,
        ),
        Chip(
            name="v5e",
            platform="tpu",
            description="TPU v5e",
            device_kinds=("tpu v5 lite", "tpu v5e"),  # v5e reports itself as "TPU v5 lite"
            bf16_flops=197e12,
            hbm_bytes=16 * GiB,
            hbm_bytes_per_s=8.19e11,  # spec sheet
            chips_per_host=4,  # multi-host slices; a single-host 2x4 VM has 8
            torus_dims=2,
            ici_bytes_per_s=9e10,
        ),
        Chip(
            name="v5p",
            platform="tpu",
            description="TPU v5p",
            device_kinds=("tpu v5p", "tpu v5"),  # v5p reports itself as "TPU v5"
            bf16_flops=459e12,
            hbm_bytes=95 * GiB,
            hbm_bytes_per_s=2.765e12,  # spec sheet
            chips_per_host=4,
            cores_per_chip=2,
            torus_dims=3,
            ici_bytes_per_s=1.8e11,
        ),
        Chip(
            name="v6e",
            platform="tpu",
            description="TPU v6e",
            device_kinds=("tpu v6 lite", "tpu v6e"),  # Trillium reports itself as "TPU v6 lite"
            bf16_flops=918e12,
            hbm_bytes=32 * GiB,
            hbm_bytes_per_s=1.64e12,  # spec sheet
            chips_per_host=4,  # multi-host slices; a single-host 2x4 VM has 8
            torus_dims=2,
            ici_bytes_per_s=1.8e11,
        ),
        Chip(
            name="a100",
            platform="gpu",
            description="A100 SXM 80GB",
            device_kinds=("a100",),
            bf16_flops=312e12,
            fp32_flops=19.5e12,
            hbm_bytes=85100068864,  # XLA's a100_sxm_80.txtpb (see module docstring)
            hbm_bytes_per_s=2.039e12,  # spec sheet
            chips_per_host=8,
            ici_bytes_per_s=3e11,
            dcn_bytes_per_s=2.5e10,
        ),
        Chip(
            name="h100",
            platform="gpu",
            description="H100 SXM 80GB",
            device_kinds=("h100",),
            bf16_flops=989e12,
            fp32_flops=67e12,
            fp8_flops=1979e12,
            hbm_bytes=84942979072,  # XLA's h100_sxm.txtpb
            hbm_bytes_per_s=3.35e12,  # spec sheet
            chips_per_host=8,
            ici_bytes_per_s=4.5e11,
            dcn_bytes_per_s=5e10,
        ),
        Chip(
            name="h200",
            platform="gpu",
            description="H200 141GB",
            device_kinds=("h200",),
            bf16_flops=989e12,  # the H100's compute with more, faster memory
            fp32_flops=67e12,
            fp8_flops=1979e12,
            hbm_bytes=151397597184,  # XLA's h200.txtpb
            hbm_bytes_per_s=4.8e12,  # spec sheet
            chips_per_host=8,
            ici_bytes_per_s=4.5e11,
            dcn_bytes_per_s=5e10,
        ),
    )
}


def chip(name: str) -> Chip:
    """The table row for a generation name ("v5p", "h100"); KeyError naming the known ones."""
    try:
        return CHIPS[name]
    except KeyError:
        raise KeyError(f"unknown chip {name!r}; expected one of {', '.join(CHIPS)}") from None


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The row whose match string occurs in `jax.Device.device_kind`; the longest match
    wins ("TPU v5 lite" is a v5e, "TPU v5" a v5p). None for devices not in the table (CPU)."""
    kind = device_kind.lower()
    matches = [(len(s), c) for c in CHIPS.values() for s in c.device_kinds if s in kind]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def peak_flops_for_device_kind(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one device of this kind; None if the kind or the figure is unknown."""
    row = chip_for_device_kind(device_kind)
    return row.peak_flops(dtype) if row else None
