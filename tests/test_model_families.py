"""The model features of today's families (Qwen2/2.5, Qwen3, Qwen3-MoE, OLMo 2, Gemma 2 and 3)
as config: q/k/v biases, QK-norm per head or over the whole projection, post-norms, norms on
both sides with a (1 + w) scale, embedding scale, GeGLU, softcaps, a query scale, and a
repeating pattern of local and global layers.

Their logits, greedy generations and exports are checked against transformers in
tests/test_hf.py and tests/test_generate.py (the assets tests/assets/make_hf_assets.py wrote);
here: one step sharded over fsdp x tensor (x expert) equals one device, the new parameters
follow the rules and are never weight-decayed, and the HF boundary names what it refuses."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.models.config import LinearAttentionConfig
from jaxtrain.models.hf import HFConversionError, config_from_hf, hf_config
from jaxtrain.sharding.context import permute_batch
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
    "gemma2": dict(
        norm_placement="both", norm_scale_offset=1.0, embedding_scale=8.0, mlp_activation="gelu_tanh",
        attention_scale=0.2, attention_softcap=0.5, final_softcap=2.0, attention_pattern=("local", "global"),
        sliding_window=5, n_kv_heads=2, tie_embeddings=True, attention_impl="xla",
    ),
    "gemma3": dict(
        norm_placement="both", norm_scale_offset=1.0, embedding_scale=8.0, mlp_activation="gelu_tanh",
        qk_norm="head", attention_pattern=("local", "global"), sliding_window=5, local_rope_theta=100.0,
        rope_scaling="linear", rope_scaling_factor=8.0, n_kv_heads=2, tie_embeddings=True,
    ),
    "gpt-oss-moe": dict(
        qkv_bias=True, attention_out_bias=True, attention_sinks=True, attention_pattern=("local", "global"),
        sliding_window=5, n_kv_heads=2,
        moe=dict(
            num_experts=4, top_k=2, expert_mlp_dim=64, dispatch="dropless", router_logit_bias=True,
            expert_bias=True, expert_activation="clamped_swiglu", swiglu_limit=0.1,
        ),
    ),
}  # fmt: skip


# One step sharded against one device, for every feature at once: each compile costs seconds
# of the suite's budget, and the features are independent of each other.
SHARDED = {
    "bias+projection-norm+post": dict(
        qkv_bias=True, qk_norm="projection", norm_placement="post", head_dim=24, n_kv_heads=2
    ),
    "head-norm+moe": FAMILIES["qwen3-moe"],
    "gemma2-all": FAMILIES["gemma2"],
    # sinks, the output bias, MoE layers in pattern groups, the trained router and expert
    # biases (split with their experts over expert, the gate/up ones over tensor), clamped SwiGLU
    "gpt-oss-moe": FAMILIES["gpt-oss-moe"],
    # Qwen3.5-MoE: gated DeltaNet and gated full attention layers, every MLP an MoE (experts
    # over expert) beside a shared expert of its own width scaled by its sigmoid gate
    "qwen3.5-moe": dict(
        layer_types=("linear_attention", "full_attention"),
        linear_attention=LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8
        ),
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        qk_norm="head",
        norm_scale_offset=1.0,
        head_dim=16,
        n_kv_heads=2,
        moe=dict(
            num_experts=4,
            top_k=2,
            expert_mlp_dim=32,
            dispatch="dropless",
            num_shared_experts=1,
            shared_expert_mlp_dim=48,
            shared_expert_gate=True,
        ),
    ),
}
# the feature pairs each mesh case runs against one device (jaxtrain/compose.py)
SHARDED_PAIRS = {
    "bias+projection-norm+post": ("qk_norm+fsdp", "qk_norm+tensor"),
    "head-norm+moe": ("qk_norm+fsdp", "qk_norm+tensor", "qk_norm+expert"),
    "gemma2-all": (
        "attention_pattern+fsdp", "attention_pattern+tensor", "final_softcap+fsdp", "final_softcap+tensor",
    ),
    "gpt-oss-moe": (
        "sinks+fsdp", "sinks+tensor", "sinks+expert",
        "attention_pattern+fsdp", "attention_pattern+tensor", "attention_pattern+expert",
    ),
    "qwen3.5-moe": ("moe+linear_attention",),
}  # fmt: skip


def family_cfg(name, **mesh):
    model = dict(FAMILIES.get(name) or SHARDED[name])
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128",
        "train.loss_chunk=0", *(f"model.moe.{k}={v}" for k, v in model.pop("moe", {}).items()),
    )  # fmt: skip
    return replace(cfg, model=model, mesh=mesh)


def loss_and_grads(cfg):
    with program_on_mesh(cfg) as (program, state, data):
        # in zig-zag order over a context axis, as the trainer feeds it (positions travel along)
        batch = batch_to_device(permute_batch(next(data), cfg.mesh.context), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        return float(loss), jax.device_get(grads), jax.tree.map(lambda g: g.sharding.spec, grads)


@pytest.fixture(scope="module")
def one_device():
    """name -> the one-device (loss, grads, specs) of its model, each computed once in this
    file: gemma2's serves its sharded case and both kernel/ring cases."""
    cache = {}

    def get(name):
        model = FAMILIES.get(name) or SHARDED[name]
        key = next(n for n, m in {**FAMILIES, **SHARDED}.items() if m is model)
        if key not in cache:
            cache[key] = loss_and_grads(family_cfg(key, fsdp=1, tensor=1))
        return cache[key]

    return get


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.composes(*SHARDED_PAIRS[n])) for n in SHARDED]
)
def test_sharded_step_equals_one_device(one_device, name):
    """fsdp=2 x tensor=2 (the MoE family: x expert=2): the loss and every gradient equal the
    single-device ones, the biases and QK-norm scales included, and those are split with
    their heads over tensor as the rules say."""
    mesh = dict(fsdp=2, tensor=2, expert=2 if "moe" in name else 1)
    ref_loss, ref_grads, _ = one_device(name)
    loss, grads, specs = loss_and_grads(family_cfg(name, **mesh))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )
    stack = "moe_blocks" if "moe" in name else "blocks"
    rules = sharding.DEFAULT_RULES
    on_mesh = sharding.make_mesh(mesh, jax.devices()[: 4 * mesh["expert"]])
    if "gemma" in name:  # the layers in pattern groups; the post-norms replicated like every norm
        assert all(a is None for a in specs[stack]["layer_1"]["attn_post_norm"]["scale"])
    if "bias" in name:
        attn = specs[stack]["attn"]
        assert attn["bq"] == sharding.logical_to_spec(("layers", "heads", "bias"), rules, on_mesh)
        assert attn["bq"][1] == "tensor"
        assert attn["q_norm"]["scale"][1] == "tensor"  # [layers, heads, head_dim]


