"""An analytic lower bound on a training step's memory per device, checked before compile.

`jaxtrain compile` gives the compiler's verdict for a target; this is the cheap
check `jaxtrain train` makes at the door, so that an absurd `train.seq_len`, batch,
vocabulary or model dimension is refused in a second with the numbers, instead of
compiling, starting the progress bar and dying allocating tens of GiB (or leaving an
empty run folder behind).

It is deliberately a LOWER bound, so it never refuses a config that fits. Per device:
- state: parameters, gradients and the optimizer's state (`moment_bytes`: AdamW's two moments,
  Muon's one momentum for its matrices, in optimizer.state_dtype; with model.lora, the adapters'
  alone: the frozen base holds only its weights; not with optimizer.offload, which
  keeps them in host memory), the first two in the parameter dtype, sharded over the axes that shard
  parameters (fsdp x tensor x expert), the moments also over data with
  optimizer.shard_state (ZeRO-1), the layers' parameters also over pipeline stages
  (mesh.stage); optimizer.offload_params still counts the parameters, which the step brings
  to the device for the forward pass; train.objective=dpo adds the frozen reference copy of
  the parameters (trainer/dpo.py), sharded as they are;
- activations: what the backward pass must keep, at least one [tokens, d_model]
  tensor per layer and per prediction module (model.mtp) (remat full keeps only the layer
  inputs), in the compute dtype;
  with pipeline stages, at least one in all (each stage keeps its iterations' inputs);
- logits: the [tokens, vocab] output projection in f32 (cross-entropy runs in f32),
  vocab sharded over tensor; one chunk of positions with train.loss_chunk (its `auto` may
  chunk, so it counts as seq_len / LOSS_AUTO_CHUNKS).
with tokens = per-device batch (global batch / (data x fsdp x expert x microbatches))
x seq_len / context (a DPO batch row is a pair: two sequences). Compiled programs need more
(attention scores, MLP intermediates, temporaries), which is why the real verdict is
`jaxtrain compile`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from jaxtrain.config import Config, ConfigError
from jaxtrain.models.config import DTYPE_BYTES, REMAT_KEPT_NAMES
from jaxtrain.models.moe import capacity, dispatch_per_shard, receive_rows, shards_per_token
from jaxtrain.planning.attention_shape import attention_shape
from jaxtrain.sharding import hardware
from jaxtrain.sharding.pipeline_tables import table as schedule_table
from jaxtrain.sharding.tick_pipeline import slots


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Lower bounds in bytes per device."""

    state: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.logits


#: train.loss_chunk=auto splits a sequence into this many chunks once chunking pays
#: (planning/resolve.py decides when).
LOSS_AUTO_CHUNKS = 4


def mesh_product(mesh_sizes: dict[str, int]):
    """size(*axes): the product of those mesh axes' sizes (absent or -1 count as 1)."""
    return lambda *axes: math.prod(max(1, mesh_sizes.get(a, 1)) for a in axes)


def _moment_shards(cfg: Config, size) -> int:
    """How many ways the Adam moments split beyond the parameters' own sharding: ZeRO-1
    (optimizer.shard_state) adds the data axis."""
    return size("data") if cfg.optimizer.shard_state else 1


def muon_param_count(m) -> int:
    """Parameters optimizer.name=muon gives to Muon (trainer/muon.py: the attention and MLP
    matrices of every layer, latent attention's and each expert's included, and each
    prediction module's (model.mtp): its eh_proj and its block's); none with model.lora,
    whose adapters AdamW trains."""
    if m.lora is not None:
        return 0
    d = m.d_model
    n_moe, per_moe_layer = 0, 0
    if m.moe is not None:
        n_moe = m.moe.num_moe_layers(m)
        per_moe_layer = 3 * d * m.moe.mlp_dim(m) * (m.moe.num_experts + m.moe.num_shared_experts)
    attention = d * m.resolved_head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    if m.mla is not None:  # all its projections; its latent norms' scales are AdamW's
        attention = m.mla.param_count(m) - m.mla.kv_lora_rank - (m.mla.q_lora_rank or 0)
    mtp = 0
    if m.mtp is not None:  # each module: eh_proj and one block of the model's kind (MoE on MoE models)
        mtp = m.mtp.depth * (2 * d * d + attention + (per_moe_layer if m.moe else 3 * d * m.mlp_dim))
    return m.n_layers * attention + (m.n_layers - n_moe) * 3 * d * m.mlp_dim + n_moe * per_moe_layer + mtp


