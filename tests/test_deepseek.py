"""The DeepSeek-V3 family (also Kimi K2, Moonlight) as config: latent attention (`model.mla`),
YaRN RoPE with DeepSeek's mscales and interleaved pairs, group-limited routing with the routed
scaling factor (`model.moe.num_groups`, `top_k_groups`, `routed_scaling_factor`).

Oracles: plain-numpy transcriptions of transformers 5.24's DeepseekV3TopkRouter and
`_compute_yarn_parameters` written here; transformers' own float32 logits for tiny random
DeepseekV3ForCausalLM checkpoints (tests/assets/make_hf_assets.py) are checked in
tests/test_hf.py with the other families."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.models import MLAConfig, ModelConfig, MoEConfig, Transformer
from jaxtrain.models.generation import decode_step, generate, prefill
from jaxtrain.models.hf import HFConversionError, config_from_hf, from_hf, hf_config
from jaxtrain.models.layers import rope_attention_factor, rope_frequencies
from jaxtrain.models.moe import dispatch_per_shard, route
from jaxtrain.trainer.optimizer import decays
from tests.conftest import replace, tiny_config
from tests.test_compile import TINY, needs_tpu, run_compile
from tests.test_model_families import GRAD_ATOL, GRAD_RTOL, LOSS_RTOL, loss_and_grads

ASSETS = Path(__file__).parent / "assets" / "hf"
ROUTE_ATOL = 1e-6
DECODE_ATOL = 1e-5  # f32 sigmoid weights against float64 numpy


def hf_routing(x, w_router, bias, *, groups, top_groups, k, scale, normalize):
    """transformers' DeepseekV3TopkRouter.forward in numpy (float64): -> (ids [T, k] in
    descending selection order, weights [T, k])."""
    logits = np.float64(x) @ np.float64(w_router)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + np.float64(bias)
    t, e = choice.shape
    group_scores = np.sort(choice.reshape(t, groups, e // groups), axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :top_groups]
    allowed = np.zeros((t, groups), bool)
    np.put_along_axis(allowed, best_groups, True, axis=-1)
    choice = np.where(np.repeat(allowed, e // groups, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * scale


@pytest.mark.parametrize("normalize", [True, False])
def test_group_limited_routing_equals_transformers_router(normalize):
    """16 experts in 4 groups, the best 2 groups, top-4, scale 2.5, a selection bias: the ids
    and weights of HF's router (numpy transcription); the groups change some tokens' choices,
    so dropping the group limit would fail this."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    w = rng.normal(size=(32, 16)).astype(np.float32) * 0.5
    bias = rng.normal(size=(16,)).astype(np.float32) * 0.3
    m = MoEConfig(
        num_experts=16, top_k=4, scoring="sigmoid", score_bias=True, num_groups=4, top_k_groups=2,
        routed_scaling_factor=2.5, normalize_top_k=normalize,
    )  # fmt: skip
    _, _, idx, weights = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), m)
    ids, expected = hf_routing(x, w, bias, groups=4, top_groups=2, k=4, scale=2.5, normalize=normalize)
    np.testing.assert_array_equal(np.asarray(idx), ids)
    np.testing.assert_allclose(np.asarray(weights), expected, atol=ROUTE_ATOL)
    plain, _ = hf_routing(x, w, bias, groups=1, top_groups=1, k=4, scale=2.5, normalize=normalize)
    assert (np.sort(plain, -1) != np.sort(ids, -1)).any(axis=-1).sum() >= 5


