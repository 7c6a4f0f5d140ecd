"""The families table (`_FAMILIES`: each class's features, model_type and MoE layout) and
config.json both ways: `config_from_hf` reads one as a ModelConfig, `hf_config` writes one for a
ModelConfig (the class with its features, or a named one, which must have them). What a family
adds beyond the table lives in its own module: deepseek.py, gemma.py, gpt_oss.py, qwen3_5.py."""

from __future__ import annotations

from jaxtrain.models.config import ModelConfig, MoEConfig
from jaxtrain.models.hf import fp8 as hf_fp8
from jaxtrain.models.hf import qwen3_5 as hf_qwen3_5
from jaxtrain.models.hf.common import HFConversionError
from jaxtrain.models.hf.deepseek import _DEEPSEEK, _deepseek_hf_config, _deepseek_settings
from jaxtrain.models.hf.gemma import _GEMMA, _gemma_hf_fields, _gemma_settings
from jaxtrain.models.hf.gpt_oss import _GPT_OSS, _check_gpt_oss_features, _gpt_oss_settings
from jaxtrain.models.hf.rope import _hf_rope, _rope_settings

# The features each class has (qkv_bias, qk_norm, norm_placement), its model_type, and where
# its MoE layers keep their tensors (None: dense).
_FAMILIES = {
    "LlamaForCausalLM": ((False, "none", "pre"), "llama", None),
    "MistralForCausalLM": ((False, "none", "pre"), "mistral", None),
    "MixtralForCausalLM": ((False, "none", "pre"), "mixtral", "mixtral"),
    "Qwen2ForCausalLM": ((True, "none", "pre"), "qwen2", None),
    "Qwen3ForCausalLM": ((False, "head", "pre"), "qwen3", None),
    "Qwen3MoeForCausalLM": ((False, "head", "pre"), "qwen3_moe", "qwen"),
    "Olmo2ForCausalLM": ((False, "projection", "post"), "olmo2", None),
    "Gemma2ForCausalLM": ((False, "none", "both"), "gemma2", None),
    "Gemma3ForCausalLM": ((False, "head", "both"), "gemma3_text", None),
    "DeepseekV3ForCausalLM": ((False, "none", "pre"), "deepseek_v3", "deepseek"),
    "GptOssForCausalLM": ((True, "none", "pre"), "gpt_oss", "gpt_oss"),
    # Qwen3.5 / 3.6 dense hybrids (models/hf/qwen3_5.py): gated DeltaNet and gated full attention
    "Qwen3_5ForCausalLM": ((False, "head", "pre"), hf_qwen3_5.MODEL_TYPE, None),
    "Qwen3_5ForConditionalGeneration": ((False, "head", "pre"), "qwen3_5", None),
    "Qwen3_5MoeForCausalLM": ((False, "head", "pre"), hf_qwen3_5.MOE_MODEL_TYPE, "qwen3_5"),
    "Qwen3_5MoeForConditionalGeneration": ((False, "head", "pre"), "qwen3_5_moe", "qwen3_5"),
    "Qwen3NextForCausalLM": ((False, "head", "pre"), "qwen3_next", "qwen3_5"),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> mlp_activation


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json` (of a ConditionalGeneration class, the text
    model's: models/hf/qwen3_5.py)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConversionError(
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    if arch in hf_qwen3_5.ARCHITECTURES:
        try:
            hf = hf_qwen3_5.text_config(hf)
        except ValueError as e:
            raise HFConversionError(str(e)) from None
    for flag in ("attention_bias", "mlp_bias"):
        # (Qwen2's q/k/v biases are not a flag: the class always has them; GPT-OSS's all four)
        if hf.get(flag) and not (flag == "attention_bias" and arch == _GPT_OSS):
            raise HFConversionError(f"config.json {flag}=true is not supported")
    # Gemma names its activation hidden_activation; a loader reading hidden_act alone (or
    # defaulting to silu) would be silently wrong
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise HFConversionError(
            f"activation {act!r} is not supported (expected one of {tuple(_ACTIVATIONS)})"
        )
    _fp8_block(hf)  # refuses a quantization that does not import (one line naming it)
    if hf.get("use_sliding_window"):  # Qwen2/3 write sliding_window with use_sliding_window false
        raise HFConversionError(
            "config.json use_sliding_window=true is not supported (per-layer windows, max_window_layers)"
        )
    (qkv_bias, qk_norm, placement), _, moe_layout = _FAMILIES[arch]
    n_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        mlp_dim=hf.get("intermediate_size") or hf["moe_intermediate_size"],  # (MoE: no dense layer)
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        norm_placement=placement,
        mlp_activation=_ACTIVATIONS[act],
        **_rope_settings(hf),
    )
    if arch in _GEMMA:
        fields.update(_gemma_settings(hf))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    if arch == _DEEPSEEK:
        fields.update(_deepseek_settings(hf))
    elif arch == _GPT_OSS:
        fields.update(_gpt_oss_settings(hf))
    elif arch in hf_qwen3_5.ARCHITECTURES:
        fields.update(hf_qwen3_5.settings(hf))
        if moe_layout is not None:
            try:
                fields["moe"] = hf_qwen3_5.moe_settings(hf)
            except ValueError as e:
                raise HFConversionError(str(e)) from None
    elif moe_layout is not None:
        fields["moe"] = _moe_from_hf(hf, moe_layout)
    fields.update(overrides)
    cfg = ModelConfig(**fields)
    cfg.validate()
    return cfg


def _moe_from_hf(hf: dict, layout: str) -> MoEConfig:
    """Mixtral's or Qwen3-MoE's router and experts: softmax top-k (renormalised: Mixtral
    always, Qwen3-MoE with norm_topk_prob), no shared experts, every layer MoE, dropless."""
    k = hf["num_experts_per_tok"]
    if layout == "qwen":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise HFConversionError(
                f"config.json mlp_only_layers={hf.get('mlp_only_layers')} decoder_sparse_step="
                f"{hf.get('decoder_sparse_step')}: only every layer MoE (mlp_only_layers=[], step 1) converts"
            )
        experts = hf.get("num_experts") or hf.get("num_local_experts")  # both spellings occur
        width, normalize = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", True))
    else:
        experts, width, normalize = hf["num_local_experts"], hf["intermediate_size"], True
    return MoEConfig(
        num_experts=experts,
        top_k=k,
        expert_mlp_dim=width,
        scoring="softmax",
        normalize_top_k=normalize,
        dispatch="dropless",
        # HF sums its load-balancing loss over the k choices; ours averages (1.0 = balanced).
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.02)) * k,
        z_loss_weight=0.0,  # transformers adds no router z-loss
    )


def _architecture_for(cfg: ModelConfig) -> str:
    """The HF class whose features `cfg` has (Mistral for a dense model with a window)."""
    if cfg.mla is not None:
        return _DEEPSEEK
    if cfg.layer_types or cfg.attention_output_gate or cfg.partial_rotary_factor != 1:
        return hf_qwen3_5.causal_lm_for(cfg)  # its features (or a refusal that names them)
    features = (cfg.qkv_bias, cfg.qk_norm, cfg.norm_placement)
    for arch, (needs, _, moe_layout) in _FAMILIES.items():
        if arch == _DEEPSEEK:
            continue
        if needs == features and (moe_layout is None) == (cfg.moe is None):
            if arch == "LlamaForCausalLM" and cfg.sliding_window:
                continue
            return arch
    raise HFConversionError(
        f"no Hugging Face class has model.qkv_bias={cfg.qkv_bias}, model.qk_norm={cfg.qk_norm!r}, "
        f"model.norm_placement={cfg.norm_placement!r} with model.moe={'set' if cfg.moe else 'null'}"
    )


def hf_config(cfg: ModelConfig, architecture: str | None = None) -> dict:
    """An HF `config.json` dict for `cfg`: the class with its features (Mistral for a dense
    pre-norm model with a sliding window), or `architecture`, which must have them."""
    arch = architecture or _architecture_for(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConversionError(
            f"architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    hybrid = cfg.layer_types or cfg.attention_output_gate or cfg.partial_rotary_factor != 1
    if arch in hf_qwen3_5.ARCHITECTURES or hybrid:
        if arch not in hf_qwen3_5.ARCHITECTURES:
            raise HFConversionError(
                f"architecture {arch!r}: model.layer_types, attention_output_gate and "
                f"partial_rotary_factor convert as {hf_qwen3_5.causal_lm_for(cfg)!r} only"
            )
        try:
            hf_qwen3_5.check_exportable(cfg, arch)
        except ValueError as e:
            raise HFConversionError(str(e)) from None
        return hf_qwen3_5.hf_config(cfg, _hf_rope(cfg), arch)
    if arch == _DEEPSEEK or cfg.mla is not None:
        return _deepseek_hf_config(cfg, arch)
    (needs, model_type, moe_layout) = _FAMILIES[arch]
    if (moe_layout is not None) != (cfg.moe is not None):
        raise HFConversionError(f"architecture {arch!r} does not match model.moe={cfg.moe!r}")
    if needs != (cfg.qkv_bias, cfg.qk_norm, cfg.norm_placement):
        raise HFConversionError(
            f"architecture {arch!r} has qkv_bias={needs[0]}, qk_norm={needs[1]!r}, norm_placement="
            f"{needs[2]!r}; the model has {cfg.qkv_bias}, {cfg.qk_norm!r}, {cfg.norm_placement!r}"
        )
    if arch in _GEMMA:
        wrong = [
            f"model.{key}={value!r} (expected {want!r})"
            for key, value, want, same in (
                ("norm_scale_offset", cfg.norm_scale_offset, 1.0, cfg.norm_scale_offset == 1.0),
                (
                    "embedding_scale",
                    cfg.embedding_scale,
                    cfg.d_model**0.5,
                    abs(cfg.embedding_scale - cfg.d_model**0.5) < 1e-6,
                ),
                ("mlp_activation", cfg.mlp_activation, "gelu_tanh", cfg.mlp_activation == "gelu_tanh"),
            )
            if not same
        ]
        if wrong:
            raise HFConversionError(f"architecture {arch!r}: " + "; ".join(wrong))
    elif (
        (cfg.attention_pattern and arch != _GPT_OSS)
        or cfg.attention_softcap
        or cfg.final_softcap
        or (cfg.norm_scale_offset)
    ):
        raise HFConversionError(
            f"architecture {arch!r}: model.attention_pattern, softcaps and norm_scale_offset do not convert"
        )
    _check_gpt_oss_features(cfg, arch)
    # local layers with their own unscaled RoPE: Gemma 3's config.json alone can say so (GPT-OSS,
    # Gemma 2: one rotary embedding for every layer)
    same_rope = (cfg.local_rope_theta, cfg.rope_scaling) == (cfg.rope_theta, None)
    own_local = cfg.local_rope_theta is not None and not same_rope and bool(cfg.attention_pattern)
    if own_local and arch != "Gemma3ForCausalLM":
        raise HFConversionError(
            f"architecture {arch!r}: model.local_rope_theta={cfg.local_rope_theta} does not convert "
            "(its local layers share the global RoPE); expected null"
        )
    if cfg.sliding_window and arch not in ("MistralForCausalLM", "MixtralForCausalLM", _GPT_OSS, *_GEMMA):
        raise HFConversionError(
            f"architecture {arch!r}: model.sliding_window={cfg.sliding_window} does not convert"
        )
    if cfg.moe is not None:
        m = cfg.moe
        if (
            m.first_dense_layers,
            m.every,
            m.num_shared_experts,
            m.scoring,
            m.normalize_top_k,
            m.score_bias,
        ) != (0, 1, 0, "softmax", True, False):
            if not (moe_layout == "qwen" and not m.normalize_top_k):  # norm_topk_prob=false
                raise HFConversionError(
                    "only Mixtral- or Qwen3-MoE-style MoE converts to HF: every layer MoE, no shared "
                    "experts, softmax scoring renormalised over the top-k, no score bias"
                )
    if cfg.rope_interleave:
        raise HFConversionError(f"architecture {arch!r}: model.rope_interleave does not convert")
    rope = _hf_rope(cfg)
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": {v: k for k, v in _ACTIVATIONS.items()}[cfg.mlp_activation],
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max(cfg.rope_original_max_position, 4096),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
    }
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = cfg.sliding_window
    if arch in _GEMMA:
        out.update(_gemma_hf_fields(cfg, rope))
    if arch.startswith("Qwen"):  # the class reads these; no window, as jaxtrain trained it
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if arch == "Qwen2ForCausalLM":
        del out["attention_bias"]  # Qwen2 has its q/k/v biases whatever the flag says
    if arch == "MixtralForCausalLM":
        out.update(
            num_local_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            intermediate_size=cfg.moe.mlp_dim(cfg),
            router_aux_loss_coef=cfg.moe.aux_loss_weight / cfg.moe.top_k,
        )
    if arch == _GPT_OSS:
        kinds = {"local": "sliding_attention", "global": "full_attention"}
        kinds[None] = "sliding_attention" if cfg.sliding_window else "full_attention"
        out.update(
            attention_bias=True,
            sliding_window=cfg.sliding_window,
            layer_types=[kinds[k] for k in cfg.layer_kinds],
            num_local_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            intermediate_size=cfg.moe.mlp_dim(cfg),
            swiglu_alpha=cfg.moe.swiglu_alpha,
            swiglu_limit=cfg.moe.swiglu_limit,
            router_aux_loss_coef=cfg.moe.aux_loss_weight / cfg.moe.top_k,
        )
        del out["mlp_bias"]
    if arch == "Qwen3MoeForCausalLM":
        out.update(
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            moe_intermediate_size=cfg.moe.mlp_dim(cfg),
            norm_topk_prob=cfg.moe.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=cfg.moe.aux_loss_weight / cfg.moe.top_k,
        )
    return out


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    """config.json's FP8 block (models/hf/fp8.py), its refusals as HFConversionError."""
    try:
        return hf_fp8.block_size(hf)
    except hf_fp8.QuantizationError as e:
        raise HFConversionError(str(e)) from None