def moment_bytes(cfg: Config) -> float:
    """Optimizer-state bytes per trained parameter, on average over them: AdamW's two moments,
    or with optimizer.name=muon one momentum for Muon's matrices and two moments for the rest,
    in optimizer.state_dtype (null: the parameter dtype; bfloat16: 3 bytes, with its error term)."""
    m, o = cfg.model, cfg.optimizer
    s = DTYPE_BYTES.get(o.state_dtype or m.param_dtype, 4)
    if o.state_dtype == "bfloat16":
        s += 1  # each entry's int8 error term (trainer/state_store.py)
    if o.name != "muon":
        return 2 * s
    return s * (2 - muon_param_count(m) / m.param_count())


def sequences_per_row(cfg: Config) -> int:
    """Sequences the model runs per batch row: 2 for DPO's pairs (chosen, rejected), else 1."""
    return 2 if cfg.train.objective == "dpo" else 1


def reference_copies(cfg: Config) -> int:
    """Extra copies of the parameters the train state holds: DPO's frozen reference
    (trainer/dpo.py), none with model.lora (the reference is the base with adapters skipped)."""
    from jaxtrain.trainer.dpo import holds_reference_copy  # jax-free planning imports stay light

    return 1 if holds_reference_copy(cfg) else 0


def compact_grad_savings(cfg: Config, size) -> float:
    """Bytes per device that the layer loop saves at the step's peak by keeping the layer
    stack's weight gradients in the compute dtype until the backward loop ends
    (models/layer_scan.py): param minus compute-dtype bytes per layer-stack parameter, where
    `model.compact_weight_grads` holds; not in pipelines (their own loop) or with
    LoRA (the base has no gradient). Norm scales keep theirs (a few thousand parameters)."""
    m = cfg.model
    p, a = DTYPE_BYTES.get(m.param_dtype, 4), DTYPE_BYTES.get(m.compute_dtype, 4)
    if not m.compact_weight_grads or size("stage") > 1 or m.lora is not None:
        return 0.0
    stack, experts = layer_stack_params(m), expert_params(m)
    return (p - a) * ((stack - experts) / size("fsdp", "tensor") + experts / size("fsdp", "tensor", "expert"))


