"""Qwen3.5 / Qwen3.6 hybrids, dense and MoE, in Hugging Face's layout (models/hf/ reads and writes them).

Two classes hold the same text model:
  Qwen3_5ForCausalLM               config.json is the text config (model_type qwen3_5_text);
                                   tensors under `model.`
  Qwen3_5ForConditionalGeneration  what the Hub publishes (Qwen/Qwen3.5-27B and the small ones):
                                   the text config under `text_config`, its tensors under
                                   `model.language_model.`, beside a vision tower (`model.visual.`)
                                   and multi-token-prediction layers (`mtp.`)
Reading either gives the text model; the vision tower and the MTP layers are not part of it.
`jaxtrain convert hf-to-ckpt` carries them (`CARRIED_PREFIXES`) into the converted checkpoint's
`carried/` (their tensors as stored, bit for bit, and the wrapper's config.json), and
`ckpt-to-hf` of that checkpoint, or of a run trained from it (train.init_from), writes the
wrapper again: the text model's tensors under `model.language_model.`, the carried ones
unchanged, the config the source's with the text config written from the model
(`wrapper_config`). `to_hf` of a model in memory writes Qwen3_5ForCausalLM, which transformers
also loads from a ConditionalGeneration checkpoint's text tensors.

What the text config says, as ModelConfig features:
  layer_types (or full_attention_interval, default 4: every 4th layer full)  -> model.layer_types
  linear_num_key_heads / num_value_heads / key_head_dim / value_head_dim /
  linear_conv_kernel_dim                                    -> model.linear_attention
  the full layers' q_proj [H * 2 hd, D]: per head its query, then its output gate
                                                            -> wq and wq_gate [D, H, hd]
                                                               (model.attention_output_gate)
  rope_parameters.partial_rotary_factor (default 0.25)      -> model.partial_rotary_factor
  Qwen3_5RMSNorm's (1 + w) (the layer, final and QK norms)  -> model.norm_scale_offset 1.0
  (the gated norm inside the DeltaNet layers is a plain w: models/linear_attention.py `norm`)
  rope_parameters.mrope_section / mrope_interleaved: the vision model's three position axes;
  on text all three are the token's position and M-RoPE is plain RoPE, so they are not read.
The DeltaNet layers' tensors convert one by one (models/linear_attention.py
`qwen3_5_tensor_to_ours`). The MoE members (Qwen3_5MoeForCausalLM and its wrapper: every MLP
softmax top-k, renormalised, beside one shared expert of shared_expert_intermediate_size whose
output sigmoid(x . shared_expert_gate) scales; experts stored one by one) are `moe_settings`.
Qwen3-Next (Qwen3NextForCausalLM: in_proj_qkvz / in_proj_ba) is not read yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtrain.models.config import LinearAttentionConfig, ModelConfig, MoEConfig

# MoE keys that say how the layer runs, not what it computes: a model keeps its own on export
_MOE_RUNTIME = (
    "dispatch",
    "capacity_factor",
    "exchange",
    "grouped_matmul",
    "receive_factor",
    "dispatch_per_shard",
    "z_loss_weight",
    "aux_loss_weight",
    "score_bias_rate",
)

CAUSAL_LM = "Qwen3_5ForCausalLM"
CONDITIONAL_GENERATION = "Qwen3_5ForConditionalGeneration"
# the MoE members (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): the same layers, every MLP an MoE
# with a gated shared expert (`moe_settings`)
MOE_CAUSAL_LM = "Qwen3_5MoeForCausalLM"
MOE_CONDITIONAL_GENERATION = "Qwen3_5MoeForConditionalGeneration"
CONDITIONAL_GENERATIONS = (CONDITIONAL_GENERATION, MOE_CONDITIONAL_GENERATION)
# Qwen3-Next (80B-A3B), the family's first: the same layers and MoE, its DeltaNet projections
# fused per key-head group (in_proj_qkvz, in_proj_ba: models/linear_attention.py
# QWEN3_NEXT_FUSED), norm_topk_prob a key; written only when asked for by name (its features
# are Qwen3.5-MoE's)
QWEN3_NEXT = "Qwen3NextForCausalLM"
ARCHITECTURES = (CAUSAL_LM, CONDITIONAL_GENERATION, MOE_CAUSAL_LM, MOE_CONDITIONAL_GENERATION, QWEN3_NEXT)
MODEL_TYPE = "qwen3_5_text"
MOE_MODEL_TYPE = "qwen3_5_moe_text"
# where the text model's tensors are in each class's checkpoints (lm_head.weight in both)
TEXT_PREFIXES = ("model.", "model.language_model.")
_DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' Qwen3_5TextConfig default when the key is absent
# a ConditionalGeneration checkpoint's tensors that are not the text model: carried, not read
CARRIED_PREFIXES = ("model.visual.", "mtp.")


def carried_names(arch: str | None, names) -> list[str]:
    """The tensors among `names` that conversion carries for a checkpoint of class `arch`."""
    if arch not in CONDITIONAL_GENERATIONS:
        return []
    return sorted(n for n in names if n.startswith(CARRIED_PREFIXES))


def wrapper_name(name: str) -> str:
    """A text-model tensor's name in the ConditionalGeneration layout."""
    return name if not name.startswith("model.") else "model.language_model." + name[len("model.") :]


