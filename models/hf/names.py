"""Our parameters under their HF tensor names, and each tensor's layout both ways: `_hf_names`
(our param path, index into the stacked array and HF name of every tensor), `_to_ours` /
`_to_hf` (one tensor from HF's [out, in] layout to ours and back: the table in
models/hf/__init__.py), `_shape_of` (our shape of a parameter) and `_hf_shape` (HF's)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxtrain.models import linear_attention as linear
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import qwen3_5 as hf_qwen3_5
from jaxtrain.models.hf.common import _EXPERT_PARAMS
from jaxtrain.models.hf.deepseek import _deepseek_mtp_names, _deepseek_names, _mla_shape
from jaxtrain.models.hf.gpt_oss import _has_gpt_oss_experts

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


def _hf_shape(
    ours: tuple[str, ...], expected: tuple[int, ...], cfg: ModelConfig, theirs: str
) -> tuple[int, ...]:
    """The HF tensor's shape for our parameter of shape `expected`."""
    if ours[-1] in ("wq", "wq_gate") and cfg.attention_output_gate:  # both halves of one q_proj
        return (2 * cfg.n_heads * cfg.resolved_head_dim, cfg.d_model)
    fused = linear.qwen3_next_fused(theirs)
    if fused:  # Qwen3-Next: two of ours in one tensor
        return (linear.qwen3_next_rows(fused, cfg), cfg.d_model)
    return _to_hf(ours, np.broadcast_to(np.float32(0), expected), cfg).shape
