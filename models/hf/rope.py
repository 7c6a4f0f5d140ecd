"""RoPE both ways: config.json's `rope_theta` / `rope_scaling` (transformers 4.x) or
`rope_parameters` (5.x) as ModelConfig fields (`_rope_settings`; YaRN's keys `_yarn_settings`),
and `rope_parameters` for a ModelConfig (`_hf_rope`): default, linear, llama3 and yarn."""

from __future__ import annotations

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import HFConversionError


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
