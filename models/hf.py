"""Hugging Face checkpoints in and out: `from_hf(path)` and `to_hf(model, path)`.

Reads a local directory (`config.json` + `*.safetensors`, with or without a
`model.safetensors.index.json`) for LlamaForCausalLM, MistralForCausalLM,
MixtralForCausalLM (every layer MoE, softmax top-k renormalised, dropless),
Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (QK-norm per head, free head_dim),
Qwen3MoeForCausalLM (QK-norm, every layer MoE), Olmo2ForCausalLM (post-norms, QK-norm
over whole projections), Gemma 2 and 3, DeepseekV3ForCausalLM (also Kimi K2 and Moonlight:
latent attention, YaRN, group-limited sigmoid routing, shared experts, dense first layers)
and GptOssForCausalLM (sinks, q/k/v/o biases, sliding and full layers, experts with biases
and the clamped SwiGLU, MXFP4 experts dequantized), Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
and the text model of their ConditionalGeneration wrappers, Qwen3NextForCausalLM (gated DeltaNet,
gated full attention, MoE with a gated shared expert: models/hf_qwen3_5.py)
and returns a ready NNX `Transformer`; writes one that
`transformers` loads with the same logits. What each family adds is a ModelConfig
feature (`qkv_bias`, `qk_norm`, `norm_placement`), never a branch on the family. No
network, no torch: tensors are read one at a time (models/safetensors_io.py: any dtype,
BF16 and FP8 included), so peak memory is one copy of the model plus one tensor. DeepSeek-V3's
and Kimi K2's block-FP8 weights (`weight_scale_inv`) are dequantized as they are read
(models/hf_fp8.py); a quantization other than block FP8 or GPT-OSS's MXFP4 is refused.

Layout mapping (HF Linear weights are `[out, in]`):
  q_proj [H*hd, D] -> wq [D, H, hd]      o_proj [D, H*hd] -> wo [H, hd, D]
  gate/up [F, D]   -> w_gate/w_up [D, F]  down [D, F]     -> w_down [F, D]
  Mixtral: gate [E, D] -> w_router [D, E]; experts.e.w1/w3 [F, D] -> w_gate/w_up[e] [D, F];
  experts.e.w2 [D, F] -> w_down[e] [F, D]  (stacked [layers, experts, ...] under moe_blocks)
  Qwen3-MoE: mlp.gate [E, D] -> w_router; mlp.experts.e.gate_proj/up_proj/down_proj as above
  q/k/v_proj.bias [H*hd] -> bq/bk/bv [H, hd]      o_proj.bias [D] -> bo    sinks [H] -> sinks
  GPT-OSS: mlp.router.weight/bias -> w_router/b_router; mlp.experts.gate_up_proj [E, D, 2F]
  (gate even columns, up odd) -> w_gate/w_up [E, D, F], down_proj [E, F, D] -> w_down, and
  their biases (`_gpt_oss_experts`)
  q_norm/k_norm [hd] (per head) -> scale [hd]; [H*hd] (whole projection) -> scale [H, hd]
  DeepSeek-V3 (models/mla.py): q_proj [H*(nope+rope), D] -> wq [D, H, nope+rope], or q_a_proj
  [q_lora, D] -> wq_a, q_a_layernorm -> q_norm, q_b_proj [H*(nope+rope), q_lora] -> wq_b
  [q_lora, H, nope+rope]; kv_a_proj_with_mqa [kv_lora+rope, D] -> wkv_a [D, kv_lora+rope];
  kv_a_layernorm -> kv_norm; kv_b_proj [H*(nope+v), kv_lora] -> wkv_b [kv_lora, H, nope+v];
  o_proj [D, H*v] -> wo [H, v, D]; mlp.gate.weight -> w_router, mlp.gate.e_score_correction_bias
  -> router_bias; mlp.experts.e.* one by one; mlp.shared_experts.* -> shared_gate/up/down;
  layers below first_k_dense_replace are dense (`blocks`, intermediate_size), the rest MoE
  (`moe_blocks`, indexed from the first MoE layer)
HF's q/k weights are already permuted for the "rotate half" RoPE our model
uses, so no head-dim permutation is needed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models import hf_fp8, hf_qwen3_5
from jaxtrain.models import linear_attention as linear
from jaxtrain.models.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from jaxtrain.models.params import abstract_model, merge
from jaxtrain.models.transformer import Transformer

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
    # Qwen3.5 / 3.6 dense hybrids (models/hf_qwen3_5.py): gated DeltaNet and gated full attention
    "Qwen3_5ForCausalLM": ((False, "head", "pre"), hf_qwen3_5.MODEL_TYPE, None),
    "Qwen3_5ForConditionalGeneration": ((False, "head", "pre"), "qwen3_5", None),
    "Qwen3_5MoeForCausalLM": ((False, "head", "pre"), hf_qwen3_5.MOE_MODEL_TYPE, "qwen3_5"),
    "Qwen3_5MoeForConditionalGeneration": ((False, "head", "pre"), "qwen3_5_moe", "qwen3_5"),
    "Qwen3NextForCausalLM": ((False, "head", "pre"), "qwen3_next", "qwen3_5"),
}
# Latent attention (model.mla), group-limited sigmoid routing with shared experts and dense first
# layers: DeepSeek-V3, Kimi K2, Moonlight (`_deepseek_settings`, `_deepseek_names`).
_DEEPSEEK = "DeepseekV3ForCausalLM"
# The classes whose norms scale by (1 + w), whose embeddings are scaled by sqrt(hidden_size),
# whose attention scale is query_pre_attn_scalar ** -0.5, with softcaps and `layer_types`
# (model.norm_scale_offset, embedding_scale, attention_scale, *_softcap, attention_pattern).
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> mlp_activation
# The class with attention sinks, an output bias, a trained router bias, expert biases and the
# clamped SwiGLU (model.attention_sinks, attention_out_bias, moe.router_logit_bias, expert_bias,
# expert_activation clamped_swiglu), its experts fused per layer (`_gpt_oss_experts`).
_GPT_OSS = "GptOssForCausalLM"
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


class HFConversionError(ValueError):
    """Unsupported architecture/feature or a missing/mis-shaped tensor; names it."""


# --- config ---------------------------------------------------------------------


def _rope_settings(hf: dict) -> dict:
    """RoPE theta and scaling from either transformers 4.x (`rope_theta`, `rope_scaling`)
    or 5.x (`rope_parameters`) config layouts; Gemma 3's 5.x parameters are per layer type
    (the global layers' here, the local ones' in `_gemma_settings`)."""
    params = dict(hf.get("rope_parameters") or {})
    params = dict(params.get("full_attention", params))
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind in (None, "default"):
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(merged["factor"])}
    if kind == "llama3":
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(merged["factor"]),
            "rope_low_freq_factor": float(merged["low_freq_factor"]),
            "rope_high_freq_factor": float(merged["high_freq_factor"]),
            "rope_original_max_position": int(merged["original_max_position_embeddings"]),
        }
    if kind == "yarn":
        return {**out, **_yarn_settings(hf, merged)}
    raise HFConversionError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)"
    )


def _yarn_settings(hf: dict, params: dict) -> dict:
    """YaRN's keys as transformers reads them (`_compute_yarn_parameters`): a missing factor is
    max_position_embeddings / original_max_position_embeddings; beta_fast / beta_slow default
    to 32 / 1 (also when 0); mscale and mscale_all_dim count only when non-zero."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    unset_if_zero = lambda key: float(params[key]) if params.get(key) else None
    attention = params.get("attention_factor")
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_original_max_position": original,
        "rope_beta_fast": float(params.get("beta_fast") or 32),
        "rope_beta_slow": float(params.get("beta_slow") or 1),
        "rope_truncate": bool(params.get("truncate", True)),
        "rope_attention_factor": None if attention is None else float(attention),
        "rope_mscale": unset_if_zero("mscale"),
        "rope_mscale_all_dim": unset_if_zero("mscale_all_dim"),
    }


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json` (of a ConditionalGeneration class, the text
    model's: models/hf_qwen3_5.py)."""
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


def _layer_pattern(layer_types: list[str]) -> tuple[str, ...]:
    """The shortest unit that, repeated, is HF's `layer_types` ("sliding_attention" /
    "full_attention"), as model.attention_pattern kinds (at worst the whole list)."""
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    if any(t not in kinds for t in layer_types):
        raise HFConversionError(f"config.json layer_types={layer_types}: expected sliding/full_attention")
    ours = [kinds[t] for t in layer_types]
    n = len(ours)
    p = next(p for p in range(1, n + 1) if n % p == 0 and ours == ours[:p] * (n // p))
    return tuple(ours[:p])


def _gemma_settings(hf: dict) -> dict:
    """Gemma 2 and 3's model features from their config.json (module docstring)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers 4.x: Gemma 2 alternates, Gemma 3 repeats sliding_window_pattern
        period = hf.get("sliding_window_pattern", 2)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    # the shortest unit that tiles the depth: Gemma 3 1B's 26 layers (5 local, 1 global, ...)
    # do not tile by 6, so its whole depth is one group (the layers unrolled in one scan step)
    pattern = _layer_pattern(list(types))
    params = dict(hf.get("rope_parameters") or {})
    sliding = dict(params.get("sliding_attention") or {})
    local = sliding.get("rope_theta", hf.get("rope_local_base_freq"))
    if sliding.get("rope_type", "default") != "default":  # scaled local layers: shared RoPE only
        if sliding != params.get("full_attention"):
            raise HFConversionError(
                f"config.json rope_parameters.sliding_attention={sliding}: expected rope_type default "
                "(an own unscaled base) or the full_attention layers' RoPE"
            )
        local = None  # model.local_rope_theta unset: local layers share the global RoPE
    return dict(
        norm_scale_offset=1.0,
        embedding_scale=float(hf["hidden_size"]) ** 0.5,
        attention_scale=float(hf.get("query_pre_attn_scalar", hf.get("head_dim", 256))) ** -0.5,
        attention_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        attention_pattern=pattern,
        sliding_window=int(hf["sliding_window"]) if "local" in pattern else None,
        local_rope_theta=float(local) if local is not None else None,
    )


def _deepseek_settings(hf: dict) -> dict:
    """DeepSeek-V3's model features from its config.json: latent attention, interleaved RoPE
    pairs (`rope_interleave`, true unless it says false), and its MoE: sigmoid scores with the
    selection-only `e_score_correction_bias` (model.moe.score_bias), group-limited top-k, the
    weights renormalised (norm_topk_prob) and scaled (routed_scaling_factor), shared experts of
    n_shared_experts x moe_intermediate_size, and first_k_dense_replace dense layers of
    intermediate_size. Balanced by the selection bias alone (no auxiliary loss), as DeepSeek-V3
    trains. The multi-token prediction modules (layers at index num_hidden_layers) are the
    directory's business: `config_from_hf_dir` sets model.mtp when it holds them."""
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise HFConversionError(
            f"config.json num_key_value_heads={hf['num_key_value_heads']}: DeepSeek-V3's latent attention "
            f"expands keys and values per head; expected num_attention_heads={hf['num_attention_heads']}"
        )
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise HFConversionError(
            f"config.json topk_method={hf.get('topk_method')!r} scoring_func={hf.get('scoring_func')!r}: "
            "expected DeepSeek-V3's noaux_tc with sigmoid scores"
        )
    moe = MoEConfig(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_mlp_dim=hf["moe_intermediate_size"],
        num_shared_experts=hf.get("n_shared_experts") or 0,
        scoring="sigmoid",
        normalize_top_k=bool(hf.get("norm_topk_prob", True)),
        score_bias=True,
        num_groups=hf.get("n_group") or 1,
        top_k_groups=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        first_dense_layers=hf.get("first_k_dense_replace") or 0,
        dispatch="dropless",
        aux_loss_weight=0.0,
        z_loss_weight=0.0,  # transformers adds no router z-loss
    )
    mla = MLAConfig(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
    )
    rope_interleave = hf.get("rope_interleave", True)
    return dict(head_dim=None, mla=mla, moe=moe, rope_interleave=bool(rope_interleave))


def _gpt_oss_settings(hf: dict) -> dict:
    """GPT-OSS's model features from its config.json: biases on q, k, v and o, a sink per head,
    sliding and full layers (`layer_types`), and every layer MoE with a trained router bias
    (softmax over the top-k logits: the softmax renormalised over the chosen experts), expert
    biases and the clamped SwiGLU."""
    if not hf.get("attention_bias", True):
        raise HFConversionError("config.json attention_bias=false: GPT-OSS converts with its biases only")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]  # transformers' default: sliding first, alternating
    pattern = _layer_pattern(list(types))
    k = hf["num_experts_per_tok"]
    return dict(
        attention_out_bias=True,
        attention_sinks=True,
        attention_pattern=pattern if "local" in pattern else (),
        sliding_window=int(hf["sliding_window"]) if "local" in pattern else None,
        moe=MoEConfig(
            num_experts=hf["num_local_experts"],
            top_k=k,
            expert_mlp_dim=hf["intermediate_size"],
            scoring="softmax",
            normalize_top_k=True,
            dispatch="dropless",
            router_logit_bias=True,
            expert_bias=True,
            expert_activation="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * k,
            z_loss_weight=0.0,  # transformers adds no router z-loss
        ),
    )


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


def _hf_rope(cfg: ModelConfig) -> dict:
    """`rope_parameters` for `cfg` (default, linear, llama3 or yarn)."""
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_scaling_factor, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        return {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "rope_theta": cfg.rope_theta,
        }
    if cfg.rope_scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
        }
        optional = {
            "attention_factor": cfg.rope_attention_factor,
            "mscale": cfg.rope_mscale,
            "mscale_all_dim": cfg.rope_mscale_all_dim,
        }
        return {**rope, **{k: v for k, v in optional.items() if v is not None}}
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}


def _deepseek_hf_config(cfg: ModelConfig, arch: str) -> dict:
    """DeepseekV3ForCausalLM's config.json for `cfg`, which must have its features: latent
    attention, pre-norms, and its MoE (sigmoid scores with a selection bias, every layer after
    the dense ones MoE); `_deepseek_settings` reads it back."""
    m, mla = cfg.moe, cfg.mla
    if arch != _DEEPSEEK or mla is None or m is None:
        raise HFConversionError(
            f"architecture {arch!r} with model.mla={'set' if mla else 'null'}, model.moe="
            f"{'set' if m else 'null'}: latent attention converts as {_DEEPSEEK}, which needs both"
        )
    wrong = [
        f"{key} (expected {want!r})"
        for key, value, want in (
            ("model.norm_placement", cfg.norm_placement, "pre"),
            ("model.mlp_activation", cfg.mlp_activation, "silu"),
            ("model.sliding_window", cfg.sliding_window, None),
            ("model.attention_scale", cfg.attention_scale, None),
            ("model.attention_softcap", cfg.attention_softcap, None),
            ("model.attention_sinks", cfg.attention_sinks, False),  # models/mla.py has them; HF's not
            ("model.attention_out_bias", cfg.attention_out_bias, False),
            ("model.final_softcap", cfg.final_softcap, None),
            ("model.norm_scale_offset", cfg.norm_scale_offset, 0.0),
            ("model.embedding_scale", cfg.embedding_scale, 1.0),
            ("model.moe.scoring", m.scoring, "sigmoid"),
            ("model.moe.score_bias", m.score_bias, True),
            ("model.moe.every", m.every, 1),
        )
        if value != want
    ]
    if cfg.rope_scaling not in (None, "yarn"):
        wrong.append(f"model.rope_scaling={cfg.rope_scaling!r} (expected null or yarn)")
    if wrong:
        raise HFConversionError(f"architecture {arch!r}: " + "; ".join(wrong))
    rope = _hf_rope(cfg)
    return {
        "architectures": [arch],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "moe_intermediate_size": m.mlp_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,  # transformers' RoPE width (it sets this itself)
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.num_shared_experts,
        "n_group": m.num_groups,
        "topk_group": m.top_k_groups,
        "norm_topk_prob": m.normalize_top_k,
        "routed_scaling_factor": m.routed_scaling_factor,
        "first_k_dense_replace": m.first_dense_layers,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0 if cfg.mtp is None else cfg.mtp.depth,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max(cfg.rope_original_max_position, 4096),
        "attention_bias": False,
        "torch_dtype": "float32",
        "rope_interleave": cfg.rope_interleave,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
    }


def _check_gpt_oss_features(cfg: ModelConfig, arch: str) -> None:
    """GPT-OSS's features (sinks, output bias, trained router bias, expert biases, clamped
    SwiGLU) all present for its class, and none of them for any other: refused by name."""
    m = cfg.moe
    features = {
        "model.attention_sinks": cfg.attention_sinks,
        "model.attention_out_bias": cfg.attention_out_bias,
        "model.moe.router_logit_bias": m is not None and m.router_logit_bias,
        "model.moe.expert_bias": m is not None and m.expert_bias,
        "model.moe.expert_activation=clamped_swiglu": m is not None
        and m.expert_activation == "clamped_swiglu",
    }
    if arch == _GPT_OSS:
        missing = [name for name, on in features.items() if not on]
        if missing:
            raise HFConversionError(f"architecture {arch!r} needs {', '.join(missing)}; the model has not")
    elif any(features.values()):
        present = [name for name, on in features.items() if on]
        raise HFConversionError(f"architecture {arch!r}: {', '.join(present)} do not convert (GPT-OSS only)")


def _int_if_whole(x: float) -> int | float:
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def _gemma_hf_fields(cfg: ModelConfig, rope: dict) -> dict:
    """config.json fields of Gemma 2 and 3 for `cfg` (both 4.x and 5.x spellings)."""
    # layer_kinds is None for every layer without a pattern: all of them global
    kinds = {"local": "sliding_attention", "global": "full_attention", None: "full_attention"}
    scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.resolved_head_dim**-0.5
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _int_if_whole(scale**-2),  # transformers takes an int
        "attn_logit_softcapping": cfg.attention_softcap,
        "final_logit_softcapping": cfg.final_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": [kinds[k] for k in cfg.layer_kinds],
        "sliding_window_pattern": cfg.layers_per_group,
        "attention_bias": False,
    }
    local = cfg.local_rope_theta or cfg.rope_theta
    if cfg.qk_norm == "head":  # Gemma 3: RoPE per layer type; local_rope_theta unset: the global one
        own = cfg.local_rope_theta is not None or rope["rope_type"] == "default"
        out["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local} if own else rope,
        }
        out["rope_local_base_freq"] = local
    return out


# --- tensors -------------------------------------------------------------------


_EXPERT_PARAMS = (("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down"))
_SHARED_EXPERT = ("shared_gate", "shared_up", "shared_down")  # the fused shared experts' weights


def _hf_names(
    cfg: ModelConfig, model: str = "model.", arch: str | None = None
) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """(our param path, index into the stacked array, HF tensor name) for every tensor.
    The index is () for unstacked params, (layer,) or (layer, expert) for stacked ones.
    `model`: the text model's prefix (`model.language_model.` in a Qwen3.5 ConditionalGeneration
    checkpoint). A gated q_proj is named twice, for wq and wq_gate (each half of it)."""
    yield ("embedding",), (), f"{model}embed_tokens.weight"
    yield ("final_norm", "scale"), (), f"{model}norm.weight"
    if not cfg.tie_embeddings:
        yield ("lm_head",), (), "lm_head.weight"
    if cfg.mla is not None:
        yield from _deepseek_names(cfg)
        if cfg.mtp is not None:
            yield from _deepseek_mtp_names(cfg)
        return
    common = {
        ("attn", "wq"): "self_attn.q_proj.weight",
        ("attn", "wk"): "self_attn.k_proj.weight",
        ("attn", "wv"): "self_attn.v_proj.weight",
        ("attn", "wo"): "self_attn.o_proj.weight",
    }
    if cfg.norm_placement == "pre":
        common[("attn_norm", "scale")] = "input_layernorm.weight"
        common[("mlp_norm", "scale")] = "post_attention_layernorm.weight"
    elif cfg.norm_placement == "both":  # Gemma: a norm before and after each sublayer
        common[("attn_norm", "scale")] = "input_layernorm.weight"
        common[("attn_post_norm", "scale")] = "post_attention_layernorm.weight"
        common[("mlp_norm", "scale")] = "pre_feedforward_layernorm.weight"
        common[("mlp_post_norm", "scale")] = "post_feedforward_layernorm.weight"
    else:  # OLMo 2: the norms after attention and after the MLP
        common[("attn_norm", "scale")] = "post_attention_layernorm.weight"
        common[("mlp_norm", "scale")] = "post_feedforward_layernorm.weight"
    if cfg.qkv_bias:
        common.update({("attn", f"b{t}"): f"self_attn.{t}_proj.bias" for t in "qkv"})
    if cfg.qk_norm != "none":
        common.update({("attn", f"{t}_norm", "scale"): f"self_attn.{t}_norm.weight" for t in "qk"})
    if cfg.attention_out_bias:
        common[("attn", "bo")] = "self_attn.o_proj.bias"
    if cfg.attention_sinks:
        common[("attn", "sinks")] = "self_attn.sinks"
    if cfg.attention_output_gate:
        common[("attn", "wq_gate")] = "self_attn.q_proj.weight"
    shared = {}  # Qwen3.5-MoE's gated shared expert
    if cfg.moe is not None and cfg.moe.num_shared_experts:
        shared = {
            ("mlp", ours): f"mlp.shared_expert.{theirs}.weight"
            for ours, theirs in zip(_SHARED_EXPERT, ("gate_proj", "up_proj", "down_proj"))
        }
        if cfg.moe.shared_expert_gate:
            shared[("mlp", "shared_expert_gate")] = "mlp.shared_expert_gate.weight"
    attention = [k for k in common if k[0] == "attn"]
    deltanet = {("attn", ours): f"linear_attn.{theirs}" for ours, theirs in linear.QWEN3_5_NAMES.items()}
    if arch == hf_qwen3_5.QWEN3_NEXT:  # two of ours from each fused tensor
        for theirs, pair in linear.QWEN3_NEXT_FUSED.items():
            deltanet.update({("attn", ours): f"linear_attn.{theirs}" for ours in pair})
    dense = {
        ("mlp", "w_gate"): "mlp.gate_proj.weight",
        ("mlp", "w_up"): "mlp.up_proj.weight",
        ("mlp", "w_down"): "mlp.down_proj.weight",
    }
    gpt_oss = _has_gpt_oss_experts(cfg)
    if gpt_oss:  # the experts are fused per layer: _gpt_oss_experts
        router, moe, experts = "mlp.router.weight", None, {}
    elif cfg.moe is not None and cfg.qk_norm == "head":  # Qwen3-MoE's names
        router, moe = "mlp.gate.weight", "mlp.experts"
        experts = dict(zip(_EXPERT_PARAMS, ("gate_proj.weight", "up_proj.weight", "down_proj.weight")))
    else:  # Mixtral's
        router, moe = "block_sparse_moe.gate.weight", "block_sparse_moe.experts"
        experts = dict(zip(_EXPERT_PARAMS, ("w1.weight", "w3.weight", "w2.weight")))
    stack = "blocks" if cfg.moe is None else "moe_blocks"
    period = cfg.layers_per_group  # PatternGroup: layer i is layer_{i % period} of group i // period
    kinds = cfg.layer_kinds_by_type
    for layer in range(cfg.n_layers):
        prefix = f"{model}layers.{layer}."
        where = (stack, f"layer_{layer % period}") if cfg.scan_pattern else (stack,)
        index = (layer // period,)
        mixer = deltanet if kinds[layer] == "linear_attention" else {}
        for ours, theirs in {
            **{k: v for k, v in common.items() if not (mixer and k in attention)},
            **mixer,
        }.items():
            yield (*where, *ours), index, prefix + theirs
        if cfg.moe is None:
            for ours, theirs in dense.items():
                yield (*where, *ours), index, prefix + theirs
            continue
        yield (*where, "mlp", "w_router"), index, prefix + router
        for ours, theirs in shared.items():
            yield (*where, *ours), index, prefix + theirs
        if gpt_oss:
            yield (*where, "mlp", "b_router"), index, prefix + "mlp.router.bias"
        for e in range(cfg.moe.num_experts if experts else 0):
            for ours, theirs in experts.items():
                yield (*where, *ours), (*index, e), f"{prefix}{moe}.{e}.{theirs}"


def _has_gpt_oss_experts(cfg: ModelConfig) -> bool:
    """The experts are GPT-OSS's: fused gate_up_proj / down_proj tensors per layer, with biases."""
    return cfg.moe is not None and cfg.moe.expert_bias


def _gpt_oss_experts(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """(where in our params, index, the layer's HF prefix) of every GPT-OSS MoE layer's experts:
    HF's `mlp.experts.gate_up_proj` [E, D, 2F] (gate and up interleaved on the last axis, even
    columns gate) with `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, D] with `down_proj_bias`
    [E, D]: stored [in, out] as our w_gate/w_up/w_down are; or, in the published checkpoints,
    the two weights in MXFP4 (`*_blocks`, `*_scales`: `dequantize_mxfp4`)."""
    period = cfg.layers_per_group
    for layer in range(cfg.n_layers):
        where = ("moe_blocks", f"layer_{layer % period}") if cfg.attention_pattern else ("moe_blocks",)
        yield (*where, "mlp"), (layer // period,), f"model.layers.{layer}.mlp.experts."


# FP4 (e2m1) values by their 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0
_FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MXFP4 as GPT-OSS's checkpoints store it -> float32 [E, K, N] (our [in, out] layout).

    `blocks` uint8 [E, N, K / 32, 16]: for output row n, blocks of 32 inputs, two FP4 (e2m1)
    codes a byte, the low nibble first (even input), the high nibble second; `scales` uint8
    [E, N, K / 32]: each block's shared e8m0 exponent, value = code's value x 2^(scale - 127).
    (transformers' integrations/mxfp4.py `convert_moe_packed_tensors`.)"""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise HFConversionError(
            f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}{list(scales.shape)}: "
            "expected uint8 [..., groups, 16] and uint8 [..., groups]"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = _FP4_VALUES[codes].reshape(*scales.shape, -1)  # [E, N, G, 32]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)  # [E, K, N]


