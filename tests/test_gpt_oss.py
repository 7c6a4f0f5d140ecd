"""GPT-OSS's model features as config: the MoE layer with a trained router bias, expert biases
and the clamped SwiGLU against a per-token plain loop, the clamp by hand, the parameters'
count, axes and decay, MXFP4 expert tensors dequantized on import (quantized here by the
format's definition), and the HF boundary.

Logits, greedy generation and the export against transformers: tests/test_hf.py and
tests/test_generate.py on tests/assets/hf/gpt_oss (tests/assets/make_hf_assets.py); one
sharded step against one device: tests/test_model_families.py."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxtrain import models, sharding
from jaxtrain.models import ModelConfig, MoEConfig, Transformer
from jaxtrain.models.hf import HFConversionError, config_from_hf, dequantize_mxfp4, hf_config
from jaxtrain.models.moe import expert_activation, moe_layer
from jaxtrain.trainer.optimizer import decays

ASSETS = Path(__file__).parent / "assets" / "hf"
# f32 layer against a float64 loop: f32 rounding
LAYER_RTOL, LAYER_ATOL = 1e-5, 1e-6

GPT_OSS_MOE = MoEConfig(
    num_experts=4,
    top_k=2,
    expert_mlp_dim=24,
    router_logit_bias=True,
    expert_bias=True,
    expert_activation="clamped_swiglu",
    swiglu_limit=1.0,
    capacity_factor=4.0,  # capacity dispatch keeps every assignment: the same output as dropless
)


def reference_gpt_oss_moe(x, w_router, b_router, experts, m: MoEConfig):
    """HF's GptOssMLP per token, in float64: logits = x W + b; the top-k logits' softmax
    weights each chosen expert's (clamped SwiGLU of x Wg + bg, x Wu + bu) Wd + bd."""
    w_gate, w_up, w_down, b_gate, b_up, b_down = (np.float64(t) for t in experts)
    x = np.float64(x)
    logits = x @ np.float64(w_router) + np.float64(b_router)
    y = np.zeros_like(x)
    for i in np.ndindex(*x.shape[:-1]):
        top = np.argsort(-logits[i], kind="stable")[: m.top_k]
        weights = np.exp(logits[i][top] - logits[i][top].max())
        weights /= weights.sum()
        for e, w in zip(top, weights):
            gate = np.minimum(x[i] @ w_gate[e] + b_gate[e], m.swiglu_limit)
            up = np.clip(x[i] @ w_up[e] + b_up[e], -m.swiglu_limit, m.swiglu_limit)
            h = (up + 1) * gate / (1 + np.exp(-m.swiglu_alpha * gate))
            y[i] += w * (h @ w_down[e] + b_down[e])
    return y


def layer_inputs(m: MoEConfig, d=16, seed=0):
    rng = np.random.default_rng(seed)
    e, f = m.num_experts, m.expert_mlp_dim
    x = rng.normal(size=(2, 8, d)).astype(np.float32)
    w_router = rng.normal(size=(d, e)).astype(np.float32)
    b_router = rng.normal(size=(e,)).astype(np.float32)
    shapes = [(e, d, f), (e, d, f), (e, f, d), (e, f), (e, f), (e, d)]
    experts = [(0.5 * rng.normal(size=s)).astype(np.float32) for s in shapes]
    return x, w_router, b_router, experts


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_gpt_oss_experts_equal_a_per_token_loop(dispatch):
    """Router bias in the logits, softmax over the chosen logits, gate/up biases inside the
    clamped SwiGLU, the down bias weighted with the rest of the expert's output."""
    m = dataclasses.replace(GPT_OSS_MOE, dispatch=dispatch)
    x, w_router, b_router, experts = layer_inputs(m)
    w_gate, w_up, w_down, *biases = (jnp.asarray(t) for t in experts)
    y, stats = moe_layer(
        jnp.asarray(x), jnp.asarray(w_router), None, w_gate, w_up, w_down, m,
        logit_bias=jnp.asarray(b_router), expert_biases=tuple(biases),
    )  # fmt: skip
    expected = reference_gpt_oss_moe(x, w_router, b_router, experts, m)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=LAYER_RTOL, atol=LAYER_ATOL)
    assert float(stats["dropped_fraction"]) == 0.0
    # the clamp is reached: without it the output differs
    unclamped = dataclasses.replace(m, swiglu_limit=1e9)
    unclamped = reference_gpt_oss_moe(x, w_router, b_router, experts, unclamped)
    assert np.max(np.abs(unclamped - expected)) > 0.1