def microbatch_shape(cfg: Config, size) -> tuple[int, int]:
    """(rows, seq) of one microbatch on one device; rows are sequences (a DPO pair is two)."""
    t = cfg.train
    rows = max(1, t.global_batch_size // (size("data", "fsdp", "expert") * t.microbatches))
    return rows * sequences_per_row(cfg), max(1, t.seq_len // size("context"))


def lower_bound(cfg: Config, mesh_sizes: dict[str, int]) -> Footprint:
    """The step's memory per device, from below, on a mesh of `mesh_sizes` (resolved, no -1),
    for any dtype, offload and loss-chunk setting (module docstring)."""
    m, o = cfg.model, cfg.optimizer
    size = mesh_product(mesh_sizes)
    p = DTYPE_BYTES.get(m.param_dtype, 4)
    # parameters and gradients (clipping needs all of them before the update), then the two
    # moments unless offload keeps them on the host (ZeRO-1, optimizer.shard_state: split over
    # data too); pipeline stages split the layers' parameters (not the embedding and head)
    moments = 0 if o.offload else moment_bytes(cfg) / _moment_shards(cfg, size)
    per_param = (2 + reference_copies(cfg)) * p + moments
    stack = layer_stack_params(m)
    params = stack // size("stage") + m.param_count() - stack
    state = int(per_param * params * lora_share(m, per_param, p)) // size("fsdp", "tensor", "expert")
    state -= int(compact_grad_savings(cfg, size))
    rows, seq = microbatch_shape(cfg, size)
    tokens = rows * seq
    # a stage keeps one [tokens, d_model] input per pipeline iteration, at least `tokens` of them;
    # each prediction module (model.mtp) keeps its input too
    layers = m.n_layers + (m.mtp.depth if m.mtp is not None else 0) if size("stage") == 1 else 1
    activations = layers * tokens * m.d_model * DTYPE_BYTES.get(m.compute_dtype, 4)
    # f32 logits: all of them, or one chunk with train.loss_chunk (auto may chunk)
    chunk = cfg.train.loss_chunk
    if chunk == "auto":
        chunk = max(1, cfg.train.seq_len // LOSS_AUTO_CHUNKS)
    positions = seq if not chunk else max(1, min(seq, chunk // size("context")))
    logits = 4 * rows * positions * max(1, m.vocab_size // size("tensor"))
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
        return host_memory_bytes(), jax.local_device_count()
    try:
        stats = device.memory_stats() or {}
    except jax.errors.JaxRuntimeError:  # compile-only devices keep none: the chip table says
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1

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
#   state        = P x (2p + s / data_zero1) / shards   params + gradients + optimizer state
#                  (s = moment_bytes: Adam's m, v, or Muon's momentum for its matrices, in
#                  optimizer.state_dtype)
#                  (MoE: the routed experts' parameters over shards, the rest over fsdp x tensor)
#                  (data_zero1: mesh data with optimizer.shard_state (ZeRO-1), else 1)
#                  (+ P x 4 / shards for the gradient accumulator when microbatches > 1)
#                  (- P_layers x (p - a) / shards: the layers' weight gradients are held in the
#                  compute dtype through the backward loop, models/layer_scan.py)
#                  (+ P x p / shards for DPO's frozen reference copy, train.objective=dpo; its
#                  forward pass runs before the policy's and keeps nothing for a backward, so
#                  it adds no activations; T counts both sequences of each pair)
#                  (optimizer.offload(_params) changes nothing here: the step brings the state to
#                  the device for the update, and XLA starts those copies during the backward;
#                  compiled, offload moved the peak by -6.1 to +3.1 GiB on the presets, with
#                  no sign a formula could follow: docs/benchmarks.md)
#   saved        = L x T x (bytes/token the remat policy keeps per layer, SAVED_BYTES)
#   working set  = T x (bytes/token of one layer with nothing recomputed) + attention scores
#                  when attention is not a flash kernel: heads/tensor x S x (a + 4) per token
#   logits       = 2 x 4 x T x V / tensor          f32 logits and their gradient
#                  (train.loss_chunk = c: 2 x 4 x rows x c/context x V / tensor + 4 x T x D)
# With pipeline stages (mesh.stage = S > 1, pipeline.microbatches M, repeats R): the layers'
# parameters split over S (embedding and head do not); the pipeline keeps H stage inputs of
# one microbatch (`pipeline_inputs_held`: gpipe and circular one per iteration, H = M R + S - 1;
# the 1f1b family its stash and inbox slots, `slots`: H = S + 1 for 1f1b, 2S for zero_bubble) and
# recomputes each stage in the backward:
#   saved        = H x T/M x D x a + 2 x T x D x a (microbatch buffers)
#                  + L/(S R) x T/M x (bytes/token the remat policy keeps)
#   working set  = T/M x (bytes/token of one layer with nothing recomputed)
# MoE layers (models/moe.py), with A = T x top_k assignments per device and R the rows
# the expert matmuls run over: R = A (dispatch dropless, expert = 1), R = receive_rows(A, ep)
# (dropless over ep = mesh.expert shards: ep x A, or receive_factor x A), or E x capacity per
# sequence (dispatch capacity); r = R / A (`moe_rows`):
#   mlp_in       = 2 x F x top_k x r x a        gate and up over the R rows
#   mlp_out      = top_k x D x a                the expert outputs in token order (the router
#                                               weights' gradient needs them)
#   extra        = 3 x F x top_k x r x a        silu(gate), its derivative's operand, the product
#                  + (r + 1) x top_k x D x a    the sorted input over R rows, the output over A
#                  rows sorted; + D x a the combined output; with ep > 1
#                  + 2 x r x top_k x D x a, the outputs over R rows sorted and in buffer
#                  order (+ 2 x ep x top_k x D x a: the padded exchange's send and receive
#                  buffers)
# Dropless per shard (model.moe.dispatch_per_shard; `_per_shard_exchange`): each token goes once
# to each of its n = shards_per_token shards, which receive ep x T rows and expand them to
# k_local = min(top_k, E/ep) expert slots, so R = ep x T x k_local (r = ep x k_local / top_k);
# the outputs over A rows sorted become the n rows a token gets back (n x D x a), and the padded
# exchange's buffers are [ep, T, D]: + 2 x ep x D x a
#   weights      = 3 x E/ep x D x F / tensor x p  one MoE layer's experts, gathered whole inside
#                  the shard_map: in the working set, and kept per MoE layer under remat none
# Latent attention (model.mla; planning/attention_shape.py): qkv_proj is q and k of H x (nope +
# rope) values and v of H x v_head; context H x v_head; the projections before RoPE are q and
# the key/value up-projection H x (nope + v); its latents (q_lora + kv_lora + rope, replicated
# over tensor) and their two norms ((q_lora + kv_lora) x (4 + 4 + a)) join one layer's extra.
# Multi-token prediction (model.mtp, depth N; not with stages): each module keeps what a layer
# keeps, and its token embedding, N x T x (bytes/token kept + D x a) more in `saved` (and its
# block's experts under remat none); its block's working set is a layer's. Its logits, through
# the same head: (N + 2) x 4 x T x V / tensor unchunked (each depth's kept for the backward, one
# gradient at a time); chunked, each depth's d loss / d x too, (N + 1) x 4 x T x D.
# With model.cpu_tuning in bfloat16 under remat none, each layer's matmul weights gathered over
# fsdp (models/cpu_tuning.py) are kept for the backward too: (P_layers - P_experts) x a / tensor in
# all (not with pipeline stages, whose backward recomputes each stage).
# total = state + saved + max(working set, logits): the loss's logits (and their gradient) are
# freed before the last layer's backward forms its working set; both peak over all of `saved`.
# On TPU under a policy that recomputes, working set + logits: XLA:TPU's schedule starts the
# last layer's recompute while the logits are held (with the sum, within 10% of the compiled
# figure on 20 of the 28 preset rows of docs/benchmarks.md, all recomputing; with the max, 11).
# Under `none` the max (three small MoE compiles on v5p-8, tests/test_planner.py).

#: The remat policies in order of cost (recomputed FLOPs), cheapest first; `auto` walks this.
REMAT_BY_COST = (
    "none",
    "minimal_with_context",
    "minimal",
    "save_matmuls",
    "save_except_mlp_in",
    "save_attention",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "full",
)


def remat_policies(m) -> tuple[str, ...]:
    """REMAT_BY_COST for model config `m`: save_except_mlp_in only where it differs from
    save_attention, in MoE layers (a dense MLP's output is never needed by its backward)."""
    return tuple(p for p in REMAT_BY_COST if m.moe is not None or p != "save_except_mlp_in")


#: Checkpoint names each policy keeps on the device, the table the model's policies are built
#: from (offload_matmuls: the minimal names go to pinned host memory); `layer_input` is always
#: kept (the scanned layer's carry).
SAVED_NAMES = REMAT_KEPT_NAMES


def name_bytes_per_token(m, tensor: int = 1, moe_rows: float = 1.0) -> dict[str, float]:
    """Bytes per token per layer of each checkpoint name (heads / mlp shard over tensor);
    `moe_rows`: rows the expert matmuls run over per assignment (moe_row_factor)."""
    a, t, att = DTYPE_BYTES.get(m.compute_dtype, 4), max(1, tensor), attention_shape(m)
    mlp, outputs, routing = m.mlp_dim, 1, 0
    if m.moe is not None:  # top-k experts' intermediates per token (plus shared ones)
        mlp = m.moe.mlp_dim(m) * (m.moe.top_k * moe_rows + m.moe.num_shared_experts)
        outputs = m.moe.top_k  # mlp_out: the top_k expert outputs per token, before the combine
        # routing: int32 expert ids, and dropless's two sort orders, per assignment
        routing = 4 * m.moe.top_k * (1 if m.moe.dispatch == "capacity" else 3)
    return {
        "layer_input": m.d_model * a,
        "qkv_proj": att.qkv * a / t,
        "context": (att.context * a + 4 * m.n_heads) / t,  # the output and its f32 softmax statistics
        "out_proj": m.d_model * a,
        "mlp_in": 2 * mlp * a / t,
        "mlp_out": outputs * m.d_model * a,
        "routing": routing,
    }


def layer_bytes_per_token(
    m, tensor: int = 1, moe_rows: float = 1.0, ep: int = 1, padded: bool = False, per_shard: bool = False
) -> float:
    """Everything one layer's backward uses with nothing recomputed (remat none): the named
    checkpoints plus the norms' f32 inputs, f32 normalised values and outputs, q/k before RoPE
    (latent attention: its up-projections' outputs, and its latents with their norms),
    the residual and SwiGLU's three elementwise operands (silu(gate), its derivative's
    operand, the product), and in MoE layers the routed rows (formulas above; `per_shard`:
    the layer sends a token once per expert shard, dispatch_per_shard). The f32
    normalised value and the dense third operand were added against the compiled H100 step
    of configs/gpu-peer.yaml (remat none: -10.6% before, +5% after; tests/test_gpu_memory_plan.py)."""
    n = name_bytes_per_token(m, tensor, moe_rows)
    a = DTYPE_BYTES.get(m.compute_dtype, 4)
    extra = 2 * m.d_model * (4 + 4 + a)  # two RMSNorms: f32 input, f32 normalised, output
    att = attention_shape(m)
    extra += att.projected * a / max(1, tensor)  # q, k before RoPE (MLA: before the heads' split)
    # latent attention's latents (replicated over tensor) and their norms (f32 in, f32 normalised, out)
    extra += att.latent * a + att.latent_normed * (4 + 4 + a)
    extra += m.d_model * a  # residual after attention
    extra += n["mlp_in"] * 1.5  # silu(gate), its derivative's operand, silu(gate) * up
    if m.moe is not None:
        k = m.moe.top_k
        per_shard = per_shard and ep > 1
        sent = shards_per_token(m.moe, ep) if per_shard else k  # rows a token sends (and gets back)
        # the sorted input (R rows), the outputs sorted (A rows; per shard the n rows back; in
        # token order they are mlp_out) and combined
        extra += (moe_rows * k + sent) * m.d_model * a + m.d_model * a
        if ep > 1:  # the receive buffer's outputs, in sorted and in buffer order (R rows each)
            extra += 2 * moe_rows * k * m.d_model * a
        if padded and ep > 1:  # the padded all_to_all's send and receive buffers: [ep, T, D] per shard
            extra += 2 * ep * (1 if per_shard else k) * m.d_model * a
    return sum(n.values()) + extra


def moe_row_factor(cfg: Config, mesh_sizes: dict[str, int]) -> float:
    """R / A: rows the expert matmuls run over per routed assignment on one device (1 for
    dense models and dropless without expert parallelism; formulas above)."""
    m = cfg.model
    if m.moe is None:
        return 1.0
    if m.moe.dispatch == "capacity":
        seq = cfg.train.seq_len // max(1, mesh_sizes.get("context", 1))
        return m.moe.num_experts * capacity(seq, m.moe) / (m.moe.top_k * seq)
    ep = max(1, mesh_sizes.get("expert", 1))
    if ep == 1:
        return 1.0
    if dispatch_per_shard(m.moe, ep):  # ep x T rows, each expanded to k_local expert slots
        return ep * min(m.moe.top_k, m.moe.num_experts // ep) / m.moe.top_k

    rows, seq = microbatch_shape(cfg, mesh_product(mesh_sizes))
    a = rows * seq * m.moe.top_k
    return receive_rows(a, ep, m.moe) / a


def moe_weight_bytes(cfg: Config, mesh_sizes: dict[str, int]) -> float:
    """One MoE layer's expert weights as its shard_map holds them: the device's E/ep experts
    gathered whole (mlp split over tensor), in the parameter dtype."""
    m = cfg.model
    if m.moe is None:
        return 0.0
    size = mesh_product(mesh_sizes)
    experts = m.moe.num_experts / size("expert")
    return 3 * experts * m.d_model * m.moe.mlp_dim(m) / size("tensor") * DTYPE_BYTES.get(m.param_dtype, 4)


def saved_bytes_per_token(m, remat: str, tensor: int = 1, remat_custom=(), **moe) -> float:
    """Bytes per token per layer a policy keeps on the device between forward and backward
    (`moe`: layer_bytes_per_token's moe_rows, ep, padded, per_shard)."""
    if remat == "none":
        return layer_bytes_per_token(m, tensor, **moe)
    n = name_bytes_per_token(m, tensor, moe.get("moe_rows", 1.0))
    names = (
        tuple(k for k, mode in remat_custom if mode == "device")
        if remat == "custom"
        else SAVED_NAMES.get(remat, ())
    )
    # a dense MLP's output is never needed by its backward, so the compiler drops it even where
    # the policy may keep it (MoE: the router weights' gradient needs the expert outputs)
    unused = ("layer_input",) if m.moe is not None else ("layer_input", "mlp_out")
    return n["layer_input"] + sum(n[k] for k in names if k not in unused)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """An estimate in bytes per device (footprint.estimate); `total` is the peak."""

    state: int
    saved: int
    working: int
    logits: int
    # XLA:TPU's schedule holds the loss's logits while the last layer's recompute forms its
    # working set; XLA:GPU (and CPU) frees them first (formulas above)
    logits_with_working: bool = False

    @property
    def total(self) -> int:
        if self.logits_with_working:
            return self.state + self.saved + self.working + self.logits
        return self.state + self.saved + max(self.working, self.logits)


def lora_share(m, per_param: float, p: int) -> float:
    """The state's bytes with model.lora over what they would be if every parameter trained:
    the base holds its weights alone (`p` bytes each: no gradient, no moments), the adapters
    `per_param` each (taken as spread over the mesh like the whole; they are a few percent of
    it). 1.0 without LoRA."""
    if m.lora is None:
        return 1.0
    total, adapters = m.param_count(), m.adapter_param_count()
    return (p * (total - adapters) + per_param * adapters) / (per_param * total)


def expert_params(m) -> int:
    """Parameters of the routed experts, their biases (model.moe.expert_bias) included, in the
    MoE layers and the prediction modules' blocks (model.mtp): all sharded over mesh.expert;
    0 for dense models."""
    if m.moe is None:
        return 0
    d, f = m.d_model, m.moe.mlp_dim(m)
    per_expert = 3 * d * f + ((2 * f + d) if m.moe.expert_bias else 0)
    layers = m.moe.num_moe_layers(m) + (m.mtp.depth if m.mtp is not None else 0)
    return layers * m.moe.num_experts * per_expert


def layer_stack_params(m) -> int:
    """Parameters inside the repeated layers and the prediction modules (model.mtp, which run
    in a layer loop of their own and never with stages): what pipeline stages split; the
    embedding, the final norm and an untied head stay outside."""
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return m.param_count(include_embedding=False) - m.d_model - head


def estimate(cfg: Config, mesh_sizes: dict[str, int], platform: str | None = None) -> Estimate:
    """The step's peak memory per device, estimated (formulas above), for a config whose
    `train.loss_chunk` is resolved (planning/resolve.py; `model.remat` is the policy to
    estimate), on `platform` ("tpu" counts the logits and the working set at once when the
    policy recomputes). The attention implementation, the MoE exchange and model.cpu_tuning
    are read as the model reads them (`auto` as the portable default: xla, padded, off)."""
    m, t = cfg.model, cfg.train
    if t.loss_chunk == "auto":
        raise ValueError(
            "footprint.estimate: train.loss_chunk=auto: resolve the config first (planning/resolve.py)"
        )
    size = mesh_product(mesh_sizes)
    stages = size("stage")
    p = DTYPE_BYTES.get(m.param_dtype, 4)
    per_param = (2 + reference_copies(cfg)) * p + moment_bytes(cfg) / _moment_shards(cfg, size)
    per_param += 4 if t.microbatches > 1 else 0
    stack, experts = layer_stack_params(m), expert_params(m)
    # the routed experts shard over expert too; every other parameter only over fsdp x tensor
    state = (stack - experts) / stages + m.param_count() - stack
    state = (state + experts / (stages * size("expert"))) * per_param / size("fsdp", "tensor")
    state *= lora_share(m, per_param, p)
    state -= compact_grad_savings(cfg, size)
    saved, working, att_rows = activation_bytes(cfg, mesh_sizes)
    rows, seq = microbatch_shape(cfg, size)
    tp, a = size("tensor"), DTYPE_BYTES.get(m.compute_dtype, 4)
    if m.attention_impl in ("xla", "auto"):  # [rows, heads, seq, seq] probs and f32 scores, one layer
        working += att_rows * max(1, m.n_heads // tp) * seq * t.seq_len * (a + 4)
    depth = m.mtp.depth if m.mtp is not None else 0  # the prediction modules' losses use the head too
    if t.loss_chunk:  # trainer/loss.py: one chunk of logits live, plus d loss / d x in f32
        chunk = max(1, min(seq, t.loss_chunk // size("context")))
        logits = 2 * 4 * rows * chunk * max(1, m.vocab_size // tp) + (1 + depth) * 4 * rows * seq * m.d_model
    else:
        logits = (2 + depth) * 4 * rows * seq * max(1, m.vocab_size // tp)
    logits /= stages  # outside the pipeline the compiler spreads the head over stage too (compiled)
    return Estimate(
        state=int(state), saved=int(saved), working=int(working), logits=int(logits),
        logits_with_working=platform == "tpu" and m.remat != "none",
    )  # fmt: skip


def pipeline_inputs_held(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """How many [T/M, D] tensors (one pipeline microbatch's activations between stages) a
    device keeps for the backward pass under `schedule`:

    - gpipe, circular (sharding/pipeline.py): the scan keeps every iteration's stage input,
      M R + S - 1 of them (all M R microbatch-blocks, and the bubble's iterations);
    - 1f1b, interleaved_1f1b, zero_bubble (sharding/tick_pipeline.py): the stash of inputs in
      flight and the inbox of their output gradients, each as many slots as the table keeps
      alive at once on a stage (`slots`), whatever M is: S inputs and one gradient for 1f1b,
      S and S for zero_bubble (gradients wait for their deferred W), R S inputs and a few
      gradients for interleaved_1f1b (S=4, R=2: 8 and 3; S=8, R=2: 16 and 5)."""
    if schedule in ("gpipe", "circular"):
        return microbatches * repeats + stages - 1
    tick_table = schedule_table(schedule, stages, microbatches, repeats)
    return sum(slots(tick_table))


def activation_bytes(cfg: Config, mesh_sizes: dict[str, int]) -> tuple[float, float, float]:
    """(saved, working set, rows of one attention's scores) of `estimate` (formulas above)."""
    m = cfg.model
    size = mesh_product(mesh_sizes)
    stages, tp, a = size("stage"), size("tensor"), DTYPE_BYTES.get(m.compute_dtype, 4)
    rows, seq = microbatch_shape(cfg, size)
    tokens = rows * seq
    moe = {}
    if m.moe is not None:
        padded = m.moe.exchange in ("padded", "auto")
        moe = dict(
            moe_rows=moe_row_factor(cfg, mesh_sizes),
            ep=size("expert"),
            padded=padded,
            per_shard=dispatch_per_shard(m.moe, size("expert")),
        )
    kept = saved_bytes_per_token(m, m.remat, tp, m.remat_custom, **moe)
    expert_weights = moe_weight_bytes(cfg, mesh_sizes)  # one MoE layer's, gathered
    moe_layers = m.moe.num_moe_layers(m) if m.moe is not None else 0
    if stages == 1:
        # the prediction modules (model.mtp; never with stages): a layer's keep and their embeddings
        depth = m.mtp.depth if m.mtp is not None else 0
        saved = m.n_layers * tokens * kept + depth * tokens * (kept + m.d_model * a)
        if m.remat == "none":
            saved += (moe_layers + (depth if m.moe is not None else 0)) * expert_weights
        if m.gathers_weights_once and m.remat == "none":  # gathered matmul weights (models/cpu_tuning.py)
            saved += (layer_stack_params(m) - expert_params(m)) * a / tp
        return saved, tokens * layer_bytes_per_token(m, tp, **moe) + expert_weights, rows
    pm, reps = cfg.pipeline.resolved_microbatches(stages), cfg.pipeline.repeats
    t_pm = tokens / pm  # tokens of one pipeline microbatch
    held = pipeline_inputs_held(cfg.pipeline.schedule, stages, pm, reps)
    saved = held * t_pm * m.d_model * a  # stage inputs (and gradients) kept for the backward
    saved += 2 * tokens * m.d_model * a  # the microbatch buffers in and out (not on stage)
    saved += m.n_layers / (stages * reps) * t_pm * kept  # one iteration's backward
    if m.remat == "none":
        saved += moe_layers / (stages * reps) * expert_weights
    working = t_pm * layer_bytes_per_token(m, tp, **moe) + expert_weights
    # the iteration's block of layers gathered whole (fsdp) in the parameter dtype: the
    # stage recompute holds its weights (or their unreduced gradients) at once
    working += (
        layer_stack_params(m) / (stages * reps) * DTYPE_BYTES.get(m.param_dtype, 4) / (tp * size("expert"))
    )
    return saved, working, rows / pm
