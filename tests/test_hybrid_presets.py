"""The hybrid presets (configs/qwen3.5-35b-a3b.yaml, qwen3.5-397b-a17b.yaml, qwen3-next-80b-a3b.yaml)
are the published checkpoints' text models.

Oracles: the published text configs, written out here as the checkpoints' config.json holds them
(the Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B values are transformers 5.25's config defaults, whose
docstrings name those checkpoints, with rope_theta 1e7 as slime's scripts/models/*.sh give it;
Qwen3.5-397B-A17B's shapes from slime's scripts/models/qwen3.5-397B-A17B.sh, its DeltaNet head
counts as its preset's header says), read by our Hugging Face loader; and the parameter count
transformers itself gives the class built from each config, on the meta device:

    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(AutoConfig.for_model("qwen3_5_moe_text", **PUBLISHED[name]))
    sum(p.numel() for p in model.parameters())      # transformers 5.25.0, torch 2.13.0
"""

import os

import pytest

from jaxtrain.config import load_config
from jaxtrain.interchange.convert import architecture_of
from models.hf.families import config_from_hf
from tests.conftest import REPO

_COMMON = dict(
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    full_attention_interval=4, max_position_embeddings=262144, router_aux_loss_coef=0.001,
    rope_parameters=dict(rope_theta=10_000_000.0, partial_rotary_factor=0.25, rope_type="default"),
)  # fmt: skip
_QWEN3_5_MOE = dict(_COMMON, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
PUBLISHED = {
    "qwen3.5-35b-a3b": dict(
        _QWEN3_5_MOE, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
        num_experts_per_tok=8,
    ),
    "qwen3.5-397b-a17b": dict(
        _QWEN3_5_MOE, vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=64,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=512,
        num_experts_per_tok=10,
    ),
    "qwen3-next-80b-a3b": dict(
        _COMMON, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936,
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, decoder_sparse_step=1,
        norm_topk_prob=True, mlp_only_layers=[],
    ),
}  # fmt: skip
for _hf in PUBLISHED.values():
    _hf["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(_hf["num_hidden_layers"])
    ]
# transformers' own count of each class's parameters (the docstring's command)
TRANSFORMERS_PARAMS = {
    "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3.5-397b-a17b": 396_346_350_336,
    "qwen3-next-80b-a3b": 79_674_391_296,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_the_published_text_model(name):
    """Every field the weights fix equals what the Hugging Face loader reads from the published
    config (the preset writes layer_types as one repeat, which the model reads as layer i % 4),
    and the parameter count equals transformers'."""
    preset = load_config(os.path.join(REPO, "configs", f"{name}.yaml")).model
    published = config_from_hf(PUBLISHED[name])
    got, want = architecture_of(preset), architecture_of(published)
    kinds = lambda m: [m.layer_types[i % len(m.layer_types)] for i in range(m.n_layers)]  # noqa: E731
    assert kinds(preset) == kinds(published)
    got.pop("layer_types"), want.pop("layer_types")
    assert got == want
    assert preset.param_count() == published.param_count() == TRANSFORMERS_PARAMS[name]