def _read_experts_weight(reader, name: str) -> np.ndarray:
    """An expert weight [E, in, out] float32: stored plainly, or as MXFP4 blocks and scales."""
    if name in reader.weight_map:
        return np.asarray(reader.get(name), np.float32)
    if f"{name}_blocks" in reader.weight_map:
        return dequantize_mxfp4(
            np.asarray(reader.get(f"{name}_blocks")), np.asarray(reader.get(f"{name}_scales"))
        )
    raise HFConversionError(f"{reader.path}: tensor {name!r} is missing (nor {name}_blocks / _scales)")


def _gpt_oss_expert_sources(reader, cfg: ModelConfig, shapes: dict, parts: dict) -> None:
    """Add the GPT-OSS expert weights and biases (stacked per layer) to `param_sources`' maps:
    w_gate / w_up the even / odd columns of `gate_up_proj`, each read when its slice is."""
    e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.moe.mlp_dim(cfg)
    groups = cfg.n_layers // cfg.layers_per_group
    expected = {
        "gate_up_proj": (e, d, 2 * f),
        "gate_up_proj_bias": (e, 2 * f),
        "down_proj": (e, f, d),
        "down_proj_bias": (e, d),
    }
    ours = {  # ours: (theirs, which interleaved half, or None for all of it)
        "w_gate": ("gate_up_proj", 0),
        "w_up": ("gate_up_proj", 1),
        "w_down": ("down_proj", None),
        "b_gate": ("gate_up_proj_bias", 0),
        "b_up": ("gate_up_proj_bias", 1),
        "b_down": ("down_proj_bias", None),
    }
    for where, index, prefix in _gpt_oss_experts(cfg):
        for name, (theirs, half) in ours.items():
            shape = expected[theirs]
            if half is not None:
                shape = (*shape[:-1], shape[-1] // 2)
            shapes.setdefault((*where, name), (groups, *shape))
            read = functools.partial(_read_gpt_oss_expert, reader, prefix + theirs, expected[theirs], half)
            parts.setdefault((*where, name), []).append((index, read))


def _read_gpt_oss_expert(reader, name: str, shape: tuple[int, ...], half: int | None) -> np.ndarray:
    w = (
        np.asarray(reader.get(name), np.float32)
        if name.endswith("bias")
        else _read_experts_weight(reader, name)
    )
    if w.shape != shape:
        raise HFConversionError(f"tensor {name!r}: shape {w.shape}, expected {shape} from config.json")
    return w if half is None else np.ascontiguousarray(w[..., half::2])


def _gpt_oss_expert_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 tensor) of every GPT-OSS MoE layer's experts, fused as HF stores them."""
    for where, index, prefix in _gpt_oss_experts(cfg):
        node = params
        for key in where:
            node = node[key]
        w = {name: np.asarray(node[name][index], np.float32) for name in _GPT_OSS_EXPERT_PARAMS}
        interleave = lambda gate, up: np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)
        yield prefix + "gate_up_proj", interleave(w["w_gate"], w["w_up"])
        yield prefix + "gate_up_proj_bias", interleave(w["b_gate"], w["b_up"])
        yield prefix + "down_proj", np.ascontiguousarray(w["w_down"])
        yield prefix + "down_proj_bias", np.ascontiguousarray(w["b_down"])


