"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi K2 and Moonlight): latent attention
(models/mla.py), YaRN, group-limited sigmoid routing with a selection bias, shared experts and
dense first layers, and the multi-token prediction modules (models/mtp.py). Its config.json both
ways (`_deepseek_settings`, `_deepseek_hf_config`), its tensor names (`_deepseek_names`,
`_deepseek_mtp_names`) and latent attention's shapes (`_mla_shape`). Its block-FP8 weights are
dequantized as they are read: models/hf/fp8.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxtrain.models.config import MLAConfig, ModelConfig, MoEConfig
from jaxtrain.models.hf.common import _EXPERT_PARAMS, HFConversionError
from jaxtrain.models.hf.rope import _hf_rope

# Latent attention (model.mla), group-limited sigmoid routing with shared experts and dense first
# layers: DeepSeek-V3, Kimi K2, Moonlight (`_deepseek_settings`, `_deepseek_names`).
_DEEPSEEK = "DeepseekV3ForCausalLM"


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
