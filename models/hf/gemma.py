"""Gemma 2 and 3 (Gemma2ForCausalLM, Gemma3ForCausalLM): norms that scale by (1 + w),
embeddings scaled by sqrt(hidden_size), query_pre_attn_scalar, attention and final logit
softcaps, sliding and full layers (`layer_types`) and, in Gemma 3, the local layers' own RoPE
base. Read from config.json by `_gemma_settings`, written by `_gemma_hf_fields`; the tensors
are the common layout (models/hf/names.py) with a norm before and after each sublayer."""

from __future__ import annotations

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import HFConversionError, _layer_pattern

# The classes whose norms scale by (1 + w), whose embeddings are scaled by sqrt(hidden_size),
# whose attention scale is query_pre_attn_scalar ** -0.5, with softcaps and `layer_types`
# (model.norm_scale_offset, embedding_scale, attention_scale, *_softcap, attention_pattern).
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


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