@pytest.mark.parametrize("dispatch", ["dropless", "dropless-per-shard", "capacity"])
def test_gpt_oss_experts_split_over_expert_and_tensor_equal_the_loop(dispatch):
    """expert=2 x tensor=2: each shard's experts with their biases (gate/up split over tensor
    with the mlp, the down bias added once after the tensor sum), through the all-to-all
    (dropless: once per chosen expert, or once per expert shard, model.moe.dispatch_per_shard)."""
    dispatch, _, per_shard = dispatch.partition("-")
    m = dataclasses.replace(GPT_OSS_MOE, dispatch=dispatch, dispatch_per_shard=bool(per_shard))
    x, w_router, b_router, experts = layer_inputs(m, seed=1)
    mesh = sharding.make_mesh({"expert": 2, "tensor": 2}, jax.devices()[:4])
    w_gate, w_up, w_down, *biases = (jnp.asarray(t) for t in experts)
    layer = lambda x, r, rb, g, u, dn, biases: moe_layer(
        x, r, None, g, u, dn, m, logit_bias=rb, expert_biases=biases
    )[0]
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.PRESETS["fsdp_tensor"]):
        y = jax.jit(layer)(
            jnp.asarray(x), jnp.asarray(w_router), jnp.asarray(b_router), w_gate, w_up, w_down, tuple(biases)
        )
    expected = reference_gpt_oss_moe(x, w_router, b_router, experts, m)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=LAYER_RTOL, atol=LAYER_ATOL)


def test_clamped_swiglu_by_hand():
    """(up + 1) * gate * sigmoid(alpha * gate): the gate clamped above only, up both sides."""
    m = MoEConfig(expert_activation="clamped_swiglu")  # alpha 1.702, limit 7 (HF's defaults)
    gate = jnp.asarray([10.0, -10.0, 1.0, 0.0])
    up = jnp.asarray([-9.0, 9.0, 0.5, 3.0])
    sig = lambda v: 1 / (1 + math.exp(-1.702 * v))
    expected = [(-7 + 1) * 7 * sig(7), (7 + 1) * -10 * sig(-10), 1.5 * 1 * sig(1), 0.0]
    np.testing.assert_allclose(np.asarray(expert_activation(gate, up, m)), expected, rtol=1e-6)
    silu = MoEConfig()  # the default stays SwiGLU
    np.testing.assert_allclose(
        np.asarray(expert_activation(gate, up, silu)), np.asarray(jax.nn.silu(gate) * up), rtol=1e-6
    )


def gpt_oss_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=48, qkv_bias=True,
        attention_out_bias=True, attention_sinks=True, attention_pattern=("local", "global"),
        sliding_window=4, moe=GPT_OSS_MOE,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def test_parameters_counted_split_by_the_rules_and_never_decayed():
    """param_count (and active_param_count) equal the built model's; the sinks split over
    tensor with their heads; sinks and every bias free of weight decay."""
    cfg = gpt_oss_config()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    variables = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert sum(v.size for v in leaves) == cfg.param_count()
    m, d, f = cfg.moe, cfg.d_model, cfg.moe.expert_mlp_dim
    idle_experts = cfg.n_layers * (m.num_experts - m.top_k) * (3 * d * f + 2 * f + d)
    assert cfg.active_param_count() == cfg.param_count() - idle_experts
    params = nnx.to_pure_dict(variables)["moe_blocks"]
    for kind in ("layer_0", "layer_1"):  # a pattern group per two layers: [groups, ...]
        layer = params[kind]
        assert layer["attn"]["sinks"].shape == (2, 4) and layer["attn"]["bo"].shape == (2, d)
        assert layer["mlp"]["b_router"].shape == (2, 4) and layer["mlp"]["b_gate"].shape == (2, 4, f)
    axes = {
        "/".join(str(k.key) for k in path): v.get_metadata()["out_sharding"]
        for path, v in jax.tree_util.tree_leaves_with_path(
            variables, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
    }
    for name in ("attn/sinks", "attn/bo", "attn/bq", "mlp/b_router", "mlp/b_gate", "mlp/b_up", "mlp/b_down"):
        assert not decays(axes[f"moe_blocks/layer_0/{name}"]), name
    mesh = sharding.make_mesh(dict(tensor=2), jax.devices()[:2])
    spec = sharding.logical_to_spec(axes["moe_blocks/layer_0/attn/sinks"], sharding.DEFAULT_RULES, mesh)
    assert tuple(spec) == (None, "tensor")


def test_pattern_with_moe_is_checked():
    with pytest.raises(ValueError, match="model.moe.every=2 with model.attention_pattern"):
        gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, every=2)).validate()
    with pytest.raises(ValueError, match="model.moe.first_dense_layers=1 with model.attention_pattern"):
        gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, first_dense_layers=1)).validate()
    with pytest.raises(ValueError, match="model.moe.score_bias=true with model.attention_pattern"):
        gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, score_bias=True)).validate()
    with pytest.raises(ValueError, match="model.moe.expert_activation='gelu': expected one of"):
        gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, expert_activation="gelu")).validate()
    with pytest.raises(ValueError, match="model.moe.swiglu_limit=0.0: expected a positive number"):
        gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, swiglu_limit=0.0)).validate()
    with pytest.raises(ValueError, match="model.attention_sinks=true with model.attention_impl=cudnn"):
        gpt_oss_config(attention_impl="cudnn", compute_dtype="bfloat16").validate()
    gpt_oss_config(attention_impl="pallas").validate()  # the flash kernels take sinks
    gpt_oss_config(moe=dataclasses.replace(GPT_OSS_MOE, first_dense_layers=2)).validate()


