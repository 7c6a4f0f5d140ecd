"""The model's configuration: a frozen dataclass with no jax import, so the CLI
can read and validate it before any backend starts."""

from __future__ import annotations

import dataclasses

# `model.remat`: what each layer's backward pass may keep from its forward pass (the jax
# policies are in models/transformer.py `remat_policy`). The names are the activation
# checkpoints the layers tag with `jax.ad_checkpoint.checkpoint_name` (CHECKPOINT_NAMES).
REMAT_POLICIES = (
    "none",  # no jax.checkpoint: keep everything
    "full",  # keep nothing: recompute the whole layer
    "minimal",  # keep every matmul output: qkv_proj, out_proj, mlp_in, mlp_out (MaxText "minimal")
    "minimal_with_context",  # minimal and attention's output and softmax statistics (context):
    #   no attention forward in the backward pass (MaxText "minimal_with_context")
    "save_dot_except_mlp",  # qkv_proj, out_proj
    "save_qkv_proj",  # qkv_proj
    "save_out_proj",  # out_proj
    "save_attention",  # the attention sub-layer: qkv_proj, context, out_proj
    "save_except_mlp_in",  # all but mlp_in: qkv_proj, context, out_proj, mlp_out (MoE: the
    #   expert outputs, which the router weights' gradient needs; dense: as save_attention)
    "offload_matmuls",  # the "minimal" names, offloaded to pinned host memory
    "custom",  # model.remat_custom: {name: device | offload | recompute}
    "save_matmuls",  # any matmul without batch dims (jax's dots_with_no_batch_dims_saveable)
)
# `model.remat: auto` (the default) is resolved to one of REMAT_POLICIES before the program is
# built: the cheapest that fits the devices in use (jaxtrain/planning/resolve.py).
REMAT_AUTO = "auto"
# routing: an MoE layer's expert choices and dropless sort orders (int32), which every policy
# but full keeps
CHECKPOINT_NAMES = ("layer_input", "qkv_proj", "context", "out_proj", "mlp_in", "mlp_out", "routing")
# The names each policy keeps on the device, one table for the model (models/transformer.py
# builds the jax policies from it) and the planner (jaxtrain/planning/footprint.py counts their
# bytes). save_matmuls keeps every matmul without batch dims (jax's rule: the matmul names);
# offload_matmuls sends the matmul names to host memory. Every policy but full keeps MoE
# layers' routing decisions (int32, a few bytes per token): recomputed, the backward repeats
# the top-k and the sorts of dropless dispatch, which on an H100 cost minimal_with_context
# 1.1% of the 8-expert step of docs/benchmarks.md.
MATMUL_NAMES = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")
REMAT_KEPT_NAMES = {
    "full": (),
    "minimal": (*MATMUL_NAMES, "routing"),
    "minimal_with_context": (*MATMUL_NAMES, "context", "routing"),
    "save_matmuls": (*MATMUL_NAMES, "routing"),
    "save_dot_except_mlp": ("qkv_proj", "out_proj", "routing"),
    "save_qkv_proj": ("qkv_proj", "routing"),
    "save_out_proj": ("out_proj", "routing"),
    "save_attention": ("qkv_proj", "context", "out_proj", "routing"),
    "save_except_mlp_in": ("qkv_proj", "context", "out_proj", "mlp_out", "routing"),
    "offload_matmuls": ("routing",),
}
REMAT_CUSTOM_MODES = ("device", "offload", "recompute")
FP8_HISTORY_DEFAULT = 1024
ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_mosaic", "cudnn")
# The implementations that run our Pallas flash kernel (Triton / Mosaic TPU, or the Hopper one)
FLASH_ATTENTION_IMPLS = ("pallas", "pallas_mosaic")
GPU_FLASH_KERNELS = ("auto", "triton", "mosaic")  # model.gpu_flash_kernel
CONTEXT_IMPLS = ("ring", "ulysses")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element of each of DTYPES
ROPE_SCALINGS = (None, "linear", "llama3", "yarn")
QK_NORMS = ("none", "head", "projection")
NORM_PLACEMENTS = ("pre", "post", "both")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_KINDS = ("local", "global")
# `model.layer_types` (Hugging Face's name): each layer's token mixer, linear attention (gated
# DeltaNet, models/linear_attention.py) or full attention (the model's attention)
LAYER_TYPES = ("linear_attention", "full_attention")
# `model.linear_attention.impl`: the gated delta rule in XLA or as the Pallas kernels
LINEAR_ATTENTION_IMPLS = ("auto", "xla", "pallas")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_DISPATCHES = ("capacity", "dropless")
MOE_EXCHANGES = ("auto", "padded", "ragged")
MOE_GROUPED_MATMULS = ("auto", "ragged_dot", "megablox", "triton", "mosaic")
# `model.moe.expert_activation`: silu (SwiGLU: silu(gate) * up) | clamped_swiglu (GPT-OSS:
# (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped above at swiglu_limit, up to
# [-swiglu_limit, swiglu_limit])
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
# `model.lora.targets`: the matmul weights an adapter may sit on (models/lora.py); on an MoE
# layer w_gate / w_up / w_down are its experts' (one adapter per expert). With
# model.attention_output_gate, wq's adapter spans HF's whole q_proj (query and gate rows), as
# PEFT's one adapter on q_proj does. The gated DeltaNet layers' projections keep their Hugging
# Face / PEFT module names (models/linear_attention.py)
LINEAR_LORA_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", *LINEAR_LORA_TARGETS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters (models/lora.py; Hu et al. 2021, as PEFT's LoRA): each targeted weight
    W computes W x + (alpha / rank) B (A x), A [rank, in] kaiming-uniform as torch's Linear
    (PEFT's default), B [out, rank] zeros, so a fresh adapter starts as the base. Only A and
    B train; the base (train.init_from) is frozen and holds no gradients or optimizer state."""

    rank: int = 8  # r
    alpha: float = 16.0  # the update is scaled by alpha / rank
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")  # LORA_TARGETS
    dropout: float = 0.0  # on the adapter's input only (PEFT's lora_dropout), training steps only
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from;
    # null: fresh adapters
    init_from: str | None = None

    def __post_init__(self):
        if isinstance(self.targets, (list, str)):  # YAML gives a list (or one name)
            object.__setattr__(
                self, "targets", (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            )

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"model.lora.rank={self.rank}: expected a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha}: expected a positive number")
        if not self.targets:
            raise ValueError(f"model.lora.targets=[]: expected some of {LORA_TARGETS}")
        for t in self.targets:
            if t not in LORA_TARGETS:
                raise ValueError(
                    f"model.lora.targets: {t!r} is not a target; expected some of {LORA_TARGETS}"
                )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"model.lora.targets={list(self.targets)}: a target appears twice")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout}: expected a value in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """Multi-token prediction (models/mtp.py; DeepSeek-V3 report section 2.2): `depth` modules
    in sequence after the main model, module k predicting token t + k + 1 from module k - 1's
    hidden state (the main model's last residual, before its final norm, for k = 1) and the
    embedding of token t + k; their cross-entropy joins the training objective. Generation
    uses the main model alone. `model.mtp: null`: none."""

    depth: int = 1  # prediction modules (DeepSeek-V3: 1, predicting the token after next)
    # the mean of the modules' cross-entropies, times this, is added to the main loss
    # (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)
    loss_weight: float = 0.3

    def validate(self) -> None:
        if self.depth < 1:
            raise ValueError(f"model.mtp.depth={self.depth}: expected a positive integer")
        if not self.loss_weight >= 0:
            raise ValueError(f"model.mtp.loss_weight={self.loss_weight}: expected a number >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (models/moe.py); `model.moe: null` is a dense model.

    Layers: the first `first_dense_layers` are dense, the rest come in groups of
    `every` layers whose last one is MoE (every=1: all MoE; every=2: every other).
    """

    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # routed experts each token goes to
    expert_mlp_dim: int | None = None  # per expert; None: model.mlp_dim
    num_shared_experts: int = 0  # always-on experts (DeepSeek-MoE), one fused SwiGLU of width n * F
    # the shared experts' fused width, when not n * F (Qwen3-Next / Qwen3.5-MoE's
    # shared_expert_intermediate_size); null: num_shared_experts x the expert width
    shared_expert_mlp_dim: int | None = None
    # the shared experts' output scaled per token by sigmoid(x . w) (Qwen2-MoE, Qwen3-Next,
    # Qwen3.5-MoE's shared_expert_gate; parameter `shared_expert_gate` [d_model])
    shared_expert_gate: bool = False
    scoring: str = "softmax"  # softmax (Mixtral, GShard, Switch) | sigmoid (DeepSeek-V3)
    normalize_top_k: bool = True  # renormalise the k selected weights to sum to 1
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): the experts form num_groups
    # equal groups, a group scores the sum of its two best (biased) scores, and a token picks
    # its top_k experts among the top_k_groups best groups only. 1: no groups.
    num_groups: int = 1
    top_k_groups: int = 1  # groups a token's experts may come from (<= num_groups)
    # the routed experts' weights (after any renormalisation) are multiplied by this
    # (DeepSeek-V3: 2.5); the shared experts' output is not
    routed_scaling_factor: float = 1.0
    score_bias: bool = False  # aux-loss-free balancing: non-gradient bias on selection only
    score_bias_rate: float = 1e-3  # per step: bias += rate * sign(mean load - expert load)
    dispatch: str = "dropless"  # capacity (GShard, drops over-capacity tokens) | dropless (ragged_dot)
    capacity_factor: float = 1.25  # capacity: slots per expert per sequence = ceil(k * seq * cf / E)
    # Dropless expert parallelism: padded all_to_all | ragged (ragged_all_to_all) | auto (ragged
    # on TPU/GPU, padded on CPU, where ragged_all_to_all is unimplemented; a model built
    # directly with auto runs padded)
    exchange: str = "auto"
    # Dropless grouped matmul: auto (megablox on TPU; on GPU the measured choice of
    # planning/grouped_matmul_choice.py, triton until measured; ragged_dot on CPU; a model
    # built directly with auto runs ragged_dot) | ragged_dot (XLA's jax.lax.ragged_dot) |
    # megablox (JAX's Pallas TPU kernel gmm/tgmm, as MaxText's megablox=True; interpret mode
    # off TPU, for tests) | triton (our Pallas Triton kernel, any GPU; interpreted off GPU) |
    # mosaic (JAX's Mosaic GPU ragged-dot kernels, Hopper only, bf16, d_model and the
    # expert width multiples of 128). fp8 experts always use ragged_dot.
    grouped_matmul: str = "auto"
    # Dropless expert parallelism: rows of each shard's receive buffer, as a multiple of one
    # source's assignments A (1.0 = the balanced load). 0: ep x A, the worst case, never drops;
    # f > 0: ceil(f x A), the grouped matmul shrinks to match and overflow is dropped
    # (counted in dropped_fraction), as MaxText's ragged_buffer_factor.
    receive_factor: float = 0.0
    # Dropless expert parallelism: send a token once to each expert shard it needs, with its
    # experts' ids and weights there, and get one combined row back (DeepSeek-V3's node-limited
    # dispatch; models/moe.py `dispatch_per_shard`), instead of once per chosen expert. auto:
    # where that sends fewer rows (a token reaches fewer than top_k shards: num_groups a
    # multiple of the expert-parallel degree and top_k_groups < top_k, or fewer shards than
    # top_k) and receive_factor is 0 | true (receive_factor 0 only) | false
    dispatch_per_shard: bool | str = "auto"
    aux_loss_weight: float = 0.01  # Switch load-balancing loss (1.0 when perfectly balanced)
    z_loss_weight: float = 1e-3  # router z-loss: mean logsumexp(router logits)^2
    first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-MoE: 1)
    every: int = 1  # one MoE layer in every `every` layers after those (1: all; 2: every other)
    # A trained bias on the router logits (GPT-OSS): it chooses the experts and weights them,
    # and gradients move it; unlike score_bias, which only chooses and is moved by the load
    router_logit_bias: bool = False
    # Biases on each expert's gate, up and down projections (GPT-OSS); the routing weight
    # multiplies the down projection's bias with the rest of the expert's output
    expert_bias: bool = False
    expert_activation: str = "silu"  # EXPERT_ACTIVATIONS: silu | clamped_swiglu (GPT-OSS)
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, -limit <= up <= limit

    def validate(self, cfg: ModelConfig) -> None:
        for key in ("num_experts", "top_k", "every"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.moe.{key}={getattr(self, key)}: expected a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k}: expected <= model.moe.num_experts={self.num_experts}"
            )
        self._validate_groups()
        if self.expert_mlp_dim is not None and self.expert_mlp_dim < 1:
            raise ValueError(
                f"model.moe.expert_mlp_dim={self.expert_mlp_dim}: expected a positive integer or null"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"model.moe.num_shared_experts={self.num_shared_experts}: expected >= 0")
        if self.shared_expert_mlp_dim is not None and self.shared_expert_mlp_dim < 1:
            raise ValueError(
                f"model.moe.shared_expert_mlp_dim={self.shared_expert_mlp_dim}: expected a positive "
                "integer or null"
            )
        for key in ("shared_expert_mlp_dim", "shared_expert_gate"):
            if getattr(self, key) not in (None, False) and not self.num_shared_experts:
                raise ValueError(
                    f"model.moe.{key}={getattr(self, key)!r} with model.moe.num_shared_experts=0: "
                    "expected shared experts (num_shared_experts >= 1)"
                )
        for key, allowed in (
            ("expert_activation", EXPERT_ACTIVATIONS),
            ("scoring", MOE_SCORINGS),
            ("dispatch", MOE_DISPATCHES),
            ("exchange", MOE_EXCHANGES),
            ("grouped_matmul", MOE_GROUPED_MATMULS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.moe.{key}={getattr(self, key)!r}: expected one of {allowed}")
        if self.capacity_factor <= 0:
            raise ValueError(f"model.moe.capacity_factor={self.capacity_factor}: expected > 0")
        if self.receive_factor < 0:
            raise ValueError(
                f"model.moe.receive_factor={self.receive_factor}: expected >= 0 "
                "(0: worst-case receive buffer, no drops)"
            )
        if self.dispatch_per_shard not in (True, False, "auto"):
            raise ValueError(
                f"model.moe.dispatch_per_shard={self.dispatch_per_shard!r}: expected auto, true or false"
            )
        if self.dispatch_per_shard is True and (self.dispatch != "dropless" or self.receive_factor):
            raise ValueError(
                f"model.moe.dispatch_per_shard=true with model.moe.dispatch={self.dispatch!r}, "
                f"receive_factor={self.receive_factor}: applies to dispatch=dropless with "
                "receive_factor 0 only; expected auto or false"
            )
        if self.receive_factor and self.dispatch != "dropless":
            raise ValueError(
                f"model.moe.receive_factor={self.receive_factor}: applies to "
                f"dispatch=dropless only (got dispatch={self.dispatch!r}); expected 0"
            )
        for key in ("aux_loss_weight", "z_loss_weight", "score_bias_rate"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.moe.{key}={getattr(self, key)}: expected >= 0")
        for key in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.moe.{key}={getattr(self, key)}: expected a positive number")
        if not 0 <= self.first_dense_layers < cfg.n_layers:
            raise ValueError(
                f"model.moe.first_dense_layers={self.first_dense_layers}: expected 0 <= "
                f"value < model.n_layers={cfg.n_layers} (at least one MoE layer)"
            )
        if (cfg.n_layers - self.first_dense_layers) % self.every:
            raise ValueError(
                f"model.moe.every={self.every}: expected a divisor of model.n_layers - "
                f"model.moe.first_dense_layers = {cfg.n_layers - self.first_dense_layers}"
            )
        if cfg.scan_pattern:
            self._validate_with_pattern(cfg)

    def shared_mlp_dim(self, cfg: ModelConfig) -> int:
        """The shared experts' fused SwiGLU width (0 without them)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_expert_mlp_dim or self.num_shared_experts * self.mlp_dim(cfg)

    def _validate_with_pattern(self, cfg: ModelConfig) -> None:
        """MoE layers with model.attention_pattern (GPT-OSS: sliding and full alternating) or
        the layer kinds of model.layer_types (Qwen3.5-MoE): the MoE stack scans in groups of one
        pattern (models/transformer.py MoEPatternGroup), so every layer after the dense prefix is
        MoE and the prefix is whole patterns."""
        key = "attention_pattern" if cfg.attention_pattern else "layer_types"
        n = len(cfg.scan_pattern)
        if self.every != 1:
            raise ValueError(
                f"model.moe.every={self.every} with model.{key}={list(getattr(cfg, key))}: "
                "expected 1 (every layer after the dense ones MoE)"
            )
        if self.first_dense_layers % n:
            raise ValueError(
                f"model.moe.first_dense_layers={self.first_dense_layers} with model.{key}="
                f"{list(getattr(cfg, key))}: expected a multiple of the pattern's length {n}"
            )
        if self.score_bias:
            raise ValueError(
                f"model.moe.score_bias=true with model.{key}: not supported yet (the "
                "balancing update reads one load row per stacked layer); expected false"
            )

    def _validate_groups(self) -> None:
        """Group-limited routing's keys (num_groups, top_k_groups, routed_scaling_factor)."""
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"model.moe.num_groups={self.num_groups}: expected a positive divisor of "
                f"model.moe.num_experts={self.num_experts}"
            )
        if not 1 <= self.top_k_groups <= self.num_groups:
            raise ValueError(
                f"model.moe.top_k_groups={self.top_k_groups}: expected 1 <= value <= "
                f"model.moe.num_groups={self.num_groups}"
            )
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(
                f"model.moe.num_groups={self.num_groups}: a group scores its two best experts; expected "
                f"at least 2 experts per group (model.moe.num_experts={self.num_experts})"
            )
        if self.num_groups > 1 and self.top_k > self.top_k_groups * per_group:
            raise ValueError(
                f"model.moe.top_k={self.top_k}: expected <= model.moe.top_k_groups x experts per group "
                f"= {self.top_k_groups * per_group}"
            )
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"model.moe.routed_scaling_factor={self.routed_scaling_factor}: expected > 0")

    def mlp_dim(self, cfg: ModelConfig) -> int:
        return self.expert_mlp_dim if self.expert_mlp_dim is not None else cfg.mlp_dim

    def num_moe_layers(self, cfg: ModelConfig) -> int:
        return (cfg.n_layers - self.first_dense_layers) // self.every


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (models/mla.py; DeepSeek-V2/V3, Kimi K2, Moonlight), named as
    Hugging Face's DeepseekV3Config: queries from d_model (or through a latent of q_lora_rank
    with its RMSNorm), keys and values from one latent of kv_lora_rank (with its RMSNorm)
    up-projected per head into a no-RoPE key part and the value; one RoPE key part of
    qk_rope_head_dim, straight from the down-projection, is shared by all heads. A head's query
    and key have qk_nope_head_dim + qk_rope_head_dim values, its value v_head_dim.
    `model.n_heads` counts the heads (n_kv_heads must equal it; head_dim is unused)."""

    q_lora_rank: int | None = None  # the query's latent width; null: a plain query projection
    kv_lora_rank: int = 512  # the key/value latent's width
    qk_nope_head_dim: int = 128  # per head: the query/key values without RoPE
    qk_rope_head_dim: int = 64  # the RoPE part: per query head, one key part shared by all heads
    v_head_dim: int = 128  # per head: the value's width

    def validate(self, cfg: ModelConfig) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.mla.{key}={getattr(self, key)}: expected a positive integer")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"model.mla.q_lora_rank={self.q_lora_rank}: expected a positive integer or null")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim}: RoPE needs an even width")
        if cfg.n_kv_heads != cfg.n_heads:
            raise ValueError(
                f"model.n_kv_heads={cfg.n_kv_heads} with model.mla: latent attention expands keys and "
                f"values for every head; expected model.n_kv_heads = model.n_heads = {cfg.n_heads}"
            )
        unsupported = {
            "qkv_bias": cfg.qkv_bias,
            "qk_norm": cfg.qk_norm != "none",
            "attention_pattern": bool(cfg.attention_pattern),
            "fp8": cfg.fp8,
            "lora": cfg.lora is not None,
        }
        for key, on in unsupported.items():
            if on:
                raise ValueError(
                    f"model.{key}={getattr(cfg, key)!r} with model.mla: not supported with latent attention"
                )

    @property
    def qk_head_dim(self) -> int:
        """A query's (and key's) width per head: the no-RoPE and the RoPE parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def param_count(self, cfg: ModelConfig) -> int:
        """One layer's latent-attention parameters (projections and latent norm scales)."""
        d, h = cfg.d_model, cfg.n_heads
        ql, kvl = self.q_lora_rank, self.kv_lora_rank
        q = d * h * self.qk_head_dim if ql is None else d * ql + ql + ql * h * self.qk_head_dim
        kv = d * (kvl + self.qk_rope_head_dim) + kvl + kvl * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """Gated DeltaNet (models/linear_attention.py; Qwen3.5 / Qwen3.6, Qwen3-Next), the layers
    `model.layer_types` marks `linear_attention`; named after Hugging Face's `linear_num_key_heads`
    etc. Value head h reads key head h // (num_value_heads / num_key_heads), as GQA."""

    num_key_heads: int = 2  # linear_num_key_heads: q and k heads
    num_value_heads: int = 4  # linear_num_value_heads: a multiple of num_key_heads
    key_head_dim: int = 32  # linear_key_head_dim
    value_head_dim: int = 32  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim: the causal depthwise conv over q | k | v
    # the chunked delta rule's implementation, LINEAR_ATTENTION_IMPLS: xla (plain jnp,
    # models/gated_deltanet.py) | pallas (the Pallas kernels, pallas_kernels/gated_delta.py, per
    # shard; interpreted on CPU) | auto (planning/resolve.py: xla everywhere for now, the
    # kernel not yet run or timed on a device). Decode's token-by-token rule is always jnp.
    impl: str = "auto"

    def validate(self) -> None:
        for key in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"model.linear_attention.{key}={getattr(self, key)}: expected a positive integer"
                )
        if self.impl not in LINEAR_ATTENTION_IMPLS:
            raise ValueError(
                f"model.linear_attention.impl={self.impl!r}: expected one of {LINEAR_ATTENTION_IMPLS}"
            )
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"model.linear_attention.num_value_heads={self.num_value_heads}: expected a multiple of "
                f"model.linear_attention.num_key_heads={self.num_key_heads}"
            )

    @property
    def values_per_key(self) -> int:
        """Value heads per key head (r)."""
        return self.num_value_heads // self.num_key_heads

    @property
    def group_width(self) -> int:
        """One key head's group of q | k | v channels: 2 key_head_dim + r value_head_dim."""
        return 2 * self.key_head_dim + self.values_per_key * self.value_head_dim

    def param_count(self, cfg: ModelConfig) -> int:
        """One layer's parameters (models/linear_attention.py)."""
        d, hk, hv, dv = cfg.d_model, self.num_key_heads, self.num_value_heads, self.value_head_dim
        channels = hk * self.group_width
        return d * channels + 2 * d * hv * dv + 2 * d * hv + channels * self.conv_kernel + 2 * hv + dv


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only Llama-style transformer (RMSNorm, RoPE, GQA, SwiGLU), with the variants
    of the families models/hf/ reads (q/k/v biases, QK-norm, post-norms)."""

    vocab_size: int = 512  # token ids are 0 .. vocab_size - 1
    d_model: int = 128  # the residual stream's width
    n_layers: int = 2  # decoder blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 4  # key/value heads: n_heads (MHA), fewer (GQA), 1 (MQA); divides n_heads
    head_dim: int | None = None  # None: d_model // n_heads
    mlp_dim: int = 512  # SwiGLU hidden width (dense layers; MoE experts: moe.expert_mlp_dim)
    rope_theta: float = 10000.0  # RoPE base
    # None | linear | llama3 (Llama 3.1+ long-context frequencies) | yarn (YaRN, Peng et al.
    # 2023, as transformers computes it: DeepSeek-V3, GPT-OSS)
    rope_scaling: str | None = None
    rope_scaling_factor: float = 1.0  # linear / llama3 / yarn: how much longer the context gets
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 and yarn: the context the model was trained on
    rope_beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept (extrapolated)
    rope_beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by the factor
    # yarn: round the ramp's ends to whole dimensions (transformers' `truncate`; GPT-OSS: false)
    rope_truncate: bool = True
    # yarn: cos and sin are multiplied by this (`attention_factor`); null: from the mscales,
    # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
    # 0.1 ln(factor) + 1 (get_mscale(s, m) = 0.1 m ln(s) + 1, 1 for s <= 1)
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None  # yarn (DeepSeek's `mscale`); null: unset
    # yarn (DeepSeek's `mscale_all_dim`), with model.mla: the softmax scale is also multiplied
    # by get_mscale(factor, mscale_all_dim) ** 2; null: unset
    rope_mscale_all_dim: float | None = None
    # RoPE's rotated pairs are adjacent values (x0, x1), (x2, x3), ... (DeepSeek's
    # checkpoints: `rope_interleave`) rather than the two halves ("rotate half", Llama)
    rope_interleave: bool = False
    sliding_window: int | None = None  # Mistral-style: a query sees at most the last N keys
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2 / Qwen2.5)
    attention_out_bias: bool = False  # a bias on the attention's output projection (GPT-OSS)
    # a learned logit per query head that joins every softmax's denominator and carries no
    # value (GPT-OSS's attention sinks): a query may attend to "nothing"
    attention_sinks: bool = False
    # RMSNorm on q and k before RoPE: none | head (over each head's head_dim, one scale of
    # head_dim shared by the heads: Qwen3) | projection (over all of q's and all of k's heads
    # at once, a scale per element: OLMo 2)
    qk_norm: str = "none"
    # where each block's norms sit: pre (x + f(norm(x)): Llama, Qwen) | post (x + norm(f(x)):
    # OLMo 2; the final norm stays) | both (x + norm2(f(norm1(x))): Gemma 2 and 3)
    norm_placement: str = "pre"
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    # every RMSNorm multiplies by (norm_scale_offset + scale), its scales starting at
    # 1 - offset (Gemma: 1.0, scales stored around 0)
    norm_scale_offset: float = 0.0
    embedding_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(d_model))
    mlp_activation: str = "silu"  # the gated MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    attention_scale: float | None = None  # the softmax's query scale; None: head_dim ** -0.5
    # cap * tanh(x / cap) on the attention scores (before the mask) and on the output logits
    # (Gemma 2: 50 and 30); null: none
    attention_softcap: float | None = None
    final_softcap: float | None = None
    # layer kinds repeating over the depth: local (a sliding window of `sliding_window` keys)
    # or global (full causal attention); layer i is attention_pattern[i % len]. Empty: every
    # layer as `sliding_window` says (Mistral). Gemma 2: [local, global]; Gemma 3: five local,
    # one global; GPT-OSS: [local, global]. The layers scan in groups of one pattern, so it
    # must divide n_layers. Every layer has `rope_theta` with `rope_scaling` (GPT-OSS's YaRN
    # on sliding and full layers alike) unless `local_rope_theta` is set: then local layers
    # have that base and no scaling (Gemma 3: 10000 unscaled; its global layers 1e6, x8).
    attention_pattern: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # own unscaled RoPE base of local layers; None: shared
    # each layer's token mixer, LAYER_TYPES (Hugging Face's `layer_types`): linear_attention
    # (gated DeltaNet, `linear_attention`) or full_attention (the attention above); layer i is
    # layer_types[i % len], so the whole per-layer list (as HF's configs have it) or one repeat
    # (Qwen3.5: three linear, one full). The layers scan in groups of its shortest repeat.
    # Empty: every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None  # the linear_attention layers' shape
    # full attention's output gate (Qwen3.5, Qwen3-Next): each head's query projection has a
    # second head_dim of gate, and the attention output is multiplied by its sigmoid before the
    # output projection (`wq_gate`)
    attention_output_gate: bool = False
    # RoPE on the first partial_rotary_factor x head_dim values of each head only, the rest
    # unrotated (Qwen3.5: 0.25); its frequencies are those of a head that wide
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = False  # the output head is the embedding table's transpose
    init_std: float = 0.02  # normal init of weights (output projections: / sqrt(2 x n_layers))
    param_dtype: str = "float32"  # master weights (and optimizer state)
    compute_dtype: str = "float32"  # matmuls and activations
    remat: str = REMAT_AUTO  # REMAT_POLICIES, or auto: the cheapest that fits (planning/resolve.py)
    # remat=custom: checkpoint name -> device (keep in HBM) | offload (pinned host) | recompute;
    # a YAML mapping, stored as sorted (name, mode) pairs (the config must stay hashable)
    remat_custom: tuple[tuple[str, str], ...] = ()
    # FP8 matmuls (models/fp8.py): e4m3 operands, e5m2 gradients, delayed per-tensor scales
    # from the amax of the last `fp8_amax_history` steps (kept in the train state)
    fp8: bool = False
    fp8_amax_history: int = FP8_HISTORY_DEFAULT
    # The layer loop: true runs one compiled layer body in a jax.lax.scan; false unrolls it
    # (same parameters, no stacked buffers to copy activations into, compile time growing with
    # depth); auto: unrolled on one GPU up to planning/resolve.py's UNROLL_MAX_LAYERS layers,
    # scanned elsewhere (a model built directly with auto scans)
    scan_layers: bool | str = "auto"
    # The layer loop keeps weight gradients in the compute dtype until its backward ends
    # (models/layer_scan.py: the same values, 2 bytes less per layer parameter at the peak with
    # f32 weights and bf16 compute); false: autodiff's scan
    compact_grads: bool = True
    # auto | xla | pallas | cudnn (auto: on GPU the fastest measured that runs the case,
    # planning/attention_speeds.py; pallas on TPU; xla on CPU; resolved when the program is
    # built; a model built directly with auto runs xla). cudnn: jax.nn.dot_product_attention's
    # cuDNN kernel, rows packing several documents fall back to the Pallas kernel
    attention_impl: str = "auto"
    # Which of our Pallas flash kernels runs on a GPU (attention_impl pallas, the cuDNN path's
    # fallback for rows packing several documents, ring and Ulysses blocks): triton (any GPU) |
    # mosaic (pallas_kernels/flash_mgpu.py, Hopper) | auto (mosaic on Hopper where it takes the
    # case, planning/attention_speeds.py; a model built directly with auto runs triton).
    # attention_impl pallas_mosaic runs mosaic whatever this says; TPU and CPU ignore it.
    gpu_flash_kernel: str = "auto"
    # XLA:CPU's program changes (models/cpu_tuning.py): auto (on when the program runs on CPU)
    # | true | false. Same values as the portable program; TPU/GPU programs never have them.
    cpu_tuning: bool | str = "auto"
    context_impl: str = "ring"  # ring | ulysses: attention when the mesh has context > 1
    moe: MoEConfig | None = None  # mixture of experts (models/moe.py); None: dense
    # multi-head latent attention (models/mla.py; DeepSeek-V3) in every layer; None: GQA
    mla: MLAConfig | None = None
    # low-rank adapters on a frozen base (models/lora.py); None: every weight trains
    lora: LoRAConfig | None = None
    # multi-token prediction modules, trained with the model, unused by generation
    # (models/mtp.py); None: none
    mtp: MTPConfig | None = None

    def __post_init__(self):
        # A mapping (Python callers, YAML) or pairs in any order -> sorted (name, mode) pairs.
        custom = self.remat_custom
        pairs = custom.items() if isinstance(custom, dict) else custom
        pairs = [tuple(p) for p in pairs] if not isinstance(pairs, str) else None
        if pairs is None or any(len(p) != 2 for p in pairs):
            raise ValueError(
                f"model.remat_custom={custom!r}: expected a mapping {{checkpoint name: device | offload | "
                "recompute}"
            )
        object.__setattr__(self, "remat_custom", tuple(sorted(pairs)))
        if isinstance(self.attention_pattern, (list, tuple)):  # YAML gives a list
            object.__setattr__(self, "attention_pattern", tuple(self.attention_pattern))
        if isinstance(self.layer_types, (list, tuple)):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    @property
    def unrolled_layers(self) -> bool:
        """The layer loop runs unrolled: `scan_layers: false` (auto, unresolved, scans)."""
        return self.scan_layers is False

    @property
    def gathers_weights_once(self) -> bool:
        """models/cpu_tuning.py `gathered_weight` applies: CPU tuning in bfloat16 (on the
        bench-peer step under remat none it was faster in bfloat16 and slower in float32)."""
        return self.cpu_tuning is True and self.compute_dtype == "bfloat16"

    @property
    def compact_weight_grads(self) -> bool:
        """The layer loop keeps the weights' gradients in the compute dtype until its backward
        ends (models/layer_scan.py): `compact_grads`, weights wider than the compute dtype, and
        no activations offloaded to the host (autodiff's scan places those residuals)."""
        offloads = self.remat == "offload_matmuls" or any(mode == "offload" for _, mode in self.remat_custom)
        wider = DTYPE_BYTES.get(self.param_dtype, 4) > DTYPE_BYTES.get(self.compute_dtype, 4)
        return self.compact_grads is True and wider and not offloads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def attention_widths(self) -> tuple[int, int]:
        """A head's (query/key, value) widths: the scores' and the weighted sum's contractions
        (latent attention: qk_nope_head_dim + qk_rope_head_dim and v_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_head_dim, self.mla.v_head_dim
        return self.resolved_head_dim, self.resolved_head_dim

    def validate(self) -> None:
        """Raise ValueError naming the key, the value and what was expected."""
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"model.{key}={value}: expected a positive integer")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim={self.head_dim}: expected a positive integer or null")
        if self.head_dim is None and self.d_model % self.n_heads and self.mla is None:
            raise ValueError(
                f"model.d_model={self.d_model}: expected a multiple of model.n_heads="
                f"{self.n_heads} (or set model.head_dim)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads}: expected a divisor of model.n_heads={self.n_heads}"
            )
        if self.resolved_head_dim % 2 and self.mla is None:  # MLA: its RoPE part (MLAConfig)
            raise ValueError(f"model.head_dim={self.resolved_head_dim}: RoPE needs an even head_dim")
        for key in ("param_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"model.{key}={getattr(self, key)!r}: expected one of {DTYPES}")
        if self.remat not in (REMAT_AUTO, *REMAT_POLICIES):
            raise ValueError(f"model.remat={self.remat!r}: expected auto or one of {REMAT_POLICIES}")
        for name, mode in self.remat_custom:
            if name not in CHECKPOINT_NAMES:
                raise ValueError(
                    f"model.remat_custom.{name}: unknown checkpoint name; expected one of {CHECKPOINT_NAMES}"
                )
            if mode not in REMAT_CUSTOM_MODES:
                raise ValueError(f"model.remat_custom.{name}={mode!r}: expected one of {REMAT_CUSTOM_MODES}")
        if len({n for n, _ in self.remat_custom}) != len(self.remat_custom):
            raise ValueError(f"model.remat_custom={self.remat_custom}: a checkpoint name appears twice")
        if self.remat_custom and self.remat != "custom":
            raise ValueError(
                f"model.remat_custom is set but model.remat={self.remat!r}: expected model.remat=custom"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"model.attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}"
            )
        if self.attention_impl == "cudnn" and self.compute_dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"model.attention_impl=cudnn with model.compute_dtype={self.compute_dtype}: cuDNN's "
                "attention takes bfloat16 or float16; expected one of those, or attention_impl pallas/xla"
            )
        if self.attention_impl == "pallas_mosaic":
            self._check_mosaic_attention("model.attention_impl=pallas_mosaic", "attention_impl pallas")
        if self.gpu_flash_kernel not in GPU_FLASH_KERNELS:
            raise ValueError(
                f"model.gpu_flash_kernel={self.gpu_flash_kernel!r}: expected one of {GPU_FLASH_KERNELS}"
            )
        if self.gpu_flash_kernel == "mosaic":
            self._check_mosaic_attention("model.gpu_flash_kernel=mosaic", "gpu_flash_kernel triton or auto")
        if self.cpu_tuning not in (True, False, "auto"):
            raise ValueError(f"model.cpu_tuning={self.cpu_tuning!r}: expected auto, true or false")
        if self.scan_layers not in (True, False, "auto"):
            raise ValueError(f"model.scan_layers={self.scan_layers!r}: expected auto, true or false")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r}: expected one of {ROPE_SCALINGS}")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"model.rope_scaling_factor={self.rope_scaling_factor}: expected > 0")
        self._validate_yarn()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model.sliding_window={self.sliding_window}: expected >= 1 or null")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r}: expected one of {QK_NORMS}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(
                f"model.norm_placement={self.norm_placement!r}: expected one of {NORM_PLACEMENTS}"
            )
        if self.context_impl not in CONTEXT_IMPLS:
            raise ValueError(f"model.context_impl={self.context_impl!r}: expected one of {CONTEXT_IMPLS}")
        self._validate_gemma_features()
        self._validate_hybrid_features()
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("model.rope_theta, model.norm_eps and model.init_std must be positive")
        if self.fp8_amax_history < 1:
            raise ValueError(f"model.fp8_amax_history={self.fp8_amax_history}: expected a positive integer")
        if self.fp8 and self.compute_dtype == "float16":
            raise ValueError(
                "model.fp8=true with model.compute_dtype='float16': fp8 scaling and loss scaling "
                "together are not supported; use compute_dtype bfloat16"
            )
        if self.moe is not None:
            self.moe.validate(self)
        if self.mla is not None:
            self.mla.validate(self)
        if self.mtp is not None:
            self.mtp.validate()
            if self.fp8:
                raise ValueError(
                    "model.mtp with model.fp8=true: the prediction modules have no fp8 state yet; "
                    "expected model.mtp null or model.fp8 false"
                )
        if self.lora is not None:
            self.lora.validate()
            linear = [t for t in self.lora.targets if t in LINEAR_LORA_TARGETS]
            if linear and not self.has_linear_attention:
                raise ValueError(
                    f"model.lora.targets {linear}: gated DeltaNet projections, but model.layer_types has "
                    "no linear_attention layer; expected targets from "
                    f"{[t for t in LORA_TARGETS if t not in LINEAR_LORA_TARGETS]}"
                )
            experts = [t for t in self.lora.targets if t in ("w_gate", "w_up", "w_down")]
            if self.moe is not None and experts and self.lora.dropout:
                raise ValueError(
                    f"model.lora.dropout={self.lora.dropout} with model.lora.targets {experts} on an MoE "
                    "model: expert adapters are folded into the expert weights, which has no input "
                    "dropout; expected dropout 0, or attention targets only"
                )

    def _validate_hybrid_features(self) -> None:
        """The Qwen3.5 / Qwen3-Next hybrids' keys (layer_types, linear_attention, the attention
        output gate, partial RoPE), and what they do not run with yet, refused in one line."""
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor}: expected a number in (0, 1]"
            )
        rotary = self.rotary_dim
        if self.partial_rotary_factor != 1 and (rotary < 2 or rotary % 2):
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor}: rotates {rotary} of head_dim "
                f"{self.resolved_head_dim} values; expected an even number >= 2"
            )
        if self.mla is not None and (self.attention_output_gate or self.partial_rotary_factor != 1):
            raise ValueError(
                "model.attention_output_gate / partial_rotary_factor with model.mla: not supported with "
                "latent attention; expected false / 1.0"
            )
        if self.attention_output_gate and self.fp8:
            raise ValueError(
                "model.attention_output_gate=true with model.fp8=true: the gate projection has no fp8 "
                "state yet; expected model.fp8 false"
            )
        types = self.layer_types
        if not types:
            if self.linear_attention is not None:
                raise ValueError(
                    "model.linear_attention is set but model.layer_types is empty: expected layer_types "
                    "with linear_attention layers, or model.linear_attention null"
                )
            return
        if any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"model.layer_types={list(types)}: expected kinds from {LAYER_TYPES}")
        if self.n_layers % len(types):
            raise ValueError(
                f"model.layer_types has {len(types)} entries: expected model.n_layers={self.n_layers} "
                "of them, or a repeat whose length divides it"
            )
        if self.attention_pattern:
            raise ValueError(
                f"model.layer_types with model.attention_pattern={list(self.attention_pattern)}: not "
                "supported together yet; expected attention_pattern []"
            )
        if "linear_attention" not in types:
            if self.linear_attention is not None:
                raise ValueError(
                    "model.linear_attention is set but model.layer_types has no linear_attention layer; "
                    "expected model.linear_attention null"
                )
            return
        if self.linear_attention is None:
            raise ValueError(
                "model.layer_types has linear_attention layers: expected model.linear_attention "
                "{num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel}"
            )
        self.linear_attention.validate()
        refused = {
            "mla": self.mla is not None,
            "fp8": self.fp8,
            "mtp": self.mtp is not None,
        }
        for key, on in refused.items():
            if on:
                raise ValueError(
                    f"model.{key}={getattr(self, key)!r} with linear_attention layers (model.layer_types): "
                    f"not supported yet; expected model.{key} off"
                )

    def _validate_yarn(self) -> None:
        """YaRN's settings (model.rope_beta_*, rope_attention_factor, rope_mscale*)."""
        if self.rope_original_max_position < 1:
            raise ValueError(
                f"model.rope_original_max_position={self.rope_original_max_position}: "
                "expected a positive integer"
            )
        if self.rope_beta_fast <= 0 or self.rope_beta_slow <= 0:
            raise ValueError(
                f"model.rope_beta_fast={self.rope_beta_fast}, model.rope_beta_slow={self.rope_beta_slow}: "
                "expected positive numbers"
            )
        for key in ("rope_attention_factor", "rope_mscale", "rope_mscale_all_dim"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"model.{key}={value}: expected a positive number or null")
            if value is not None and self.rope_scaling != "yarn":
                raise ValueError(
                    f"model.{key}={value} with model.rope_scaling={self.rope_scaling!r}: applies to yarn only"
                )
        if self.rope_mscale_all_dim is not None and self.mla is None:
            raise ValueError(
                f"model.rope_mscale_all_dim={self.rope_mscale_all_dim}: scales the softmax of latent "
                "attention (DeepSeek); expected model.mla, or null"
            )

    def _validate_gemma_features(self) -> None:
        """The features Gemma 2 and 3 need (norm offset, softcaps, layer pattern, GeGLU)."""
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"model.mlp_activation={self.mlp_activation!r}: expected one of {MLP_ACTIVATIONS}"
            )
        for key in ("attention_scale", "attention_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"model.{key}={value}: expected a positive number or null")
        if self.embedding_scale <= 0:
            raise ValueError(f"model.embedding_scale={self.embedding_scale}: expected a positive number")
        pattern = self.attention_pattern
        if pattern:
            if any(kind not in LAYER_KINDS for kind in pattern):
                raise ValueError(
                    f"model.attention_pattern={list(pattern)}: expected kinds from {LAYER_KINDS}"
                )
            if self.n_layers % len(pattern):
                raise ValueError(
                    f"model.attention_pattern={list(pattern)}: its length must divide model.n_layers="
                    f"{self.n_layers} (the layers scan in groups of one pattern)"
                )
            if "local" in pattern and self.sliding_window is None:
                raise ValueError(
                    f"model.attention_pattern={list(pattern)} has local layers: expected model.sliding_window"
                )
        if self.norm_placement == "both" and self.moe is not None:
            raise ValueError(
                "model.norm_placement=both with model.moe: not supported yet (dense models only)"
            )
        if self.attention_sinks and self.attention_impl == "cudnn":
            raise ValueError(
                "model.attention_sinks=true with model.attention_impl=cudnn: cuDNN's attention takes no "
                "sinks; expected attention_impl auto, pallas, pallas_mosaic or xla"
            )
        if self.attention_softcap is not None and self.attention_impl == "cudnn":
            raise ValueError(
                f"model.attention_softcap={self.attention_softcap} with model.attention_impl=cudnn: "
                "cuDNN's attention takes no softcap; expected attention_impl pallas, xla or auto"
            )

    def _check_mosaic_attention(self, key: str, instead: str) -> None:
        """What the Mosaic GPU flash kernel (Hopper) takes, named at the door: `key` the setting
        that asked for it, `instead` the setting that avoids it."""
        from jaxtrain.pallas_kernels.flash_mgpu import HEAD_DIMS

        what = f"{key} (the Hopper flash kernel)"
        if self.compute_dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"{what} with model.compute_dtype={self.compute_dtype}: its wgmma operands are 16-bit; "
                f"expected bfloat16 or float16, or {instead}"
            )
        if self.resolved_head_dim not in HEAD_DIMS:
            raise ValueError(
                f"{what} with head_dim {self.resolved_head_dim}: expected one of {HEAD_DIMS}, or {instead}"
            )
        if self.attention_softcap is not None:
            raise ValueError(
                f"{what} with model.attention_softcap={self.attention_softcap}: it takes no softcap; "
                f"expected {instead}"
            )

    @property
    def flash_kernel_on_gpu(self) -> str:
        """The Pallas flash kernel this model's attention runs on a GPU: "mosaic" or "triton"."""
        if self.attention_impl == "pallas_mosaic":
            return "mosaic"
        return "mosaic" if self.gpu_flash_kernel == "mosaic" else "triton"

    @property
    def layers_per_group(self) -> int:
        """Layers in one scanned element of the dense stack: the whole attention pattern, or
        layer_types' shortest repeat (models/blocks.py PatternGroup), else 1."""
        return max(1, len(self.scan_pattern))

    @property
    def scan_pattern(self) -> tuple[str, ...]:
        """The layer kinds of one scanned group (models/blocks.py PatternGroup): attention_pattern,
        else the shortest repeat of layer_types (() when every layer is the same: full attention)."""
        if self.attention_pattern:
            return self.attention_pattern
        types = self.layer_types
        if not types or "linear_attention" not in types:
            return ()
        n = len(types)
        return next(types[:p] for p in range(1, n + 1) if not n % p and types == types[:p] * (n // p))

    @property
    def has_linear_attention(self) -> bool:
        """Some layer is gated DeltaNet (`layer_types`)."""
        return "linear_attention" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        """The values of each head RoPE rotates (partial_rotary_factor of head_dim, as
        transformers' int(head_dim * factor))."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def n_linear_layers(self) -> int:
        """Layers whose token mixer is gated DeltaNet (`layer_types`' linear_attention ones)."""
        return self.layer_kinds_by_type.count("linear_attention") if self.has_linear_attention else 0

    @property
    def layer_kinds_by_type(self) -> tuple[str, ...]:
        """Each layer's `layer_types` kind (full_attention for all without them)."""
        types = self.layer_types or ("full_attention",)
        return tuple(types[i % len(types)] for i in range(self.n_layers))

    @property
    def layer_kinds(self) -> tuple[str | None, ...]:
        """Each layer's kind (attention_pattern repeated), None for all without a pattern."""
        pattern = self.attention_pattern or (None,)
        return tuple(pattern[i % len(pattern)] for i in range(self.n_layers))

    def param_count(self, *, include_embedding: bool = True) -> int:
        """Exact number of parameters (matches the built model; tests check it)."""
        d, hd, L = self.d_model, self.resolved_head_dim, self.n_layers
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        extra = (d if self.attention_out_bias else 0) + (self.n_heads if self.attention_sinks else 0)
        attn += extra  # the output bias and the sinks
        attn += {"none": 0, "head": 2 * hd, "projection": hd * (self.n_heads + self.n_kv_heads)}[self.qk_norm]
        if self.attention_output_gate:
            attn += d * hd * self.n_heads
        if self.mla is not None:  # no q/k/v biases or QK-norm with it (MLAConfig.validate)
            attn = self.mla.param_count(self) + extra
        mlp = 3 * d * self.mlp_dim
        per_layer = attn + mlp + (4 if self.norm_placement == "both" else 2) * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total = L * per_layer + d + head + (embed if include_embedding else 0)
        if self.has_linear_attention:  # those layers' token mixer in place of attention
            total += self.n_linear_layers * (self.linear_attention.param_count(self) - attn)
        total += self.adapter_param_count()
        if self.moe is not None:
            m, f = self.moe, self.moe.mlp_dim(self)
            moe_mlp = (
                d * m.num_experts * (1 + 3 * f)
                + (m.num_experts if m.score_bias else 0)
                + (m.num_experts if m.router_logit_bias else 0)
                + (m.num_experts * (2 * f + d) if m.expert_bias else 0)
                + 3 * d * m.shared_mlp_dim(self)
                + (d if m.shared_expert_gate else 0)
            )
            total += m.num_moe_layers(self) * (moe_mlp - mlp)
        return total + self.mtp_param_count()

    def mtp_param_count(self) -> int:
        """Parameters of the multi-token prediction modules (model.mtp; 0 without): per depth
        three norms, eh_proj [2 d_model, d_model] and one block of the model's own kind (an MoE
        block on MoE models), adapters included: a one-layer model's layer."""
        if self.mtp is None:
            return 0
        one_moe = None if self.moe is None else dataclasses.replace(self.moe, first_dense_layers=0, every=1)
        one = dataclasses.replace(self, n_layers=1, moe=one_moe, mtp=None)
        block = one.param_count(include_embedding=False) - self.d_model  # less the final norm
        block -= 0 if self.tie_embeddings else self.vocab_size * self.d_model  # and the head
        return self.mtp.depth * (3 * self.d_model + 2 * self.d_model * self.d_model + block)

    def adapter_param_count(self) -> int:
        """Parameters of the LoRA adapters (model.lora; 0 without): r x (fan_in + fan_out) per
        targeted weight, per expert on MoE layers."""
        if self.lora is None:
            return 0
        d, hd, r, t = self.d_model, self.resolved_head_dim, self.lora.rank, self.lora.targets
        qo, kv = self.n_heads * hd, self.n_kv_heads * hd
        q_out = 2 * qo if self.attention_output_gate else qo  # the gate's rows too (LORA_TARGETS)
        attn = sum(
            r * (d + n) for name, n in (("wq", q_out), ("wk", kv), ("wv", kv), ("wo", qo)) if name in t
        )
        linear = 0
        if self.has_linear_attention:
            la = self.linear_attention
            hk, hv, dv = la.num_key_heads, la.num_value_heads, la.value_head_dim
            sizes = {
                "in_proj_qkv": hk * la.group_width,
                "in_proj_z": hv * dv,
                "in_proj_b": hv,
                "in_proj_a": hv,
            }
            linear = sum(r * (d + n) for name, n in {**sizes, "out_proj": hv * dv}.items() if name in t)
        mlp_targets = sum(name in t for name in ("w_gate", "w_up", "w_down"))
        n_moe = 0 if self.moe is None else self.moe.num_moe_layers(self)
        dense = self.n_layers - n_moe
        per_expert = 0 if self.moe is None else self.moe.num_experts * r * (d + self.moe.mlp_dim(self))
        n_linear = self.n_linear_layers
        mixers = (self.n_layers - n_linear) * attn + n_linear * linear
        return mixers + mlp_targets * (dense * r * (d + self.mlp_dim) + n_moe * per_expert)

    def active_param_count(self, *, include_embedding: bool = True) -> int:
        """Parameters one token uses (MoE: top_k routed + shared experts; dense: all)."""
        total = self.param_count(include_embedding=include_embedding)
        if self.moe is None:
            return total
        m, f = self.moe, self.moe.mlp_dim(self)
        per_expert = 3 * self.d_model * f + ((2 * f + self.d_model) if m.expert_bias else 0)
        idle = per_expert * (m.num_experts - m.top_k)
        mtp_moe_layers = 0 if self.mtp is None else self.mtp.depth  # their blocks are MoE too
        return total - (m.num_moe_layers(self) + mtp_moe_layers) * idle
