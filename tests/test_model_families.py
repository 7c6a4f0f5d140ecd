"""The model features of today's families (Qwen2/2.5, Qwen3, Qwen3-MoE, OLMo 2) as config:
q/k/v biases, QK-norm per head or over the whole projection, post-norms.

Their logits, greedy generations and exports are checked against transformers in
tests/test_hf.py and tests/test_generate.py (the assets tests/assets/make_hf_assets.py wrote);
here: one step sharded over fsdp x tensor (x expert) equals one device, the new parameters
follow the rules and are never weight-decayed, and the HF boundary names what it refuses."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.models.hf import HFConversionError, config_from_hf, hf_config
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.optimizer import decays
from tests.conftest import program_on_mesh, replace, tiny_config

ASSETS = Path(__file__).parent / "assets" / "hf"
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6

FAMILIES = {
    "qwen2": dict(qkv_bias=True, n_kv_heads=2),
    "qwen3": dict(qk_norm="head", head_dim=24, n_kv_heads=2),
    "olmo2": dict(qk_norm="projection", norm_placement="post", n_kv_heads=2),
    "qwen3-moe": dict(
        qk_norm="head", n_kv_heads=2, moe=dict(num_experts=4, top_k=2, expert_mlp_dim=64, dispatch="dropless")
    ),
}


# One step sharded against one device, for every feature at once: each compile costs seconds
# of the suite's budget, and the features are independent of each other.
SHARDED = {
    "bias+projection-norm+post": dict(
        qkv_bias=True, qk_norm="projection", norm_placement="post", head_dim=24, n_kv_heads=2
    ),
    "head-norm+moe": FAMILIES["qwen3-moe"],
}


def family_cfg(name, **mesh):
    model = dict(FAMILIES.get(name) or SHARDED[name])
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128",
        *(f"model.moe.{k}={v}" for k, v in model.pop("moe", {}).items()),
    )  # fmt: skip
    return replace(cfg, model=model, mesh=mesh)


def loss_and_grads(cfg):
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        return float(loss), jax.device_get(grads), jax.tree.map(lambda g: g.sharding.spec, grads)


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_step_equals_one_device(name):
    """fsdp=2 x tensor=2 (the MoE family: x expert=2): the loss and every gradient equal the
    single-device ones, the biases and QK-norm scales included, and those are split with
    their heads over tensor as the rules say."""
    mesh = dict(fsdp=2, tensor=2, expert=2 if "moe" in name else 1)
    ref_loss, ref_grads, _ = loss_and_grads(family_cfg(name, fsdp=1, tensor=1))
    loss, grads, specs = loss_and_grads(family_cfg(name, **mesh))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )
    stack = "moe_blocks" if "moe" in name else "blocks"
    attn = specs[stack]["attn"]
    rules = sharding.DEFAULT_RULES
    on_mesh = sharding.make_mesh(mesh, jax.devices()[: 4 * mesh["expert"]])
    if "bias" in name:
        assert attn["bq"] == sharding.logical_to_spec(("layers", "heads", "bias"), rules, on_mesh)
        assert attn["bq"][1] == "tensor"
        assert attn["q_norm"]["scale"][1] == "tensor"  # [layers, heads, head_dim]


def test_new_parameters_are_counted_and_never_decayed():
    """param_count equals the built model's, and biases and QK-norm scales get no weight decay."""
    from flax import nnx

    from jaxtrain import models

    for name in FAMILIES:
        cfg = family_cfg(name, fsdp=1).model
        model = models.Transformer(cfg, rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count(), name
        axes = jax.tree.leaves(
            nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
        )  # fmt: skip
        for var in axes:
            names = var.get_metadata().get("out_sharding")
            if "bias" in names or ("norm" in names and len(var.shape) > 1 and var.shape[-1] != cfg.d_model):
                assert not decays(names), (name, names)


def test_model_feature_values_are_checked():
    from jaxtrain.models import ModelConfig

    with pytest.raises(ValueError, match="model.qk_norm='layer': expected one of"):
        ModelConfig(qk_norm="layer").validate()
    with pytest.raises(ValueError, match="model.norm_placement='sandwich': expected one of"):
        ModelConfig(norm_placement="sandwich").validate()


def test_hf_boundary_reads_both_spellings_and_names_what_it_refuses():
    """Qwen3-MoE's expert count under either name; Qwen2's window off unless
    use_sliding_window; per-layer MoE patterns and windows refused by name; an export picks
    the class with the model's features, and refuses one without them."""
    moe = json.loads((ASSETS / "qwen3_moe" / "config.json").read_text())
    expected = config_from_hf(moe)
    renamed = {k: v for k, v in moe.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert config_from_hf(renamed) == expected and expected.moe.num_experts == 4
    with pytest.raises(HFConversionError, match="mlp_only_layers=\\[1\\]"):
        config_from_hf(moe | {"mlp_only_layers": [1]})
    qwen2 = json.loads((ASSETS / "qwen2_bias" / "config.json").read_text())
    # Qwen2 files from transformers 4.x carry a window with use_sliding_window false
    window_off = qwen2 | {"sliding_window": 4096, "use_sliding_window": False}
    assert config_from_hf(window_off).sliding_window is None
    with pytest.raises(HFConversionError, match="use_sliding_window=true"):
        config_from_hf(qwen2 | {"use_sliding_window": True})
    for asset, arch in [
        ("qwen2_bias", "Qwen2ForCausalLM"),
        ("qwen3_qk_norm", "Qwen3ForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
        ("olmo2_post_norm", "Olmo2ForCausalLM"),
    ]:
        cfg = config_from_hf(json.loads((ASSETS / asset / "config.json").read_text()))
        assert hf_config(cfg)["architectures"] == [arch]
        wrong = "MixtralForCausalLM" if cfg.moe is not None else "LlamaForCausalLM"
        with pytest.raises(HFConversionError, match=f"architecture '{wrong}' has"):
            hf_config(cfg, wrong)