# --- MXFP4 -------------------------------------------------------------------------------


def e2m1_value(code: int) -> float:
    """FP4 E2M1 by its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [E, K, N] (our [in, out]) -> (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32],
    the values they hold [E, K, N]), as GPT-OSS's checkpoints store experts: per output row,
    blocks of 32 inputs sharing an e8m0 scale 2^(s - 127), two codes a byte, low nibble first."""
    table = np.array([e2m1_value(c) for c in range(16)])
    rows = np.swapaxes(w, -1, -2).astype(np.float64)  # [E, N, K]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)  # [E, N, G, 32]
    amax = np.maximum(np.abs(groups).max(-1), 1e-30)
    exponent = np.ceil(np.log2(amax / 6.0))  # the block's largest value fits 6 (e2m1's max)
    scaled = groups / 2.0 ** exponent[..., None]
    codes = np.abs(scaled[..., None] - table).argmin(-1)  # nearest e2m1 value
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [E, N, G, 16]
    held = table[codes] * 2.0 ** exponent[..., None]
    held = np.swapaxes(held.reshape(rows.shape), -1, -2).astype(np.float32)
    # C order: safetensors writes an array's buffer as it lies
    contiguous = lambda a, dtype: np.ascontiguousarray(a, dtype=dtype)
    return contiguous(blocks, np.uint8), contiguous(exponent + 127, np.uint8), contiguous(held, np.float32)


def test_mxfp4_dequantizes_by_the_format_definition():
    """Hand-made codes: byte 0x2F holds code 15 (-6) at the even input and 2 (+1) at the odd
    one; scale 128 doubles them, 126 halves them; inputs are blocks of 32 per output row."""
    blocks = np.zeros((1, 2, 2, 16), np.uint8)  # [E=1, N=2 outputs, K/32=2 blocks, 16 bytes]
    blocks[0, 0, 0, 0] = 0x2F
    blocks[0, 1, 1, 3] = 0x70  # inputs 38 (code 0: +0) and 39 (code 7: +6) of output 1
    scales = np.full((1, 2, 2), 127, np.uint8)
    scales[0, 0, 0], scales[0, 1, 1] = 128, 126
    w = dequantize_mxfp4(blocks, scales)  # [E, K=64, N=2]
    expected = np.zeros((1, 64, 2), np.float32)
    expected[0, 0, 0], expected[0, 1, 0], expected[0, 39, 1] = -12.0, 2.0, 3.0
    np.testing.assert_array_equal(w, expected)
    every_code = np.arange(16, dtype=np.uint8)
    every_byte = (every_code | (every_code << 4)).reshape(1, 1, 1, 16)
    codes = dequantize_mxfp4(every_byte, np.full((1, 1, 1), 127, np.uint8))
    np.testing.assert_array_equal(codes[0, 0::2, 0], [e2m1_value(c) for c in range(16)])
    with pytest.raises(HFConversionError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks.astype(np.int32), scales)


def test_mxfp4_checkpoint_imports_as_its_dequantized_weights(tmp_path):
    """The tiny GPT-OSS checkpoint with its expert weights in MXFP4 (`*_blocks`, `*_scales`, as
    the published checkpoints) loads the values those blocks hold: the same logits as the
    checkpoint storing those values plainly (bit for bit), and within quantization error of
    the original's."""
    src = ASSETS / "gpt_oss"
    tensors = load_file(str(src / "model.safetensors"))
    plain, packed = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, held = quantize_mxfp4(tensors[name])
        plain[name] = held
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    for d, t in (("plain", plain), ("mxfp4", packed)):
        (tmp_path / d).mkdir()
        shutil.copy(src / "config.json", tmp_path / d / "config.json")
        save_file(t, str(tmp_path / d / "model.safetensors"))
    tokens = jnp.asarray(np.load(src / "tokens.npy"))
    logits = np.asarray(models.from_hf(tmp_path / "mxfp4")(tokens))
    np.testing.assert_array_equal(logits, np.asarray(models.from_hf(tmp_path / "plain")(tokens)))
    original = np.load(src / "logits.npy")
    assert 0 < np.max(np.abs(logits - original)) < 0.2 * np.max(np.abs(original))


