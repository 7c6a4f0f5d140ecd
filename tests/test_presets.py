"""The DeepSeek-V3-family presets hold their published shapes: each preset's model section
equals what `from_hf` reads from the model's config.json (written out below as transformers'
DeepseekV3Config defaults, which are DeepSeek-V3's, and moonshotai/Moonlight-16B-A3B's
config.json), except the losses the presets choose (no z-loss, as DeepSeek trains)."""

import dataclasses

import pytest

from jaxtrain.config import load_config
from jaxtrain.models.hf import config_from_hf
from tests.conftest import REPO

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
MOONLIGHT = dict(
    DEEPSEEK_V3,
    vocab_size=163840,
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    routed_scaling_factor=2.446,
    q_lora_rank=None,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_scaling=None,
)


@pytest.mark.parametrize(
    "preset,hf,billions",
    [
        ("deepseek-v3-671b", DEEPSEEK_V3, 671.03),  # DeepSeek-V3's 671B (the MTP module apart)
        ("moonlight-16b-a3b", MOONLIGHT, 15.96),  # "16B"
    ],
)
def test_preset_is_the_published_model(preset, hf, billions):
    ours = load_config(f"{REPO}/configs/{preset}.yaml").model
    theirs = config_from_hf(hf)
    theirs = dataclasses.replace(theirs, moe=dataclasses.replace(theirs.moe, z_loss_weight=0.0))
    run_settings = ("param_dtype", "compute_dtype", "remat", "scan_layers", "attention_impl")
    for key in (f.name for f in dataclasses.fields(theirs) if f.name not in run_settings):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert round(ours.param_count() / 1e9, 2) == billions