def wrapper_config(source: dict, text: dict) -> dict:
    """The ConditionalGeneration config.json: `source` (the carried one) with its text config
    written from `text` (`hf_config`'s, of the model as trained) and the tie it implies."""
    old = dict(source.get("text_config") or {})
    text = {k: v for k, v in text.items() if k != "architectures"}
    # what the model does not hold stays the source's: the vision model's M-RoPE sections and
    # the context the checkpoint was published for
    text["rope_parameters"] = {**(old.get("rope_parameters") or {}), **text["rope_parameters"]}
    if "max_position_embeddings" in old:
        text["max_position_embeddings"] = old["max_position_embeddings"]
    return {
        **source,
        "architectures": source.get("architectures") or [CONDITIONAL_GENERATION],
        "text_config": {**old, **text},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def text_config(hf: dict) -> dict:
    """The text model's config.json keys: a ConditionalGeneration config's `text_config` (its
    own tie_word_embeddings, which the class ties by, over the text config's), else `hf`."""
    archs = hf.get("architectures") or [None]
    if archs[0] not in CONDITIONAL_GENERATIONS:
        return hf
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(f"config.json of {archs[0]} has no text_config")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "architectures": archs, "tie_word_embeddings": tie}


def settings(hf: dict) -> dict:
    """ModelConfig fields of a (text) config.json beyond Qwen3's (module docstring)."""
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if not layer_types:  # transformers' default: every full_attention_interval-th layer full
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = ["full_attention" if not (i + 1) % interval else "linear_attention" for i in range(n)]
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
    linear = LinearAttentionConfig(
        num_key_heads=int(hf["linear_num_key_heads"]),
        num_value_heads=int(hf["linear_num_value_heads"]),
        key_head_dim=int(hf["linear_key_head_dim"]),
        value_head_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
    )
    return {
        "layer_types": tuple(layer_types),
        "linear_attention": linear if "linear_attention" in layer_types else None,
        "attention_output_gate": True,
        "partial_rotary_factor": float(factor),
        "norm_scale_offset": 1.0,
    }


def moe_settings(hf: dict) -> MoEConfig:
    """Qwen3.5-MoE's MLPs: every layer softmax top-k, renormalised, dropless, beside one shared
    expert of shared_expert_intermediate_size scaled by its sigmoid gate."""
    k = hf["num_experts_per_tok"]
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:  # Qwen3-Next's keys
        raise ValueError(
            f"config.json mlp_only_layers={hf.get('mlp_only_layers')} decoder_sparse_step="
            f"{hf.get('decoder_sparse_step')}: only every layer MoE (mlp_only_layers=[], step 1) converts"
        )
    return MoEConfig(
        num_experts=hf["num_experts"],
        top_k=k,
        expert_mlp_dim=hf["moe_intermediate_size"],
        scoring="softmax",
        normalize_top_k=bool(hf.get("norm_topk_prob", True)),
        dispatch="dropless",
        num_shared_experts=1,
        shared_expert_mlp_dim=hf["shared_expert_intermediate_size"],
        shared_expert_gate=True,
        # HF sums its load-balancing loss over the k choices; ours averages (1.0 = balanced).
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)) * k,
        z_loss_weight=0.0,  # transformers adds no router z-loss
    )