# --- the HF boundary -----------------------------------------------------------------------


def test_hf_boundary_maps_gpt_oss_and_refuses_what_it_lacks():
    hf = json.loads((ASSETS / "gpt_oss" / "config.json").read_text())
    cfg = config_from_hf(hf)
    assert (cfg.attention_sinks, cfg.attention_out_bias, cfg.qkv_bias) == (True, True, True)
    assert (cfg.attention_pattern, cfg.sliding_window) == (("local", "global"), 4)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.expert_mlp_dim, m.scoring) == (4, 2, 32, "softmax")
    assert m.normalize_top_k
    assert (m.router_logit_bias, m.expert_bias, m.expert_activation) == (True, True, "clamped_swiglu")
    assert (m.swiglu_alpha, m.swiglu_limit, m.score_bias) == (1.702, 2.0, False)
    # transformers' default layer_types: sliding first, alternating
    assert config_from_hf({k: v for k, v in hf.items() if k != "layer_types"}) == cfg
    with pytest.raises(HFConversionError, match="attention_bias=false"):
        config_from_hf(hf | {"attention_bias": False})
    assert hf_config(cfg)["architectures"] == ["GptOssForCausalLM"]
    with pytest.raises(HFConversionError, match="needs model.attention_sinks"):
        hf_config(dataclasses.replace(cfg, attention_sinks=False))
    mixtral_like = dataclasses.replace(
        cfg, qkv_bias=False, attention_pattern=(), sliding_window=None, attention_out_bias=False
    )
    with pytest.raises(HFConversionError, match="'MixtralForCausalLM': model.attention_sinks"):
        hf_config(mixtral_like, "MixtralForCausalLM")


def test_convert_round_trip_writes_what_transformers_wrote(tmp_path):
    """`convert hf-to-ckpt` then `ckpt-to-hf`: the experts fused and interleaved again, every
    tensor equal to the one transformers saved, the config the same architecture's."""
    from jaxtrain.interchange.convert import architecture_of, ckpt_to_hf, hf_to_ckpt

    src = ASSETS / "gpt_oss"
    hf_to_ckpt(src, tmp_path / "ckpt")
    out = ckpt_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    theirs = load_file(str(src / "model.safetensors"))
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    exported, original = (config_from_hf(json.loads((d / "config.json").read_text())) for d in (out, src))
    assert architecture_of(exported) == architecture_of(original)


# --- the Hub's YaRN on sliding and full layers ---------------------------------------------

# openai/gpt-oss-20b's config.json (4.x spelling; transformers 5.25 reads it as rope_parameters)
HUB_ROPE = {
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
}
LOGIT_ATOL = 1e-5  # f32, as tests/test_hf.py; YaRN dropped on the sliding layers: 0.27


@pytest.mark.composes("sinks+attention_pattern", "moe+sinks", "moe+attention_pattern")
def test_yarn_on_sliding_and_full_layers_matches_transformers():
    """transformers gives GPT-OSS one rotary embedding: YaRN's frequencies and its attention
    factor (1 + 0.1 ln 32) on the sliding layers as on the full ones (only Gemma 3's local
    layers, model.local_rope_theta, have their own unscaled RoPE). The tiny checkpoint carries
    the Hub's settings, and its 16 tokens are 4 windows: `from_hf` gives transformers' logits.
    Greedy decode through the KV cache: tests/test_generate.py on the same asset."""
    d = ASSETS / "gpt_oss_yarn"
    hf = json.loads((d / "config.json").read_text())
    cfg = config_from_hf(hf)
    hub = {k: v for k, v in hf.items() if k != "rope_parameters"} | HUB_ROPE
    assert config_from_hf(hub) == cfg  # the asset holds the Hub's RoPE
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_position) == ("yarn", 32.0, 4096)
    assert (cfg.attention_pattern, cfg.local_rope_theta) == (("local", "global"), None)
    tokens = np.load(d / "tokens.npy")
    assert tokens.shape[1] >= 4 * cfg.sliding_window
    logits = np.asarray(models.from_hf(d)(jnp.asarray(tokens)))
    err = float(np.max(np.abs(logits - np.load(d / "logits.npy"))))
    assert err <= LOGIT_ATOL, err