def test_new_parameters_are_counted_and_never_decayed():
    """param_count equals the built model's, and biases and QK-norm scales get no weight decay.
    The model is built abstractly (shapes and metadata, no values: nothing here reads one)."""
    from flax import nnx

    from jaxtrain import models

    for name in FAMILIES:
        cfg = family_cfg(name, fsdp=1).model
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):  # as models.abstract_model
            model = nnx.eval_shape(lambda cfg=cfg: models.Transformer(cfg, rngs=nnx.Rngs(0)))
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
    with pytest.raises(ValueError, match="model.mlp_activation='gelu': expected one of"):
        ModelConfig(mlp_activation="gelu").validate()
    with pytest.raises(ValueError, match=r"its length must divide model.n_layers=2"):
        ModelConfig(attention_pattern=("local", "local", "global"), sliding_window=4).validate()
    with pytest.raises(ValueError, match="has local layers: expected model.sliding_window"):
        ModelConfig(attention_pattern=("local", "global")).validate()
    with pytest.raises(ValueError, match="attention_softcap=50.0 with model.attention_impl=cudnn"):
        ModelConfig(attention_softcap=50.0, attention_impl="cudnn", compute_dtype="bfloat16").validate()
    ModelConfig(attention_softcap=50.0, attention_impl="pallas").validate()


