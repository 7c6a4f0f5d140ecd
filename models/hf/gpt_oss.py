"""GPT-OSS (GptOssForCausalLM): attention sinks, q/k/v/o biases, sliding and full layers, every
layer MoE with a trained router bias, expert biases and the clamped SwiGLU. Its config.json
(`_gpt_oss_settings`, `_check_gpt_oss_features`) and its experts, fused per layer
(`gate_up_proj`, `down_proj` and their biases) and, in the published checkpoints, in MXFP4
(`dequantize_mxfp4`): read into `param_sources`' maps (`_gpt_oss_expert_sources`) and written
(`_gpt_oss_expert_tensors`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np

from jaxtrain.models.config import ModelConfig, MoEConfig
from jaxtrain.models.hf.common import HFConversionError, _layer_pattern

# The class with attention sinks, an output bias, a trained router bias, expert biases and the
# clamped SwiGLU (model.attention_sinks, attention_out_bias, moe.router_logit_bias, expert_bias,
# expert_activation clamped_swiglu), its experts fused per layer (`_gpt_oss_experts`).
_GPT_OSS = "GptOssForCausalLM"


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