def causal_lm_for(cfg: ModelConfig) -> str:
    return CAUSAL_LM if cfg.moe is None else MOE_CAUSAL_LM


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """Refuse, naming the key, a model Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM) cannot hold."""
    want = causal_lm_for(cfg)
    if arch in CONDITIONAL_GENERATIONS:
        raise ValueError(
            f"architecture {arch!r}: jaxtrain holds the text model only; write {want!r} (transformers "
            "loads it, and its tensors are the text model's of a ConditionalGeneration checkpoint; "
            "`jaxtrain convert ckpt-to-hf` of a checkpoint converted from the wrapper writes it again)"
        )
    if arch != want and not (arch == QWEN3_NEXT and cfg.moe is not None):
        raise ValueError(
            f"architecture {arch!r} with model.moe={'set' if cfg.moe else 'null'}: expected {want!r}"
        )
    if cfg.moe is not None:
        m = cfg.moe
        theirs = dataclasses.replace(
            moe_settings(
                {
                    "num_experts": m.num_experts,
                    "num_experts_per_tok": m.top_k,
                    "moe_intermediate_size": m.mlp_dim(cfg),
                    "shared_expert_intermediate_size": m.shared_mlp_dim(cfg),
                    "router_aux_loss_coef": m.aux_loss_weight / m.top_k,
                    # Qwen3.5-MoE always renormalises; Qwen3-Next as norm_topk_prob says
                    "norm_topk_prob": m.normalize_top_k if arch == QWEN3_NEXT else True,
                }
            ),
            **{k: getattr(m, k) for k in _MOE_RUNTIME},
        )
        wrong = [
            f"model.moe.{f.name}={getattr(m, f.name)!r} (expected {getattr(theirs, f.name)!r})"
            for f in dataclasses.fields(m)
            if getattr(m, f.name) != getattr(theirs, f.name)
        ]
        if wrong:
            raise ValueError(f"architecture {arch!r}: " + "; ".join(wrong))
    wanted = {
        "attention_output_gate": True,
        "norm_scale_offset": 1.0,
        "qk_norm": "head",
        "norm_placement": "pre",
        "qkv_bias": False,
        "attention_out_bias": False,
        "attention_sinks": False,
        "mlp_activation": "silu",
        "rope_scaling": None,
        "rope_interleave": False,
        "sliding_window": None,
        "attention_pattern": (),
        "attention_softcap": None,
        "final_softcap": None,
        "embedding_scale": 1.0,
        "attention_scale": None,
        "mla": None,
    }
    wrong = [
        f"model.{key}={getattr(cfg, key)!r} (expected {want!r})"
        for key, want in wanted.items()
        if getattr(cfg, key) != want and not (want is None and not getattr(cfg, key))
    ]
    if wrong:
        raise ValueError(f"architecture {arch!r}: " + "; ".join(wrong))


def hf_config(cfg: ModelConfig, rope: dict, arch: str | None = None) -> dict:
    """config.json of Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM (or Qwen3NextForCausalLM, as
    `arch`) for `cfg` (`check_exportable` first)."""
    if arch == QWEN3_NEXT:
        m = cfg.moe
        out = hf_config(cfg, rope)
        return {
            **out,
            "architectures": [QWEN3_NEXT],
            "model_type": "qwen3_next",
            "intermediate_size": cfg.mlp_dim,  # the width of mlp_only_layers, of which there are none
            "norm_topk_prob": m.normalize_top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "partial_rotary_factor": cfg.partial_rotary_factor,
        }
    la = cfg.linear_attention or LinearAttentionConfig()
    if cfg.moe is None:
        mlp = {"intermediate_size": cfg.mlp_dim}
    else:
        m = cfg.moe
        mlp = {
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.mlp_dim(cfg),
            "shared_expert_intermediate_size": m.shared_mlp_dim(cfg),
            "router_aux_loss_coef": m.aux_loss_weight / m.top_k,
        }
    return {
        "architectures": [causal_lm_for(cfg)],
        "model_type": MODEL_TYPE if cfg.moe is None else MOE_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        **mlp,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max(cfg.rope_original_max_position, 4096),
        "attention_bias": False,
        "layer_types": list(cfg.layer_kinds_by_type),
        "linear_num_key_heads": la.num_key_heads,
        "linear_num_value_heads": la.num_value_heads,
        "linear_key_head_dim": la.key_head_dim,
        "linear_value_head_dim": la.value_head_dim,
        "linear_conv_kernel_dim": la.conv_kernel,
        "rope_parameters": {**rope, "partial_rotary_factor": cfg.partial_rotary_factor},
        "dtype": "float32",
    }


def gated_query_to_ours(w: np.ndarray, cfg: ModelConfig, part: int) -> np.ndarray:
    """q_proj [H * 2 hd, D] (per head: query rows, then gate rows) -> the query (`part` 0) or
    the gate (1) as ours [D, H, hd]."""
    h, hd = cfg.n_heads, cfg.resolved_head_dim
    return w.reshape(h, 2, hd, -1)[:, part].transpose(2, 0, 1)


def gated_query_to_hf(wq: np.ndarray, wq_gate: np.ndarray) -> np.ndarray:
    """`gated_query_to_ours`' inverse: wq, wq_gate [D, H, hd] -> q_proj [H * 2 hd, D]."""
    d = wq.shape[0]
    return np.stack([wq, wq_gate], axis=2).reshape(d, -1).T