_GPT_OSS_EXPERT_PARAMS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def _deepseek_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """DeepSeek-V3's layer tensors as `_hf_names` gives them: dense layers (`blocks`) then MoE
    layers (`moe_blocks`, indexed from the first of them), experts one by one."""
    attn = {
        ("attn", "wkv_a"): "self_attn.kv_a_proj_with_mqa.weight",
        ("attn", "kv_norm", "scale"): "self_attn.kv_a_layernorm.weight",
        ("attn", "wkv_b"): "self_attn.kv_b_proj.weight",
        ("attn", "wo"): "self_attn.o_proj.weight",
        ("attn_norm", "scale"): "input_layernorm.weight",
        ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    }
    if cfg.mla.q_lora_rank is None:
        attn[("attn", "wq")] = "self_attn.q_proj.weight"
    else:
        attn[("attn", "wq_a")] = "self_attn.q_a_proj.weight"
        attn[("attn", "q_norm", "scale")] = "self_attn.q_a_layernorm.weight"
        attn[("attn", "wq_b")] = "self_attn.q_b_proj.weight"
    projections = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    dense = dict(zip(_EXPERT_PARAMS, (f"mlp.{p}" for p in projections)))
    moe = {
        ("mlp", "w_router"): "mlp.gate.weight",
        ("mlp", "router_bias"): "mlp.gate.e_score_correction_bias",
    }
    if cfg.moe.num_shared_experts:
        shared = (("mlp", "shared_gate"), ("mlp", "shared_up"), ("mlp", "shared_down"))
        moe.update(zip(shared, (f"mlp.shared_experts.{p}" for p in projections)))
    n_dense = cfg.moe.first_dense_layers
    for layer in range(cfg.n_layers):
        prefix = f"model.layers.{layer}."
        stack, index = ("blocks", (layer,)) if layer < n_dense else ("moe_blocks", (layer - n_dense,))
        for ours, theirs in {**attn, **(dense if layer < n_dense else moe)}.items():
            yield (stack, *ours), index, prefix + theirs
        if layer >= n_dense:
            for e in range(cfg.moe.num_experts):
                for ours, theirs in zip(_EXPERT_PARAMS, projections):
                    yield (stack, *ours), (*index, e), f"{prefix}mlp.experts.{e}.{theirs}"


