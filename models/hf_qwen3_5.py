"""Qwen3.5 / Qwen3.6 dense hybrids in Hugging Face's layout (models/hf.py reads and writes them).

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
`qwen3_5_tensor_to_ours`). The MoE members (Qwen3_5MoeForCausalLM, Qwen3-Next) are not read
yet: model.moe with linear-attention layers is refused (models/config.py).
"""

from __future__ import annotations

import numpy as np

from jaxtrain.models.config import LinearAttentionConfig, ModelConfig

CAUSAL_LM = "Qwen3_5ForCausalLM"
CONDITIONAL_GENERATION = "Qwen3_5ForConditionalGeneration"
ARCHITECTURES = (CAUSAL_LM, CONDITIONAL_GENERATION)
MODEL_TYPE = "qwen3_5_text"
# where the text model's tensors are in each class's checkpoints (lm_head.weight in both)
TEXT_PREFIXES = ("model.", "model.language_model.")
_DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' Qwen3_5TextConfig default when the key is absent
# a ConditionalGeneration checkpoint's tensors that are not the text model: carried, not read
CARRIED_PREFIXES = ("model.visual.", "mtp.")


def carried_names(arch: str | None, names) -> list[str]:
    """The tensors among `names` that conversion carries for a checkpoint of class `arch`."""
    if arch != CONDITIONAL_GENERATION:
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
        "architectures": [CONDITIONAL_GENERATION],
        "text_config": {**old, **text},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def text_config(hf: dict) -> dict:
    """The text model's config.json keys: a ConditionalGeneration config's `text_config` (its
    own tie_word_embeddings, which the class ties by, over the text config's), else `hf`."""
    archs = hf.get("architectures") or [None]
    if archs[0] != CONDITIONAL_GENERATION:
        return hf
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(f"config.json of {CONDITIONAL_GENERATION} has no text_config")
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


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """Refuse, naming the key, a model Qwen3_5ForCausalLM cannot hold."""
    if arch == CONDITIONAL_GENERATION:
        raise ValueError(
            f"architecture {arch!r}: jaxtrain holds the text model only; write {CAUSAL_LM!r} (transformers "
            "loads it, and its tensors are the text model's of a ConditionalGeneration checkpoint)"
        )
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
        "moe": None,
        "mla": None,
    }
    wrong = [
        f"model.{key}={getattr(cfg, key)!r} (expected {want!r})"
        for key, want in wanted.items()
        if getattr(cfg, key) != want and not (want is None and not getattr(cfg, key))
    ]
    if wrong:
        raise ValueError(f"architecture {arch!r}: " + "; ".join(wrong))


def hf_config(cfg: ModelConfig, rope: dict) -> dict:
    """config.json of Qwen3_5ForCausalLM for `cfg` (`check_exportable` first)."""
    la = cfg.linear_attention or LinearAttentionConfig()
    return {
        "architectures": [CAUSAL_LM],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
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