def test_gemma_settings_resolve_to_what_runs_them():
    """An attention softcap runs the Pallas flash kernel on GPU and TPU (cuDNN's attention has
    no softcap, and says why it was passed over); a final softcap keeps the plain loss (the
    chunked one has none), and an explicit chunk is refused by name."""
    from jaxtrain.config import ConfigError, validate
    from jaxtrain.planning.resolve import Placement, resolve

    cfg = family_cfg("gemma2", fsdp=1)
    cfg = replace(cfg, model=dict(attention_impl="auto"), train=dict(loss_chunk="auto", seq_len=4096))
    for platform in ("gpu", "tpu"):
        r = resolve(
            cfg, Placement(platform, {"fsdp": 1}, 80 * 2**30, "", "h100" if platform == "gpu" else "v5p")
        )
        assert r.config.model.attention_impl == "pallas" and r.config.train.loss_chunk == 0
        if platform == "gpu":
            assert any("not cudnn: a logit softcap" in n for n in r.notes), r.notes
    with pytest.raises(ConfigError, match="train.loss_chunk=1024 with model.final_softcap=2.0"):
        validate(replace(cfg, train=dict(loss_chunk=1024)))


@pytest.mark.parametrize(
    "mesh,attention_impl,context_impl",
    [
        # the ring's XLA blocks: windowed pairs at a distance (its flash blocks, interpreted, are
        # tests/test_ring_attention.py's: a whole model of them costs the suite half a minute)
        pytest.param(
            dict(context=2),
            "xla",
            "ring",
            marks=pytest.mark.composes("attention_pattern+context", "final_softcap+context"),
        ),
        (dict(fsdp=2), "pallas", "ring"),  # the flash kernel, softcap and window, per shard
    ],
)
def test_gemma2_attention_on_the_kernels_and_the_ring_equals_xla_on_one_device(
    one_device, mesh, attention_impl, context_impl
):
    """Gemma 2's local layers (window 5 across the ring's chunks of 8), logit softcap and query
    scale through the Pallas kernel and ring attention: loss and every gradient equal XLA's
    attention on one device."""
    ref_loss, ref_grads, _ = one_device("gemma2")
    cfg = family_cfg("gemma2", **mesh)
    cfg = replace(cfg, model=dict(attention_impl=attention_impl, context_impl=context_impl))
    loss, grads, _ = loss_and_grads(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)


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
        ("gemma2_softcap", "Gemma2ForCausalLM"),
        ("gemma3_pattern", "Gemma3ForCausalLM"),
    ]:
        cfg = config_from_hf(json.loads((ASSETS / asset / "config.json").read_text()))
        assert hf_config(cfg)["architectures"] == [arch]
        wrong = "MixtralForCausalLM" if cfg.moe is not None else "LlamaForCausalLM"
        with pytest.raises(HFConversionError, match=f"architecture '{wrong}' has"):
            hf_config(cfg, wrong)