def _deepseek_mtp_names(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], str]]:
    """DeepSeek-V3's multi-token prediction modules (model.mtp; models/mtp.py): module i is layer
    num_hidden_layers + i, an MoE decoder layer named as the others (`_deepseek_names`) beside
    its `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`. (Its `embed_tokens` and
    `shared_head.head`, copies of the main model's, are written by `params_to_hf_tensors`.)"""
    n = cfg.n_layers
    longer = dataclasses.replace(cfg, n_layers=n + cfg.mtp.depth, mtp=None)
    for ours, index, theirs in _deepseek_names(longer):
        layer = int(theirs.split(".")[2])
        if layer >= n:  # an MoE layer: ("moe_blocks", ...), index (layer - first dense, [expert])
            yield ("mtp", "block", *ours[1:]), (layer - n, *index[1:]), theirs
    for i in range(cfg.mtp.depth):
        prefix = f"model.layers.{n + i}."
        for ours, theirs in _MTP_NAMES.items():
            yield ("mtp", *ours), (i,), prefix + theirs


# models/mtp.py MTPLayer's own tensors, as DeepSeek-V3's checkpoints name them
_MTP_NAMES = {
    ("enorm", "scale"): "enorm.weight",
    ("hnorm", "scale"): "hnorm.weight",
    ("eh_proj",): "eh_proj.weight",
    ("head_norm", "scale"): "shared_head.norm.weight",
}
# copies of the main model's embedding and head that DeepSeek-V3's checkpoints keep in every
# prediction layer: written, never read
_MTP_SHARED = {"embed_tokens.weight": ("embedding",), "shared_head.head.weight": ("lm_head",)}


