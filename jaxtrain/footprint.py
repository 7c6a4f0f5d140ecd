"""An analytic lower bound on a training step's memory per device, checked before compile.

`jaxtrain compile` gives the compiler's verdict for a target; this is the cheap
check `jaxtrain train` makes at the door, so that an absurd `train.seq_len`, batch,
vocabulary or model dimension is refused in a second with the numbers, instead of
compiling, starting the progress bar and dying allocating tens of GiB (or leaving an
empty run folder behind).

It is deliberately a LOWER bound, so it never refuses a config that fits. Per device:
- state: parameters, gradients and the two AdamW moments, 4 bytes each, sharded
  over the axes that shard parameters (fsdp x tensor x expert), the moments also over
  data with optimizer.shard_state (ZeRO-1);
- activations: what the backward pass must keep, at least one [tokens, d_model]
  tensor per layer (remat full keeps only the layer inputs), in the compute dtype;
- logits: the [tokens, vocab] output projection in f32 (cross-entropy runs in f32),
  vocab sharded over tensor.
with tokens = per-device batch (global batch / (data x fsdp x expert x microbatches))
x seq_len / context. Compiled programs need more (attention scores, MLP
intermediates, temporaries), which is why the real verdict is `jaxtrain compile`.
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxtrain.config import Config, ConfigError

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Lower bounds in bytes per device."""

    state: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.logits


def lower_bound(cfg: Config, mesh_sizes: dict[str, int]) -> Footprint:
    """The step's memory per device, from below, on a mesh of `mesh_sizes` (resolved, no -1)."""
    m, t = cfg.model, cfg.train
    size = lambda *axes: math.prod(max(1, mesh_sizes.get(a, 1)) for a in axes)
    param_shards = size("fsdp", "tensor", "expert")
    # parameters and gradients, then the two moments (ZeRO-1, optimizer.shard_state: over data too)
    moment_shards = size("data") if cfg.optimizer.shard_state else 1
    state = int(4 * (2 + 2 / moment_shards) * m.param_count()) // param_shards
    rows = max(1, t.global_batch_size // (size("data", "fsdp", "expert") * t.microbatches))
    tokens = rows * max(1, t.seq_len // size("context"))
    activations = m.n_layers * tokens * m.d_model * _BYTES.get(m.compute_dtype, 4)
    logits = 4 * tokens * max(1, m.vocab_size // size("tensor"))
    return Footprint(state=state, activations=activations, logits=logits)


def host_memory_bytes() -> int | None:
    """Physical memory of this host (simulated CPU devices share it), or None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device) -> tuple[int | None, int]:
    """(bytes one device can hold, devices sharing that memory) for a jax device."""
    if device.platform == "cpu":
        import jax

        return host_memory_bytes(), jax.local_device_count()
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1
    from jaxtrain.sharding import hardware

    chip = hardware.chip_for_device_kind(getattr(device, "device_kind", ""))
    return (chip.hbm_bytes if chip else None), 1


def check_fits(cfg: Config, mesh_sizes: dict[str, int], device) -> Footprint:
    """Raise ConfigError when even the lower bound exceeds what `device` holds."""
    need = lower_bound(cfg, mesh_sizes)
    capacity, sharing = device_memory_bytes(device)
    if capacity is None:
        return need
    per_device = capacity // sharing
    if need.total > per_device:
        t, m = cfg.train, cfg.model
        source = (
            f"this host's {_gib(capacity)} over {sharing} simulated device(s)"
            if device.platform == "cpu"
            else f"{device.device_kind} memory"
        )
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} x train.seq_len={t.seq_len} with "
            f"model.vocab_size={m.vocab_size}, model.d_model={m.d_model}, model.n_layers={m.n_layers}: "
            f"needs at least {_gib(need.total)} per device (parameters + optimizer {_gib(need.state)}, "
            f"activations {_gib(need.activations)}, f32 logits {_gib(need.logits)}) but "
            f"a device has {_gib(per_device)} ({source}); lower seq_len or the batch, "
            "shard more (mesh.fsdp, mesh.tensor, mesh.context), or check the size you meant"
        )
    return need


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**40 else f"{n / 2**40:,.1f} TiB"