def test_gemma_boundary_reads_its_own_keys_and_refuses_what_does_not_tile():
    """Gemma's activation is `hidden_activation` (a loader defaulting to SiLU would be silently
    wrong); query_pre_attn_scalar, not head_dim, sets the scale; layer_types becomes the
    pattern (4.x files: sliding_window_pattern); Gemma 3's RoPE per layer type; a pattern
    that does not tile the depth (Gemma 3 1B: 26 layers of 6) makes the whole depth one group;
    an export of a model without Gemma's features to a Gemma class is refused."""
    gemma3 = json.loads((ASSETS / "gemma3_pattern" / "config.json").read_text())
    cfg = config_from_hf(gemma3)
    assert (cfg.mlp_activation, cfg.attention_pattern) == ("gelu_tanh", ("local",) * 5 + ("global",))
    assert cfg.attention_scale == pytest.approx(24**-0.5) and cfg.embedding_scale == pytest.approx(8.0)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.local_rope_theta) == (
        1e6, "linear", 8.0, 10000.0,
    )  # fmt: skip
    old = {k: v for k, v in gemma3.items() if k not in ("layer_types", "rope_parameters")}
    old |= {"sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0}
    old |= {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert config_from_hf(old) == cfg  # the transformers 4.x spelling
    with pytest.raises(HFConversionError, match="activation 'gelu' is not supported"):
        config_from_hf(gemma3 | {"hidden_activation": "gelu"})
    # Gemma 3 1B's 26 layers of a 6-layer pattern: the depth is one (unrolled) group
    types = gemma3["layer_types"] + ["sliding_attention"] * 2
    assert len(config_from_hf(gemma3 | {"num_hidden_layers": 8, "layer_types": types}).attention_pattern) == 8
    gemma2 = config_from_hf(json.loads((ASSETS / "gemma2_softcap" / "config.json").read_text()))
    assert (gemma2.attention_softcap, gemma2.final_softcap, gemma2.attention_pattern) == (
        0.5,
        2.0,
        ("local", "global"),
    )
    with pytest.raises(HFConversionError, match="model.embedding_scale=1.0 \\(expected 8.0"):
        hf_config(dataclasses.replace(gemma2, embedding_scale=1.0))


def train_from_converted(asset: Path, tmp_path: Path):
    """`convert hf-to-ckpt` of `asset`, one step with `train.init_from` on it, `convert ckpt-to-hf`:
    (the first loss, the HF model's cross-entropy on that batch, the exported directory)."""
    import optax

    from jaxtrain.data import make_data_iterator
    from jaxtrain.interchange.convert import ckpt_to_hf, hf_to_ckpt
    from jaxtrain.models.hf import from_hf
    from jaxtrain.trainer import train

    model_cfg = hf_to_ckpt(asset, tmp_path / "ckpt")
    cfg = tiny_config(
        tmp_path / "run", "train.steps=1", "train.seq_len=16", "checkpoint.every=1", "train.loss_chunk=0"
    )
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(model_cfg, attention_impl="auto", remat="auto"),
        train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "ckpt")),
    )
    first = train(cfg, devices=jax.devices()[:1]).metrics[0]["loss"]
    data = make_data_iterator(
        cfg.data, vocab_size=128, seq_len=16, global_batch_size=cfg.train.global_batch_size, seed=cfg.seed
    )
    batch = next(data)
    logits = from_hf(asset)(batch["inputs"])
    expected = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean())
    return first, expected, ckpt_to_hf(tmp_path / "run", tmp_path / "hf")


@pytest.mark.composes("lm+attention_pattern", "lm+qk_norm")
def test_training_starts_from_a_converted_gemma3_checkpoint(tmp_path):
    """`convert hf-to-ckpt` then `train.init_from` on Gemma 3 (pattern groups, post-norms,
    QK-norm): the first loss is the converted model's cross-entropy on the first batch, and
    the trained checkpoint exports to the same class."""
    first, expected, out = train_from_converted(ASSETS / "gemma3_pattern", tmp_path)
    assert abs(first - expected) < 1e-4
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_local_layers_have_their_own_rope_only_where_the_config_says():
    """Gemma 3's config.json gives its local layers their own unscaled RoPE (model.local_rope_theta:
    base 10000, no x8) and exports it so; a Gemma 3 whose local layers share the scaled global
    RoPE (local_rope_theta null, as GPT-OSS's and Gemma 2's one rotary embedding) exports
    `sliding_attention` as the global parameters and reads back so. Any other scaled
    `sliding_attention`, and an own local RoPE for a class with one rotary embedding, are refused.
    Logits: tests/test_hf.py (gemma3_pattern) and tests/test_gpt_oss.py (gpt_oss_yarn)."""
    gemma3 = json.loads((ASSETS / "gemma3_pattern" / "config.json").read_text())
    cfg = config_from_hf(gemma3)
    sliding = hf_config(cfg)["rope_parameters"]["sliding_attention"]
    assert (cfg.local_rope_theta, sliding) == (10000.0, {"rope_type": "default", "rope_theta": 10000.0})
    shared = dataclasses.replace(cfg, local_rope_theta=None)
    rope = hf_config(shared)["rope_parameters"]
    assert rope["sliding_attention"] == rope["full_attention"] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6,
    }  # fmt: skip
    assert config_from_hf(hf_config(shared)) == shared
    other = {**rope, "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(HFConversionError, match="rope_parameters.sliding_attention="):
        config_from_hf(gemma3 | {"rope_parameters": other})
    gpt_oss = config_from_hf(json.loads((ASSETS / "gpt_oss_yarn" / "config.json").read_text()))
    with pytest.raises(HFConversionError, match="model.local_rope_theta=10000.0 does not convert"):
        hf_config(dataclasses.replace(gpt_oss, local_rope_theta=10000.0))