def mtp_depth_in_dir(path: str | Path, hf: dict) -> int:
    """How many of DeepSeek-V3's prediction modules the directory holds: config.json's
    num_nextn_predict_layers when every one of their layers (index num_hidden_layers + i) has
    its `eh_proj`, else 0 (transformers drops them when it saves a model, config unchanged)."""
    n = hf.get("num_nextn_predict_layers") or 0
    archs = hf.get("architectures") or [None]
    if not n or archs[0] != _DEEPSEEK:
        return 0
    names = _SafetensorsDir(Path(path)).weight_map
    layers = hf["num_hidden_layers"]
    return n if all(f"model.layers.{layers + i}.eh_proj.weight" in names for i in range(n)) else 0


def config_from_hf_dir(path: str | Path, **overrides) -> ModelConfig:
    """`config_from_hf` of the directory's config.json, with model.mtp set to the prediction
    modules whose weights it holds (`mtp_depth_in_dir`; none: null)."""
    hf = read_hf_config(path)
    depth = mtp_depth_in_dir(path, hf)
    mtp = MTPConfig(depth=depth) if depth else None
    return config_from_hf(hf, **{"mtp": mtp, **overrides})


def _mla_shape(path: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...] | None:
    """Our shape of a latent-attention tensor (None for any other)."""
    m, d, h = cfg.mla, cfg.d_model, cfg.n_heads
    if m is None or "attn" not in path:
        return None
    return {
        "wq": (d, h, m.qk_head_dim),
        "wq_a": (d, m.q_lora_rank),
        "wq_b": (m.q_lora_rank, h, m.qk_head_dim),
        "wkv_a": (d, m.kv_lora_rank + m.qk_rope_head_dim),
        "wkv_b": (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
        "wo": (h, m.v_head_dim, d),
        "scale": (m.q_lora_rank if path[-2] == "q_norm" else m.kv_lora_rank,),
    }[path[-1]]


def _to_ours(path: tuple[str, ...], w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    mla_shape = _mla_shape(path, cfg)
    if mla_shape is not None:  # HF [out, in] -> ours [in, (heads, width)]
        return w if path[-1] == "scale" else w.T.reshape(mla_shape)
    d, hd = cfg.d_model, cfg.resolved_head_dim
    name = path[-1]
    if name in linear.QWEN3_5_NAMES and path[-2] == "attn":
        fused = [t for t, pair in linear.QWEN3_NEXT_FUSED.items() if name in pair]
        if fused and w.shape[0] == linear.qwen3_next_rows(fused[0], cfg):  # Qwen3-Next's
            return linear.qwen3_next_split(fused[0], w, cfg)[name]
        return linear.qwen3_5_tensor_to_ours(name, w, cfg)
    if name in ("wq", "wq_gate") and cfg.attention_output_gate:
        return hf_qwen3_5.gated_query_to_ours(w, cfg, part=int(name == "wq_gate"))
    if name == "wq":
        return w.T.reshape(d, cfg.n_heads, hd)
    if name in ("wk", "wv"):
        return w.T.reshape(d, cfg.n_kv_heads, hd)
    if name == "wo":
        return w.T.reshape(cfg.n_heads, hd, d)
    if name in ("w_gate", "w_up", "w_down", "lm_head", "w_router", "eh_proj", *_SHARED_EXPERT):
        return w.T
    if name in ("bq", "bk", "bv"):
        return w.reshape(cfg.n_heads if name == "bq" else cfg.n_kv_heads, hd)
    if name == "shared_expert_gate":  # [1, D] -> [D]
        return w.reshape(-1)
    if name == "scale" and path[-2] in ("q_norm", "k_norm") and cfg.qk_norm == "projection":
        return w.reshape(cfg.n_heads if path[-2] == "q_norm" else cfg.n_kv_heads, hd)
    return w  # embedding [V, D] and norm scales keep their layout


def _to_hf(path: tuple[str, ...], w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    name = path[-1]
    if name in linear.QWEN3_5_NAMES and path[-2] == "attn":
        return linear.qwen3_5_tensor_to_hf(name, w, cfg)
    if name in ("wq", "wk", "wv", "wq_b", "wkv_b"):
        return w.reshape(w.shape[0], -1).T
    if name == "wo":
        return w.reshape(-1, w.shape[-1]).T
    transposed = ("w_gate", "w_up", "w_down", "lm_head", "w_router", "wq_a", "wkv_a", "eh_proj")
    if name in (*transposed, *_SHARED_EXPERT):
        return w.T
    if name in ("bq", "bk", "bv") or (name == "scale" and path[-2] in ("q_norm", "k_norm")):
        return w.reshape(-1)  # [heads, hd] -> [heads * hd]; a per-head norm's [hd] stays
    if name == "shared_expert_gate":
        return w.reshape(1, -1)
    return w


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    """config.json's FP8 block (models/hf_fp8.py), its refusals as HFConversionError."""
    try:
        return hf_fp8.block_size(hf)
    except hf_fp8.QuantizationError as e:
        raise HFConversionError(str(e)) from None


class _SafetensorsDir:
    """Tensor-by-name access across one or more safetensors files, one tensor in memory at a
    time (models/safetensors_io.py: read, not memory-mapped). Block-FP8 weights (e4m3 with a
    `<name>_scale_inv`, config.json's quantization_config) come back dequantized, float32."""

    def __init__(self, path: Path):
        from jaxtrain.models.safetensors_io import SafetensorsFile

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            self._files = {f: SafetensorsFile(path / f) for f in files}
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFConversionError(f"{path}: no *.safetensors files")
            self._files = {f: SafetensorsFile(path / f) for f in files}
            weight_map = {k: f for f, h in self._files.items() for k in h.keys()}
        self.weight_map = weight_map
        self.path = path
        config = path / "config.json"
        self.fp8_block = _fp8_block(json.loads(config.read_text())) if config.is_file() else None

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """From the headers alone: `name` is there with `shape` (a block-FP8 one with its
        scale grid), so a converter fails before it writes anything."""
        if name not in self.weight_map:
            raise HFConversionError(f"{self.path}: tensor {name!r} is missing")
        f = self._files[self.weight_map[name]]
        if f.shape(name) != tuple(shape):
            raise HFConversionError(
                f"tensor {name!r}: shape {f.shape(name)}, expected {tuple(shape)} from config.json"
            )
        scale = name + hf_fp8.SCALE_SUFFIX
        if f.dtype(name).name.startswith("float8") and self.fp8_block and scale in self.weight_map:
            have, want = self._files[self.weight_map[scale]].shape(scale), hf_fp8.grid(shape, self.fp8_block)
            if have != want:
                raise HFConversionError(
                    f"{self.path}: tensor {scale!r}: shape {have}, expected {want} "
                    f"(weight_block_size {list(self.fp8_block)} over {list(shape)})"
                )

    def get(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise HFConversionError(f"{self.path}: tensor {name!r} is missing")
        w = self._files[self.weight_map[name]].read(name)
        scale = name + hf_fp8.SCALE_SUFFIX
        if not w.dtype.name.startswith("float8"):
            return w
        if scale not in self.weight_map or self.fp8_block is None:
            raise HFConversionError(
                f"{self.path}: tensor {name!r} is {w.dtype} without {scale} and config.json "
                "quantization_config (quant_method fp8, weight_block_size); expected block FP8"
            )
        try:
            scale_inv = self._files[self.weight_map[scale]].read(scale)
            return hf_fp8.dequantize_blocks(w, scale_inv, self.fp8_block, name)
        except hf_fp8.QuantizationError as e:
            raise HFConversionError(f"{self.path}: {e}") from None


def _shape_of(path: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...]:
    mla_shape = _mla_shape(path, cfg)
    if mla_shape is not None:
        return mla_shape
    d, hd = cfg.d_model, cfg.resolved_head_dim
    # dense layers of an MoE model (moe.first_dense_layers, in `blocks`) have model.mlp_dim; the
    # prediction modules' blocks (`mtp`) are MoE layers on MoE models
    moe_layer = cfg.moe is not None and path[0] in ("moe_blocks", "mtp")
    f = cfg.moe.mlp_dim(cfg) if moe_layer else cfg.mlp_dim
    fs = 0 if cfg.moe is None else cfg.moe.shared_mlp_dim(cfg)
    if path[-1] == "scale" and path[-2] in ("q_norm", "k_norm"):
        heads = cfg.n_heads if path[-2] == "q_norm" else cfg.n_kv_heads
        return (heads, hd) if cfg.qk_norm == "projection" else (hd,)
    if path[-1] in linear.QWEN3_5_NAMES and path[-2] == "attn":
        return linear.param_shapes(cfg)[path[-1]]
    return {
        "wq_gate": (d, cfg.n_heads, hd),
        "shared_expert_gate": (d,),
        "w_router": (d, cfg.moe.num_experts if cfg.moe is not None else 0),
        "router_bias": (cfg.moe.num_experts if cfg.moe is not None else 0,),
        "shared_gate": (d, fs),
        "shared_up": (d, fs),
        "shared_down": (fs, d),
        "b_router": (cfg.moe.num_experts if cfg.moe is not None else 0,),
        "bo": (d,),
        "sinks": (cfg.n_heads,),
        "embedding": (cfg.vocab_size, d),
        "eh_proj": (2 * d, d),
        "lm_head": (d, cfg.vocab_size),
        "scale": (d,),
        "wq": (d, cfg.n_heads, hd),
        "wk": (d, cfg.n_kv_heads, hd),
        "wv": (d, cfg.n_kv_heads, hd),
        "wo": (cfg.n_heads, hd, d),
        "bq": (cfg.n_heads, hd),
        "bk": (cfg.n_kv_heads, hd),
        "bv": (cfg.n_kv_heads, hd),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }[path[-1]]


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """One of our parameters as an HF directory holds it: its shape (layers and experts
    stacked) and its slices, each (index into the stacked array, () when unstacked; a function
    that reads, dequantizes and converts that slice's HF tensors, checking the shape)."""

    shape: tuple[int, ...]
    slices: tuple[tuple[tuple[int, ...], Callable[[], np.ndarray]], ...]


def param_sources(path: str | Path, cfg: ModelConfig) -> dict[tuple[str, ...], ParamSource]:
    """Every parameter's `ParamSource`, keyed by its path in our nested params; nothing is read
    yet (only the safetensors headers), so a converter can hold one slice at a time."""
    reader = _SafetensorsDir(Path(path))
    config = Path(path) / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or [None])[0] if config.is_file() else None
    model = next(
        (p for p in hf_qwen3_5.TEXT_PREFIXES[::-1] if f"{p}embed_tokens.weight" in reader.weight_map),
        "model.",
    )
    # the stacked layers (or pattern groups) of each stack, and the experts of MoE layers
    n_dense = cfg.n_layers if cfg.moe is None else cfg.moe.first_dense_layers
    layers = {"blocks": n_dense // cfg.layers_per_group}
    if cfg.moe is not None:
        layers["moe_blocks"] = cfg.moe.num_moe_layers(cfg) // cfg.layers_per_group
    if cfg.mtp is not None:
        layers["mtp"] = cfg.mtp.depth
    experts = (cfg.moe.num_experts,) if cfg.moe is not None else ()
    shapes: dict = {}
    parts: dict = {}
    for ours, index, theirs in _hf_names(cfg, model, arch):
        expected = _shape_of(ours, cfg)
        # HF's shape of `expected`: `_to_hf` of a zero-stride stand-in (no memory)
        reader.check(theirs, _hf_shape(ours, expected, cfg, theirs))
        stacked = () if not index else (layers[ours[0]], *(experts if len(index) == 2 else ()))
        shapes.setdefault(ours, (*stacked, *expected))
        read = functools.partial(_read_converted, reader, ours, theirs, cfg, expected)
        parts.setdefault(ours, []).append((index, read))
    if _has_gpt_oss_experts(cfg):
        _gpt_oss_expert_sources(reader, cfg, shapes, parts)
    return {p: ParamSource(shapes[p], tuple(parts[p])) for p in parts}


def _hf_shape(
    ours: tuple[str, ...], expected: tuple[int, ...], cfg: ModelConfig, theirs: str
) -> tuple[int, ...]:
    """The HF tensor's shape for our parameter of shape `expected`."""
    if ours[-1] in ("wq", "wq_gate") and cfg.attention_output_gate:  # both halves of one q_proj
        return (2 * cfg.n_heads * cfg.resolved_head_dim, cfg.d_model)
    fused = ".".join(theirs.rsplit(".", 2)[-2:])
    if fused in linear.QWEN3_NEXT_FUSED:  # Qwen3-Next: two of ours in one tensor
        return (linear.qwen3_next_rows(fused, cfg), cfg.d_model)
    return _to_hf(ours, np.broadcast_to(np.float32(0), expected), cfg).shape


def _read_converted(reader, ours: tuple[str, ...], theirs: str, cfg: ModelConfig, expected) -> np.ndarray:
    w = _to_ours(ours, np.asarray(reader.get(theirs), dtype=np.float32), cfg)
    if w.shape != expected:
        raise HFConversionError(
            f"tensor {theirs!r}: shape {w.shape} after conversion, expected {expected} from config.json"
        )
    return w


def load_hf_params(path: str | Path, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Our nested param dict (numpy, layers stacked) from an HF directory: one copy of the
    model plus one tensor (`jaxtrain convert hf-to-ckpt` streams instead: interchange/convert.py)."""
    params: dict = {}
    for ours, source in param_sources(path, cfg).items():
        node = params
        for key in ours[:-1]:
            node = node.setdefault(key, {})
        node[ours[-1]] = np.empty(source.shape, dtype)
        for index, read in source.slices:
            node[ours[-1]][index] = read()
    return params


def read_hf_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise HFConversionError(f"{path}: config.json not found")
    return json.loads(p.read_text())


def from_hf(path: str | Path, **config_overrides):
    """A ready `Transformer` from a local HF checkpoint directory; `model.cfg` is its config.

    `config_overrides` set non-architectural ModelConfig fields (e.g.
    compute_dtype="bfloat16", attention_impl="xla"). A DeepSeek-V3 directory's multi-token
    prediction modules are read when it holds them (`config_from_hf_dir`).
    """
    cfg = config_from_hf_dir(path, **config_overrides)
    params = load_hf_params(path, cfg)
    graphdef, abstract = abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
    return merge(graphdef, abstract, params)


def params_to_hf_tensors(
    params: dict, cfg: ModelConfig, architecture: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 numpy tensor) pairs, one at a time (`architecture`: the class's tensor
    layout where two share a config, Qwen3-Next's fused DeltaNet projections)."""
    pending: dict[str, dict] = {}  # a fused tensor's parts until the last one comes
    for ours, index, theirs in _hf_names(cfg, arch=architecture):
        if ours[-1] == "wq_gate":
            continue  # written with wq: one q_proj
        node = params
        for key in ours:
            node = node[key]
        w = np.asarray(node[index] if index else node, dtype=np.float32)
        fused = ".".join(theirs.rsplit(".", 2)[-2:])
        if fused in linear.QWEN3_NEXT_FUSED:
            parts = pending.setdefault(theirs, {})
            parts[ours[-1]] = w
            if len(parts) == 2:
                yield theirs, np.ascontiguousarray(linear.qwen3_next_join(fused, pending.pop(theirs)))
            continue
        if ours[-1] == "wq" and cfg.attention_output_gate:
            gate = params
            for key in (*ours[:-1], "wq_gate"):
                gate = gate[key]
            gate = np.asarray(gate[index] if index else gate, dtype=np.float32)
            yield theirs, np.ascontiguousarray(hf_qwen3_5.gated_query_to_hf(w, gate))
            continue
        yield theirs, np.ascontiguousarray(_to_hf(ours, w, cfg))
    if cfg.mla is not None and cfg.mtp is not None:  # DeepSeek-V3's copies in each prediction layer
        # a tied head is the table itself in HF's [vocab, d_model] layout
        shared = {k: ("embedding",) if cfg.tie_embeddings else v for k, v in _MTP_SHARED.items()}
        for i in range(cfg.mtp.depth):
            for theirs, ours in shared.items():
                w = np.asarray(params[ours[0]], dtype=np.float32)
                yield f"model.layers.{cfg.n_layers + i}.{theirs}", np.ascontiguousarray(_to_hf(ours, w, cfg))
    if _has_gpt_oss_experts(cfg):
        yield from _gpt_oss_expert_tensors(params, cfg)


def write_hf_dir(
    tensors: Iterator[tuple[str, np.ndarray]],
    cfg: ModelConfig,
    path: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    config_updates: dict | None = None,
    config: dict | None = None,
) -> Path:
    """Write (name, tensor) pairs (any dtype: float32, bfloat16, e4m3 with its scales) as HF
    safetensors shards plus `model.safetensors.index.json` and `config.json` (with
    `config_updates`: torch_dtype, quantization_config; `config`: the whole config.json instead
    of `hf_config`'s, e.g. a wrapper class's). Holds at most one shard in memory, so
    a 7B model converts without a second full copy."""
    from jaxtrain.models.safetensors_io import write_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    current: dict[str, np.ndarray] = {}
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(written) + 1:05d}.safetensors"
            write_file(out / name, current.items(), metadata={"format": "pt"})
            written.append((name, list(current)))
            current, size = {}, 0

    for name, tensor in tensors:
        if size and size + tensor.nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        size += tensor.nbytes
    flush()
    total = len(written)
    weight_map = {}
    for i, (old, names) in enumerate(written):
        new = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (out / old).rename(out / new)
        weight_map.update({n: new for n in names})
    total_bytes = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2) + "\n"
    )
    config = {**(config or hf_config(cfg, architecture)), **(config_updates or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def to_hf(
    model, path: str | Path, *, architecture: str | None = None, max_shard_bytes: int = 2 * 2**30
) -> Path:
    """Write `model` as an HF checkpoint directory (config.json + f32 safetensors shards)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return write_hf_dir(
        params_to_hf_tensors(params, model.cfg, architecture),
        model.cfg,
        path,
        architecture=architecture,
        max_shard_bytes=max_shard_bytes,
    )
