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


def _mesh_product(mesh_sizes: dict[str, int]):
    """size(*axes): the product of those mesh axes' sizes (absent or -1 count as 1)."""
    return lambda *axes: math.prod(max(1, mesh_sizes.get(a, 1)) for a in axes)


def _moment_shards(cfg: Config, size) -> int:
    """How many ways the Adam moments split beyond the parameters' own sharding: ZeRO-1
    (optimizer.shard_state) adds the data axis."""
    return size("data") if cfg.optimizer.shard_state else 1


def _microbatch_shape(cfg: Config, size) -> tuple[int, int]:
    """(rows, seq) of one microbatch on one device."""
    t = cfg.train
    rows = max(1, t.global_batch_size // (size("data", "fsdp", "expert") * t.microbatches))
    return rows, max(1, t.seq_len // size("context"))


def lower_bound(cfg: Config, mesh_sizes: dict[str, int]) -> Footprint:
    """The step's memory per device, from below, on a mesh of `mesh_sizes` (resolved, no -1)."""
    m = cfg.model
    size = _mesh_product(mesh_sizes)
    param_shards = size("fsdp", "tensor", "expert")
    # parameters and gradients, then the two moments (ZeRO-1, optimizer.shard_state: over data too)
    state = int(4 * (2 + 2 / _moment_shards(cfg, size)) * m.param_count()) // param_shards
    rows, seq = _microbatch_shape(cfg, size)
    tokens = rows * seq
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


# --- an estimate (not a bound), for the planner and `model.remat: auto` --------------
#
# Per device, T = tokens of one microbatch on one device = rows x seq_len / context,
# a = compute-dtype bytes, p = param-dtype bytes, P = parameters, shards = fsdp x tensor x expert:
#   state        = P x (2p + 2p / data_zero1) / shards   params + gradients + Adam m, v
#                  (data_zero1: mesh data with optimizer.shard_state (ZeRO-1), else 1)
#                  (+ P x 4 / shards for the gradient accumulator when microbatches > 1)
#   saved        = L x T x (bytes/token the remat policy keeps per layer, SAVED_BYTES)
#   working set  = T x (bytes/token of one layer with nothing recomputed) + attention scores
#                  when attention is not a flash kernel: heads/tensor x S x (a + 4) per token
#   logits       = 2 x 4 x T x V / tensor          f32 logits and their gradient
# total = state + saved + working set + logits.

#: The remat policies in order of cost (recomputed FLOPs), cheapest first; `auto` walks this.
REMAT_BY_COST = (
    "none",
    "minimal",
    "save_matmuls",
    "save_attention",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "full",
)

#: Checkpoint names each policy keeps on the device (models/transformer.py); `layer_input`
#: is always kept (the scanned layer's carry).
SAVED_NAMES = {
    "full": (),
    "minimal": ("qkv_proj", "out_proj", "mlp_in", "mlp_out"),
    "save_matmuls": ("qkv_proj", "out_proj", "mlp_in", "mlp_out"),
    "save_dot_except_mlp": ("qkv_proj", "out_proj"),
    "save_qkv_proj": ("qkv_proj",),
    "save_out_proj": ("out_proj",),
    "save_attention": ("qkv_proj", "context", "out_proj"),
    "offload_matmuls": (),  # the minimal names go to pinned host memory
}


def name_bytes_per_token(m, tensor: int = 1) -> dict[str, float]:
    """Bytes per token per layer of each checkpoint name (heads / mlp shard over tensor)."""
    a, hd, t = _BYTES.get(m.compute_dtype, 4), m.resolved_head_dim, max(1, tensor)
    mlp = m.mlp_dim
    if m.moe is not None:  # top-k experts' intermediates per token (plus shared ones)
        mlp = m.moe.mlp_dim(m) * (m.moe.top_k + m.moe.num_shared_experts)
    return {
        "layer_input": m.d_model * a,
        "qkv_proj": (m.n_heads + 2 * m.n_kv_heads) * hd * a / t,
        "context": m.n_heads * hd * a / t,
        "out_proj": m.d_model * a,
        "mlp_in": 2 * mlp * a / t,
        "mlp_out": m.d_model * a,
    }


def layer_bytes_per_token(m, tensor: int = 1) -> float:
    """Everything one layer's backward uses with nothing recomputed (remat none): the named
    checkpoints plus the norms' f32 inputs and outputs, the roped q/k, the residual and SwiGLU's
    two elementwise products."""
    n = name_bytes_per_token(m, tensor)
    a = _BYTES.get(m.compute_dtype, 4)
    extra = 2 * m.d_model * (4 + a)  # two RMSNorms: f32 input + normalised output
    extra += (m.n_heads + m.n_kv_heads) * m.resolved_head_dim * a / max(1, tensor)  # roped q, k
    extra += m.d_model * a  # residual after attention
    extra += n["mlp_in"]  # silu(gate) and silu(gate) * up
    return sum(n.values()) + extra


def saved_bytes_per_token(m, remat: str, tensor: int = 1, remat_custom=()) -> float:
    """Bytes per token per layer a policy keeps on the device between forward and backward."""
    if remat == "none":
        return layer_bytes_per_token(m, tensor)
    n = name_bytes_per_token(m, tensor)
    names = (
        tuple(k for k, mode in remat_custom if mode == "device")
        if remat == "custom"
        else SAVED_NAMES.get(remat, ())
    )
    return n["layer_input"] + sum(n[k] for k in names if k != "layer_input")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """An estimate in bytes per device (footprint.estimate); `total` is the peak."""

    state: int
    saved: int
    working: int
    logits: int

    @property
    def total(self) -> int:
        return self.state + self.saved + self.working + self.logits


def estimate(cfg: Config, mesh_sizes: dict[str, int], *, attention_impl: str | None = None) -> Estimate:
    """The step's peak memory per device, estimated (formulas above); `attention_impl` is the
    resolved one ("pallas": flash, no seq x seq scores kept; "xla": scores materialised)."""
    m, t = cfg.model, cfg.train
    size = _mesh_product(mesh_sizes)
    shards = size("fsdp", "tensor", "expert")
    p = _BYTES.get(m.param_dtype, 4)
    per_param = 2 * p + 2 * p / _moment_shards(cfg, size) + (4 if t.microbatches > 1 else 0)
    state = m.param_count() * per_param // shards
    rows, seq = _microbatch_shape(cfg, size)
    tokens = rows * seq
    tp = size("tensor")
    saved = m.n_layers * tokens * saved_bytes_per_token(m, m.remat, tp, m.remat_custom)
    working = tokens * layer_bytes_per_token(m, tp)
    impl = attention_impl or m.attention_impl
    if impl == "xla":  # [rows, heads, seq, seq] probabilities and f32 scores of one layer
        a = _BYTES.get(m.compute_dtype, 4)
        working += rows * max(1, m.n_heads // tp) * seq * t.seq_len * (a + 4)
    logits = 2 * 4 * tokens * max(1, m.vocab_size // tp)
    return Estimate(state=int(state), saved=int(saved), working=int(working), logits=int(logits))