def test_group_routing_keys_are_checked():
    for bad, match in (
        (dict(num_groups=3), "num_groups=3"),
        (dict(num_groups=4, top_k_groups=5), "top_k_groups=5"),
        (dict(num_groups=8, top_k_groups=1), "at least 2 experts"),
        (dict(num_groups=4, top_k_groups=1, top_k=3), "top_k=3"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ):
        cfg = ModelConfig(moe=MoEConfig(**{"num_experts": 8, "top_k": 2, **bad}))
        with pytest.raises(ValueError, match=match):
            cfg.validate()


def hf_yarn(dim, base, factor, original, *, beta_fast, beta_slow, truncate, mscale, mscale_all):
    """transformers' `_compute_yarn_parameters` in numpy: -> (inv_freq [dim / 2], attention factor)."""
    get_mscale = lambda s, m=1: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    attention = get_mscale(factor)
    if mscale and mscale_all:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    correction = lambda rot: (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction(beta_fast), correction(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1 - ramp
    inv = 1 / (factor * pos) * (1 - extrapolation) + 1 / pos * extrapolation
    return inv, attention


DEEPSEEK_YARN = dict(rope_theta=10000.0, rope_scaling_factor=40.0, rope_original_max_position=4096)
YARN_CASES = {  # DeepSeek-V3's parameters (rope dim 64), GPT-OSS's (head dim 64, no truncation)
    "deepseek-v3": (64, dict(**DEEPSEEK_YARN, rope_mscale=1.0, rope_mscale_all_dim=1.0, rope_beta_fast=32.0)),
    "deepseek-mscale-differs": (64, dict(**DEEPSEEK_YARN, rope_mscale=0.707, rope_mscale_all_dim=1.0)),
    "gpt-oss": (64, dict(rope_theta=150000.0, rope_scaling_factor=32.0, rope_original_max_position=4096,
                         rope_truncate=False)),
}  # fmt: skip


@pytest.mark.parametrize("name", YARN_CASES)
def test_yarn_frequencies_and_attention_factor_equal_transformers(name):
    """Frequencies within 1e-6 relative of the float64 transcription (f32), the cos/sin factor
    within 1e-12: DeepSeek-V3's equal mscales give exactly 1, GPT-OSS's none 0.1 ln 32 + 1."""
    dim, keys = YARN_CASES[name]
    mla = {"mla": MLAConfig()} if "rope_mscale_all_dim" in keys else {}  # it scales MLA's softmax
    cfg = ModelConfig(rope_scaling="yarn", **keys, **mla)
    cfg.validate()
    inv, attention = hf_yarn(
        dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_position,
        beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate,
        mscale=cfg.rope_mscale, mscale_all=cfg.rope_mscale_all_dim,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg, dim=dim)), inv, rtol=1e-6)
    assert abs(rope_attention_factor(cfg) - attention) < 1e-12
    plain = 1 / cfg.rope_theta ** (np.arange(0, dim, 2) / dim)
    assert np.abs(inv / plain - 1).max() > 0.5  # the scaling bends these frequencies
    if name == "deepseek-v3":
        assert rope_attention_factor(cfg) == 1.0
    if name == "gpt-oss":
        assert abs(rope_attention_factor(cfg) - (0.1 * math.log(32) + 1)) < 1e-12


def test_yarn_truncate_moves_the_ramp():
    """GPT-OSS's truncate=false changes the frequencies at the ramp's ends (else the key is dead)."""
    keys = dict(rope_scaling="yarn", rope_theta=1.5e5, rope_scaling_factor=32.0)
    a = rope_frequencies(ModelConfig(**keys), dim=64)
    b = rope_frequencies(ModelConfig(**keys, rope_truncate=False), dim=64)
    assert float(jnp.max(jnp.abs(a / b - 1))) > 1e-3


def deepseek_config(q_lora_rank=24, top_k=2, **mesh):
    """A tiny DeepSeek-V3-shaped run: MLA (q latent or not), YaRN with both mscales and
    interleaved pairs, a dense first layer, then MoE: 8 experts in 4 groups (best 2), top-2
    (or `top_k`), scaled by 2.5, a selection bias and a shared expert."""
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=96", "train.seq_len=32", "model.vocab_size=128",
        "train.loss_chunk=0", "model.n_kv_heads=4", "model.n_heads=4",
    )  # fmt: skip
    model = dict(
        mla=MLAConfig(
            q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12
        ),
        moe=MoEConfig(
            num_experts=8, top_k=top_k, expert_mlp_dim=16, num_shared_experts=1, scoring="sigmoid",
            score_bias=True, num_groups=4, top_k_groups=2, routed_scaling_factor=2.5,
            first_dense_layers=1, dispatch="dropless",
        ),
        rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_position=8, rope_mscale=1.0,
        rope_mscale_all_dim=0.5, rope_interleave=True,
    )  # fmt: skip
    return replace(cfg, model=model, mesh=mesh)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_param_count_and_logical_axes(q_lora_rank):
    """param_count equals the built model's; heads shard over tensor, the latents never do (and
    take fsdp only where embed does not), the latent norms are never weight-decayed."""
    cfg = deepseek_config(q_lora_rank, fsdp=1).model
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()
    mesh = sharding.make_mesh(dict(fsdp=2, tensor=2), jax.devices()[:4])
    spec = lambda names: sharding.logical_to_spec(names, sharding.DEFAULT_RULES, mesh)
    attn = nnx.state(model, nnx.Param)["moe_blocks"]["attn"]
    names = {k: v.get_metadata()["out_sharding"] for k, v in attn.items() if isinstance(v, nnx.Variable)}
    # (trailing replicated dims are left out of a spec)
    assert spec(names["wkv_a"]) == P(None, "fsdp")  # [layers, embed, kv_lora]
    assert spec(names["wkv_b"]) == P(None, "fsdp", "tensor")  # [layers, kv_lora, heads, width]
    assert spec(names["wo"]) == P(None, "tensor", None, "fsdp")
    if q_lora_rank:
        assert spec(names["wq_a"]) == P(None, "fsdp")
        assert spec(names["wq_b"]) == P(None, "fsdp", "tensor")
        assert not decays(attn["q_norm"]["scale"].get_metadata()["out_sharding"])
    assert not decays(attn["kv_norm"]["scale"].get_metadata()["out_sharding"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "top_k,mesh",
    [
        pytest.param(
            2,
            dict(fsdp=2, tensor=2, expert=2),
            marks=pytest.mark.composes("mla+fsdp", "mla+tensor", "mla+expert"),
        ),
        pytest.param(4, dict(expert=4), marks=pytest.mark.composes("mla+expert")),
    ],
    ids=["fsdp,tensor,expert", "groups-on-shards"],
)
def test_sharded_step_equals_one_device(top_k, mesh):
    """fsdp=2 x tensor=2 x expert=2, and expert=4 with top-4, where each of the 4 groups lies on
    one expert shard, so a token's 4 experts lie on its best 2 groups' 2 shards and it is sent
    once per shard (model.moe.dispatch_per_shard auto): the loss and every gradient (latent
    projections and norms, router, selection bias, experts, shared expert) equal one device's."""
    cfg = deepseek_config(top_k=top_k, **mesh)
    assert dispatch_per_shard(cfg.model.moe, mesh["expert"]) is (top_k == 4)
    ref_loss, ref_grads, _ = loss_and_grads(deepseek_config(top_k=top_k, fsdp=1, tensor=1))
    loss, grads, specs = loss_and_grads(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    jax.tree.map(close, grads, ref_grads)
    if mesh.get("tensor", 1) > 1:
        assert specs["moe_blocks"]["attn"]["wkv_b"][2] == "tensor"


def test_hf_config_mapping_by_hand():
    """DeepseekV3ForCausalLM's config.json keys land where they belong (logits and exports are
    checked against transformers in tests/test_hf.py): routing, shared experts, the dense first
    layer's intermediate_size, the latents, YaRN's keys, rope_interleave; hf_config writes them back."""
    hf = json.loads((ASSETS / "deepseek_v3_yarn" / "config.json").read_text())
    cfg = config_from_hf(hf)
    m, mla = cfg.moe, cfg.mla
    assert (m.num_experts, m.top_k, m.expert_mlp_dim, m.num_shared_experts) == (8, 2, 16, 1)
    assert (m.num_groups, m.top_k_groups, m.routed_scaling_factor, m.first_dense_layers) == (4, 2, 2.5, 1)
    assert m.scoring == "sigmoid" and m.score_bias and m.normalize_top_k and cfg.mlp_dim == 96
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim) == (24, 16, 8, 4)
    assert mla.v_head_dim == 12 and cfg.rope_interleave
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_position) == ("yarn", 4.0, 8)
    assert (cfg.rope_mscale, cfg.rope_mscale_all_dim, cfg.rope_truncate) == (1.0, 0.5, True)
    out = hf_config(cfg)
    for key in ("n_group", "topk_group", "routed_scaling_factor", "q_lora_rank", "first_k_dense_replace"):
        assert out[key] == hf[key], key
    assert {k: out["rope_parameters"][k] for k in hf["rope_parameters"]} == hf["rope_parameters"]
    plain = config_from_hf(json.loads((ASSETS / "deepseek_v3_plain_q" / "config.json").read_text()))
    assert plain.mla.q_lora_rank is None and not plain.rope_interleave and plain.rope_scaling is None
    assert not plain.moe.normalize_top_k and plain.moe.first_dense_layers == 0


