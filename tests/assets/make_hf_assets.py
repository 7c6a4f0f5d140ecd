"""Build the tiny Hugging Face test checkpoints in tests/assets/hf/ (run once, commit the output).

Needs torch + transformers, which the project does not depend on; on this
machine's Python 3.11:
    python3 -m venv /tmp/hf311 && /tmp/hf311/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hf311/bin/python tests/assets/make_hf_assets.py [NAME ...]
Each model directory gets config.json + model.safetensors (as transformers
saves them) and logits.npy: transformers' float32 logits (eager attention) on
tokens.npy. The suite compares `models.from_hf` against these logits.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

OUT = Path(__file__).parent / "hf"
TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 16))

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    attn_implementation="eager",
)

MODELS = {
    # GQA + Llama 3.1 RoPE scaling (small original context so scaling changes short positions)
    "llama_gqa_rope_llama3": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
    # MHA, tied embeddings, default RoPE
    "llama_tied": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
    ),
    # Mistral: GQA + a sliding window shorter than the sequence
    "mistral_sliding_window": lambda: MistralForCausalLM(
        MistralConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=5,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
    ),
    # Mixtral: 4 experts, top-2, GQA
    "mixtral_moe": lambda: MixtralForCausalLM(
        MixtralConfig(
            **{**COMMON, "intermediate_size": 48},
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
    ),
    # Qwen2.5: q/k/v biases, GQA, tied embeddings (as the small Qwen2.5 models)
    "qwen2_bias": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            use_sliding_window=False,
            sliding_window=4,  # written by Qwen2 files, off while use_sliding_window is false
        )
    ),
    # Qwen3: QK-norm per head, head_dim 24 (not hidden / heads = 16)
    "qwen3_qk_norm": lambda: Qwen3ForCausalLM(
        Qwen3Config(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        )
    ),
    # Qwen3-MoE: QK-norm, 4 experts top-2 renormalised, every layer MoE
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        )
    ),
    # OLMo 2: norms after attention and MLP, RMSNorm over the whole q and k projections
    "olmo2_post_norm": lambda: Olmo2ForCausalLM(
        Olmo2Config(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
        )
    ),
    # Gemma 2: GeGLU, (1 + w) norms before and after each sublayer, sqrt(d) embeddings,
    # query_pre_attn_scalar 24 (not head_dim 16), local (window 5) and global layers
    # alternating, softcaps small enough to bend these tiny models' scores and logits
    "gemma2_softcap": lambda: Gemma2ForCausalLM(
        Gemma2Config(
            **{**COMMON, "num_hidden_layers": 4},
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=5,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=2.0,
            initializer_range=0.1,  # larger scores and logits, for the caps to bend
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
    ),
    # Gemma 3: as Gemma 2 without softcaps, plus QK-norm; five local layers (window 3, RoPE
    # base 10000) to one global (base 1e6, linear scaling x8)
    "gemma3_pattern": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 6},
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=3,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    ),
    # GPT-OSS: a sink per head, biases on q/k/v/o, sliding (window 4) and full layers
    # alternating, 4 experts top-2 with a trained router bias, expert biases and the clamped
    # SwiGLU, its limit low enough that some gates and ups reach it (without the clamp the
    # logits move by 0.2); default RoPE (no YaRN)
    "gpt_oss": lambda: GptOssForCausalLM(
        GptOssConfig(
            **{**COMMON, "intermediate_size": 32},
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=2.0,
            initializer_range=0.1,  # token-dependent parts that the biases do not drown
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    ),
    # GPT-OSS with the Hub's RoPE (openai/gpt-oss-20b's config.json: rope_theta 150000 and
    # rope_scaling yarn, factor 32 over 4096 positions, betas 32 / 1, truncate false), sliding
    # (window 4) and full layers alternating over 16 tokens: transformers applies its one YaRN
    # rotary embedding (frequencies and attention factor) to both kinds. Smaller dims than
    # `gpt_oss`: the asset is about the RoPE, not the experts.
    "gpt_oss_yarn": lambda: GptOssForCausalLM(
        GptOssConfig.from_dict(
            dict(
                **{**COMMON, "hidden_size": 32, "intermediate_size": 16, "max_position_embeddings": 131072},
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                sliding_window=4,
                num_local_experts=4,
                num_experts_per_tok=2,
                swiglu_limit=2.0,
                initializer_range=0.1,
                tie_word_embeddings=False,
                rope_theta=150000,  # the Hub's 4.x spelling, as transformers 5.25 reads it
                rope_scaling={
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                    "rope_type": "yarn",
                    "truncate": False,
                },
            )
        )
    ),
}

# DeepSeek-V3: latent attention (q through a latent of q_lora_rank, or not), YaRN with mscale !=
# mscale_all_dim (cos/sin and the softmax scale both change), interleaved RoPE pairs, sigmoid
# routing over 8 experts in 4 groups (best 2), a selection bias, weights x 2.5, a shared
# expert, and a dense first layer of intermediate_size
DEEPSEEK = dict(
    **{**COMMON, "intermediate_size": 96},
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=16,
    routed_scaling_factor=2.5,
    num_mtp_layers=0,
    tie_word_embeddings=False,
)
MODELS["deepseek_v3_yarn"] = lambda: DeepseekV3ForCausalLM(
    DeepseekV3Config(
        **DEEPSEEK,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    )
)
# Moonlight-like: a plain query projection, every layer MoE, no groups, rotate-half RoPE pairs
MODELS["deepseek_v3_plain_q"] = lambda: DeepseekV3ForCausalLM(
    DeepseekV3Config(
        **DEEPSEEK,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
)


# Qwen3.5 (Qwen/Qwen3.5-27B's text config, scaled down): three gated-DeltaNet layers to one full
# attention layer, the full layers' q_proj carrying an output gate, a quarter of each head
# rotated (rope_parameters' partial_rotary_factor, with the Hub's interleaved M-RoPE sections:
# equal to plain RoPE on text), (1 + w) norms, QK-norm; dk != dv and two value heads per key
# head. 140 tokens: longer than two of the delta rule's 64-token chunks.
QWEN3_5_TEXT = dict(
    **{**COMMON, "num_hidden_layers": 4, "rms_norm_eps": 1e-6},
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=False,
)
MODELS["qwen3_5_hybrid"] = lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TEXT))
# The Hub's Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration (a vision tower beside the
# text model, text under model.language_model.*); a tiny tower here, tied embeddings as the
# small Hub models have them. Its logits are the text model's on text alone.
MODELS["qwen3_5_vl_text"] = lambda: Qwen3_5ForConditionalGeneration(
    Qwen3_5Config(
        text_config={**QWEN3_5_TEXT, "tie_word_embeddings": True},
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=64,
            num_position_embeddings=16,
        ),
        tie_word_embeddings=True,
    )
)
# Qwen3.5-MoE (Qwen/Qwen3.5-35B-A3B's text config, scaled down): the same layers, every MLP
# an MoE of 4 experts (top 2, renormalised) beside a shared expert of its own width whose
# output a per-token sigmoid gate scales
MODELS["qwen3_5_moe_hybrid"] = lambda: Qwen3_5MoeForCausalLM(
    Qwen3_5MoeTextConfig(
        **{k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        router_aux_loss_coef=0.001,
    )
)
# Qwen3-Next (Qwen/Qwen3-Next-80B-A3B's layout, scaled down): the Qwen3.5-MoE layers with the
# DeltaNet projections fused per key-head group (in_proj_qkvz, in_proj_ba); norm_topk_prob
# false, so the routed weights are not renormalised
MODELS["qwen3_next_moe"] = lambda: Qwen3NextForCausalLM(
    Qwen3NextConfig(
        **{k: v for k, v in QWEN3_5_TEXT.items() if k != "rope_parameters"},
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
    )
)
# where a model needs longer rows than TOKENS (and the directory it goes to, when not hf/)
TOKENS_FOR = {
    "qwen3_5_hybrid": np.random.default_rng(1).integers(0, 128, size=(2, 140)),
    "qwen3_5_vl_text": np.random.default_rng(1).integers(0, 128, size=(2, 140)),
    "qwen3_5_moe_hybrid": np.random.default_rng(1).integers(0, 128, size=(2, 140)),
    "qwen3_next_moe": np.random.default_rng(1).integers(0, 128, size=(2, 140)),
}
OUT_FOR = {"qwen3_5_vl_text": Path(__file__).parent / "hf_multimodal"}


def main(names=None):
    print("transformers", transformers.__version__, "torch", torch.__version__)
    for name, build in MODELS.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():  # random norms too, so a dropped norm would show; a sharper router
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                # initialised to zero (GPT-OSS's sinks: small): a dropped one would not show
                if n.endswith((".bias", "_bias", ".sinks")):
                    p.copy_(0.5 * torch.randn_like(p))
                if n.endswith(("mlp.gate.weight", "mlp.router.weight")):  # decisive top-2 choices
                    p.mul_(20.0)
            for n, b in model.named_buffers():  # DeepSeek-V3's selection bias (zeros at init)
                if n.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
            tokens = TOKENS_FOR.get(name, TOKENS)
            logits = model(torch.tensor(tokens)).logits.float().numpy()
        d = OUT_FOR.get(name, OUT) / name
        model.save_pretrained(d, safe_serialization=True)
        np.save(d / "tokens.npy", tokens.astype(np.int32))
        np.save(d / "logits.npy", logits.astype(np.float32))
        print(name, "logits", logits.shape, "max |logit|", float(np.abs(logits).max()))


if __name__ == "__main__":
    main(sys.argv[1:])  # names of MODELS, or none for all