def test_hf_boundary_names_what_it_refuses():
    hf = json.loads((ASSETS / "deepseek_v3_yarn" / "config.json").read_text())
    with pytest.raises(HFConversionError, match="num_key_value_heads=2"):
        config_from_hf({**hf, "num_key_value_heads": 2})
    with pytest.raises(HFConversionError, match="topk_method='greedy'"):
        config_from_hf({**hf, "topk_method": "greedy"})
    cfg = config_from_hf(hf)
    with pytest.raises(HFConversionError, match="model.moe.scoring"):
        hf_config(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, scoring="softmax")))
    with pytest.raises(HFConversionError, match="rope_interleave"):
        hf_config(dataclasses.replace(cfg, mla=None, moe=None, rope_mscale_all_dim=None))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3_yarn", "deepseek_v3_plain_q"])
def test_latent_cache_decode_equals_the_full_forward(name):
    """The latent KV cache holds kv_lora_rank + qk_rope_head_dim values per token and layer
    (16 + 4 here; v holds none), and decoding through it with the up-projections absorbed
    gives the full forward pass's logits at every position within 1e-5 (f32; measured ~1.5e-7),
    so greedy generation equals the uncached argmax token for token. (deepseek_v3_yarn's
    generation also equals transformers' generate: tests/test_generate.py.)"""
    model = from_hf(ASSETS / name)
    tokens = jnp.asarray(np.load(ASSETS / name / "tokens.npy"))
    b, n, p = tokens.shape[0], tokens.shape[1], 6
    full = np.asarray(model(tokens))
    logits, cache = prefill(model, tokens[:, :p], jnp.full((b,), p, jnp.int32), n)
    assert cache.k.shape == (2, b, 1, n, 16 + 4) and cache.v.shape == (2, b, 1, n, 0)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, *args: decode_step(nnx.merge(graphdef, state), *args))
    steps = [logits]
    for t in range(p, n - 1):
        logits, cache = step(state, tokens[:, t], jnp.full((b,), t, jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.stack(steps, axis=1), full[:, p - 1 : n - 1], atol=DECODE_ATOL)
    out = np.asarray(generate(model, tokens[:, :p], max_new_tokens=n - p))
    # each generated token is the argmax of the full forward over what precedes it (causal: one
    # forward pass over the whole output gives them all)
    greedy = np.argmax(np.asarray(model(jnp.asarray(out))), axis=-1)
    np.testing.assert_array_equal(out[:, p:], greedy[:, p - 1 : -1])


@pytest.mark.deviceless
@needs_tpu
def test_decode_compile_reports_the_latent_cache_bytes_per_token(capsys):
    """`jaxtrain compile --mode decode` on a deviceless v5p-8 (the batch over fsdp=4): the
    cache holds layers x (kv_lora_rank + qk_rope_head_dim) values per token (2 x 48 x 4 B =
    384 B, where the expanded keys and values would take 2 x 2 x 4 heads x (48 + 32) x 4 B =
    5120 B), a quarter of it per device, as the compiled step's arguments say."""
    mla = "model.mla={kv_lora_rank: 32, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32}"
    decode = ["--target", "tpu:v5p-8", "--mode", "decode", "--batch", "64", "--max-len", "4096"]
    code, r = run_compile(
        capsys, TINY, mla, "model.n_kv_heads=4", "model.attention_impl=xla", "mesh.fsdp=-1", *decode
    )
    assert code == 0 and r["fits"] and r["kv_cache_bytes_per_token"] == 2 * (32 + 16) * 4
    assert r["kv_cache_bytes"] == 64 * 4096 * 384
    assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes_per_device_compiled"] == 64 * 4096 * 384 // 4


def test_flops_count_the_latent_attention_widths():
    """MFU's FLOPs per token: 6 x active parameters plus causal attention over the query/key
    and value widths (12 + 12 here, not d_model / heads = 16 twice)."""
    from jaxtrain.planning.flops import flops_per_token

    cfg = deepseek_config(fsdp=1).model
    attention = 6 * cfg.n_layers * 32 * cfg.n_heads * (12 + 12) / 2
    assert flops_per_token(cfg, 32) == 6 * cfg.active_param_count(include_embedding=False) + attention
