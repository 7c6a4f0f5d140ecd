"""The Qwen3.5 / Qwen3-Next hybrid layers in the model (issue 64, step 2): gated DeltaNet
(models/linear_attention.py, `model.layer_types`) and full attention with an output gate,
partial RoPE, QK-norm and (1 + w) norms, against independent oracles:

- the layer module against whole transformers 5.25 layers (tests/assets/gated_deltanet/
  hf_reference.npz: Qwen3_5GatedDeltaNet, and Qwen3NextGatedDeltaNet through the Qwen3.5
  reordering), HF's weights copied in: 5e-5 of the largest output, as test_gated_deltanet;
  the gated full attention against Qwen3NextAttention the same way (1e-5);
- a tiny hybrid (three linear layers to one full) against a plain-jnp forward written here
  from tests/reference_llama.py's pieces and the token-by-token recurrence of
  models/gated_deltanet.py (the model runs the chunked form): logits and loss, also with
  attention sinks on the full layers (GPT-OSS's extra softmax logit per head);
- a packed row against its documents run alone through the whole model;
- one sharded step (data x fsdp x tensor on 8 simulated devices) against one device, with the
  tolerances of tests/test_sharded_training.py;
- a QK-clip step against the unclipped step scaled by the full layers' maxima the plain-jnp
  forward finds (the linear layers untouched);
- the KV-cache decode of the gated, partially rotated attention against the full forward;
- decode: the DeltaNet state carried from a prefill that crosses a chunk, decode steps against
  the full forward, `jaxtrain generate` and `compile --mode decode` (the state beside the cache);
- the refusals at the config's door and in the HF export, one line each.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ConfigError
from jaxtrain.models import gated_deltanet as gdn
from jaxtrain.models import generation
from jaxtrain.models.config import LinearAttentionConfig, ModelConfig
from jaxtrain.models.layers import Attention
from jaxtrain.models.linear_attention import GatedDeltaNet, from_qwen3_5
from jaxtrain.models.transformer import Transformer
from jaxtrain.sharding import targets
from jaxtrain.trainer.batches import batch_to_device
from tests.conftest import program_on_mesh, tiny_config
from tests.reference_llama import causal_mask, rms_norm, rotate_half

ASSET = os.path.join(os.path.dirname(__file__), "assets", "gated_deltanet", "hf_reference.npz")
LAYER_TOL = 5e-5  # of the largest |output|: tests/test_gated_deltanet.py LAYER_TOL (why there)
MODEL_TOL = 1e-5  # f32 logits, chunked against token-by-token rule: of the largest |logit|
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6  # tests/test_sharded_training.py's
HYBRID = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
LINEAR = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)


def hybrid_config(**overrides) -> ModelConfig:
    """A tiny Qwen3.5-shaped model: three linear to one full layer, gated attention with a
    quarter of each head rotated, QK-norm, (1 + w) norms."""
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=64,
        layer_types=HYBRID,
        linear_attention=LINEAR,
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        qk_norm="head",
        norm_scale_offset=1.0,
        norm_eps=1e-6,
        remat="none",
    )
    return ModelConfig(**{**base, **overrides})


def close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert err <= tol, f"max error {err:.3g} of the largest |value| > {tol}"


# --- the layer against transformers -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return np.load(ASSET)


def hf_layer(hf, prefix):
    return {k[len(prefix) + 1 :]: hf[k] for k in hf.files if k.startswith(prefix + "_")}


def layer_module(weights: dict, cfg: ModelConfig) -> GatedDeltaNet:
    module = GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    for name, value in from_qwen3_5(weights, cfg).items():
        getattr(module, name)[...] = jnp.asarray(value)
    return module


def run_layer(module, x):
    graphdef, state = nnx.split(module)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, None, None))(state, jnp.asarray(x))


# the assets' layers: D 32, 2 key heads of 16, 4 value heads of 8, conv 4, eps 1e-6
ASSET_CFG = ModelConfig(
    d_model=32,
    n_heads=4,
    norm_eps=1e-6,
    linear_attention=LinearAttentionConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8
    ),
)


def test_qwen3_5_layer_equals_transformers(hf):
    p = hf_layer(hf, "q35")
    close(run_layer(layer_module(p, ASSET_CFG), p["x"]), p["out"], LAYER_TOL)


def test_qwen3_next_layer_equals_transformers(hf):
    p = hf_layer(hf, "next")
    qkv, z, b, a = gdn.qwen3_next_projections_as_qwen3_5(
        p["in_proj_qkvz.weight"], p["in_proj_ba.weight"], k_heads=2, v_heads=4, head_k_dim=16, head_v_dim=8
    )
    weights = {
        **p,
        "in_proj_qkv.weight": qkv,
        "in_proj_z.weight": z,
        "in_proj_b.weight": b,
        "in_proj_a.weight": a,
    }
    close(run_layer(layer_module(weights, ASSET_CFG), p["x"]), p["out"], LAYER_TOL)


def test_gated_attention_equals_transformers(hf):
    """Qwen3NextAttention (Qwen3.5's full layer is the same): q_proj's per-head rows are the
    query then the gate; (1 + w) QK-norm; RoPE on a quarter of each head."""
    p = hf_layer(hf, "attn")
    cfg = ModelConfig(
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        qk_norm="head",
        norm_scale_offset=1.0,
        norm_eps=1e-6,
        attention_output_gate=True,
        partial_rotary_factor=0.25,
    )
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    q_rows = p["q_proj.weight"].reshape(4, 2, 16, 32)  # [heads, query | gate, head_dim, D]
    attn.wq[...] = jnp.asarray(q_rows[:, 0].transpose(2, 0, 1))
    attn.wq_gate[...] = jnp.asarray(q_rows[:, 1].transpose(2, 0, 1))
    attn.wk[...] = jnp.asarray(p["k_proj.weight"].reshape(2, 16, 32).transpose(2, 0, 1))
    attn.wv[...] = jnp.asarray(p["v_proj.weight"].reshape(2, 16, 32).transpose(2, 0, 1))
    attn.wo[...] = jnp.asarray(p["o_proj.weight"].T.reshape(4, 16, 32))
    attn.q_norm.scale[...] = jnp.asarray(p["q_norm.weight"])
    attn.k_norm.scale[...] = jnp.asarray(p["k_norm.weight"])
    graphdef, state = nnx.split(attn)
    positions = jnp.arange(p["x"].shape[1])[None]
    out = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, positions, None))(state, jnp.asarray(p["x"]))
    close(out, p["out"], 1e-5)


# --- the whole hybrid against a plain-jnp reference ---------------------------------------------


def reference_linear(a, h, segment_ids, cfg):
    """Gated DeltaNet from its parameters' layout (models/linear_attention.py docstring) and
    the token-by-token recurrence."""
    la = cfg.linear_attention
    b, s, _ = h.shape
    hk, hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    qkv = jnp.einsum("bsd,dhc->bshc", h, a["in_proj_qkv"])
    conv_w = a["conv_weight"].reshape(-1, la.conv_kernel)
    mixed, _ = gdn.causal_conv1d(qkv.reshape(b, s, -1), conv_w, segment_ids=segment_ids)
    mixed = mixed.reshape(b, s, hk, -1)
    q, k, v = mixed[..., :dk], mixed[..., dk : 2 * dk], mixed[..., 2 * dk :].reshape(b, s, hv, dv)
    beta = jax.nn.sigmoid(jnp.einsum("bsd,dhr->bshr", h, a["in_proj_b"]).reshape(b, s, hv))
    x_a = jnp.einsum("bsd,dhr->bshr", h, a["in_proj_a"]).reshape(b, s, hv)
    g = -jnp.exp(a["A_log"].reshape(hv)) * jax.nn.softplus(x_a + a["dt_bias"].reshape(hv))
    core, _ = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids)
    z = jnp.einsum("bsd,dhc->bshc", h, a["in_proj_z"]).reshape(b, s, hv, dv)
    normed = rms_norm(core, a["norm"], cfg.norm_eps) * jax.nn.silu(z)  # plain w, no offset
    return jnp.einsum("bshc,hcd->bsd", normed.reshape(b, s, hk, -1), a["out_proj"])


def reference_gated_attention(a, h, positions, mask, cfg, maxima=None):
    """Qwen3.5's full attention as transformers writes it: (1 + w) QK-norm, NeoX RoPE on the
    first rotary_dim values of each head, softmax, output times sigmoid(gate), o_proj.
    `maxima`: a list that gets each head's largest visible q.k logit (QK-clip's statistic)."""
    rd = int(cfg.resolved_head_dim * cfg.partial_rotary_factor)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, a[w]) for w in ("wq", "wk", "wv"))
    gate = jnp.einsum("bsd,dhk->bshk", h, a["wq_gate"])
    if cfg.qk_norm == "head":
        q = rms_norm(q, 1 + a["q_norm"]["scale"], cfg.norm_eps)
        k = rms_norm(k, 1 + a["k_norm"]["scale"], cfg.norm_eps)

    def rope(x):
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, rd, 2) / rd)
        emb = np.concatenate([inv_freq, inv_freq])[None, None] * positions[..., None]
        cos, sin = jnp.cos(emb)[:, :, None], jnp.sin(emb)[:, :, None]
        rot = x[..., :rd] * cos + rotate_half(x[..., :rd]) * sin
        return jnp.concatenate([rot, x[..., rd:]], axis=-1)

    groups = cfg.n_heads // cfg.n_kv_heads
    q, k = rope(q), jnp.repeat(rope(k), groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(cfg.resolved_head_dim)
    if maxima is not None:
        maxima.append(jnp.max(jnp.where(mask[:, None], scores, -jnp.inf), axis=(0, 2, 3)))
    scores = jnp.where(mask[:, None], scores, -1e30)
    if cfg.attention_sinks:  # GPT-OSS: one more logit per head in the softmax, no value
        sink = jnp.broadcast_to(a["sinks"][None, :, None, None], (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqt,bthk->bqhk", probs, v) * jax.nn.sigmoid(gate)
    return jnp.einsum("bqhk,hkd->bqd", out, a["wo"])


def reference_forward(params, tokens, cfg, positions=None, segment_ids=None, maxima=None):
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s)) if positions is None else positions
    segment_ids = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids
    mask = causal_mask(segment_ids)
    norm = lambda x, p: rms_norm(x, 1 + p["scale"], cfg.norm_eps)  # noqa: E731
    x = params["embedding"][tokens]
    for layer in range(cfg.n_layers):
        kind = cfg.layer_types[layer % len(cfg.layer_types)]
        group = layer // len(cfg.layer_types)
        p = jax.tree.map(lambda w: w[group], params["blocks"][f"layer_{layer % len(cfg.layer_types)}"])
        h = norm(x, p["attn_norm"])
        if kind == "linear_attention":
            x = x + reference_linear(p["attn"], h, segment_ids, cfg)
        else:
            x = x + reference_gated_attention(p["attn"], h, positions, mask, cfg, maxima)
        h = norm(x, p["mlp_norm"])
        m = p["mlp"]
        x = x + (jax.nn.silu(h @ m["w_gate"]) * (h @ m["w_up"])) @ m["w_down"]
    return norm(x, params["final_norm"]) @ params["lm_head"]


def random_model(cfg, seed=0):
    """The model with every norm scale (and sink logit) moved off its init, so that (1 + w)
    is exercised."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    key = iter(jax.random.split(jax.random.key(seed + 1), 64))
    for path, var in nnx.to_flat_state(params):
        if path[-1] in ("scale", "norm", "sinks"):
            var[...] = var[...] + 0.1 * jax.random.normal(next(key), var.shape)
    nnx.update(model, params)
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def cross_entropy(logits, targets):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


@pytest.mark.parametrize(
    "sinks",
    [
        pytest.param(False, id="plain", marks=pytest.mark.composes(
            "lm+linear_attention", "dense+linear_attention", "qk_norm+linear_attention"
        )),
        pytest.param(True, id="sinks", marks=pytest.mark.composes("sinks+linear_attention")),
    ],
)  # fmt: skip
def test_hybrid_matches_plain_jnp_reference(sinks):
    cfg = hybrid_config(attention_sinks=sinks)
    model, params = random_model(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, 80), 0, cfg.vocab_size)  # past one 64-chunk
    logits = jax.jit(lambda t: model(t))(tokens)
    expected = jax.jit(reference_forward, static_argnums=2)(params, tokens, cfg)
    close(logits, expected, MODEL_TOL)
    targets = jnp.roll(tokens, -1, axis=1)
    np.testing.assert_allclose(cross_entropy(logits, targets), cross_entropy(expected, targets), rtol=1e-6)
    assert set(params["blocks"]["layer_0"]["attn"]) == {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv_weight", "A_log", "dt_bias", "norm",
        "out_proj",
    }  # fmt: skip
    assert "wq_gate" in params["blocks"]["layer_3"]["attn"]
    assert cfg.param_count() == sum(x.size for x in jax.tree.leaves(params))


def test_packed_row_equals_its_documents_alone():
    cfg = hybrid_config()
    model, _ = random_model(cfg, seed=1)
    run = jax.jit(lambda t, p, s: model(t, positions=p, segment_ids=s))
    lengths = (45, 70, 15)  # the second crosses the chunk boundary at 64
    tokens = jax.random.randint(jax.random.key(4), (1, sum(lengths)), 0, cfg.vocab_size)
    segment_ids = jnp.concatenate([jnp.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    positions = jnp.concatenate([jnp.arange(n) for n in lengths])[None]
    packed = run(tokens, positions, segment_ids)
    start, total = 0, sum(lengths)
    for n in lengths:
        # the document first in a row of the packed row's shape (one compile), a second document
        # after it: causal, so its positions see nothing of it
        alone = jnp.roll(tokens, -start, axis=1)
        alone_ids = (jnp.arange(total) >= n).astype(jnp.int32)[None] + 1
        alone_positions = jnp.where(jnp.arange(total) < n, jnp.arange(total), jnp.arange(total) - n)[None]
        out = run(alone, alone_positions, alone_ids)
        close(packed[:, start : start + n], out[:, :n], MODEL_TOL)
        start += n


def test_defaults_build_no_new_parameters():
    """Nothing changes for a config without the new keys: the attention has no gate and
    rotates every value, no layer is linear."""
    cfg = ModelConfig()
    assert (cfg.layer_types, cfg.attention_output_gate, cfg.partial_rotary_factor) == ((), False, 1.0)
    assert cfg.scan_pattern == () and cfg.rotary_dim == cfg.resolved_head_dim
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model.blocks.attn, "wq_gate")


# --- training: one step, and sharded equals one device ------------------------------------------

_TRAIN = (
    "model.vocab_size=64",
    "model.d_model=32",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=16",
    "model.mlp_dim=64",
    f"model.layer_types=[{', '.join(HYBRID)}]",
    "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 8}",
    "model.attention_output_gate=true",
    "model.partial_rotary_factor=0.25",
    "model.qk_norm=head",
    "model.norm_scale_offset=1.0",
    "train.seq_len=80",
    "train.global_batch_size=4",
)


def loss_and_grads(*overrides, step=False):
    """(loss, grads, with `step` the loss program.step reports for the same batch, the grads'
    PartitionSpecs)."""
    cfg = tiny_config(None, *_TRAIN, *overrides)
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        step_loss = float(program.step(state, batch)[1]["loss"]) if step else None
        specs = jax.tree.map(lambda g: g.sharding.spec, grads)
        return float(loss), jax.device_get(grads), step_loss, specs


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(step=True)


def test_hybrid_trains_a_step(one_device):
    loss, grads, step_loss, _ = one_device
    assert np.isfinite(loss) and np.isclose(step_loss, loss, rtol=1e-6)
    assert np.isclose(loss, np.log(64), rtol=0.1)  # a fresh model: about uniform over the vocab
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    linear = grads["blocks"]["layer_0"]["attn"]
    assert all(np.any(linear[k] != 0) for k in ("in_proj_qkv", "conv_weight", "A_log", "dt_bias", "norm"))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.composes("data+linear_attention", "fsdp+linear_attention", "tensor+linear_attention")
def test_sharded_step_equals_one_device(one_device):
    ref_loss, ref_grads, _, _ = one_device
    loss, grads, _, specs = loss_and_grads("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    # the linear layers' parameters really are split: key-head groups over tensor, embed over fsdp
    linear = specs["blocks"]["layer_0"]["attn"]
    assert linear["in_proj_qkv"] == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert linear["out_proj"] == jax.sharding.PartitionSpec(None, "tensor", None, "fsdp")
    assert linear["A_log"] == jax.sharding.PartitionSpec(None, "tensor")
    assert specs["blocks"]["layer_3"]["attn"]["wq_gate"] == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )


# --- the Pallas gated delta rule (model.linear_attention.impl=pallas) against XLA's ---------------

KERNEL_RTOL, KERNEL_ATOL = 1e-5, 1e-6  # f32: the kernels and the jnp chunked rule, same mesh
_DATA_TENSOR = ("mesh.data=2", "mesh.tensor=2")


def _assert_same(loss, grads, ref_loss, ref_grads):
    np.testing.assert_allclose(loss, ref_loss, rtol=KERNEL_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=KERNEL_RTOL, atol=KERNEL_ATOL), grads, ref_grads
    )


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_pallas_rule_trains_as_xla():
    """The train program's loss and gradients with the Pallas kernels (interpreted on CPU, per
    shard of batch and key-head groups on data x tensor) equal the jnp chunked rule's on the
    same mesh. On a mesh only: one device is the kernel alone, which
    tests/test_gated_delta_kernel.py checks against both jnp references."""
    ref_loss, ref_grads, _, _ = loss_and_grads("model.linear_attention.impl=xla", *_DATA_TENSOR)
    loss, grads, _, _ = loss_and_grads("model.linear_attention.impl=pallas", *_DATA_TENSOR)
    _assert_same(loss, grads, ref_loss, ref_grads)


def _packed_loss_and_grads(impl, mesh_sizes):
    """A hybrid's loss and gradients on two rows packing documents (one crosses the 64-token
    chunk), the model built and run on a mesh of `mesh_sizes` under the fsdp_tensor rules."""
    import dataclasses
    import math

    from jaxtrain import sharding

    cfg = hybrid_config(linear_attention=dataclasses.replace(LINEAR, impl=impl))
    mesh = sharding.make_mesh(mesh_sizes, jax.devices()[: math.prod(mesh_sizes.values())])
    lengths = ((45, 70, 13), (20, 108))
    segment_ids = jnp.asarray([np.repeat(np.arange(len(r)) + 1, r) for r in lengths])
    positions = jnp.asarray([np.concatenate([np.arange(n) for n in r]) for r in lengths])
    tokens = jax.random.randint(jax.random.key(7), (2, 128), 0, cfg.vocab_size)
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.PRESETS["fsdp_tensor"]):
        model, _ = random_model(cfg, seed=2)
        graphdef, params = nnx.split(model, nnx.Param)
        rest = nnx.state(model, nnx.Not(nnx.Param))

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens, positions=positions, segment_ids=segment_ids)
            return cross_entropy(logits, jnp.roll(tokens, -1, axis=1))

        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        return float(value), jax.device_get(nnx.to_pure_dict(grads))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_pallas_rule_on_packed_rows_equals_xla():
    """Packed documents (the state resets at each boundary, inside a chunk and across one), on
    data x tensor: the Pallas kernels' loss and gradients equal the jnp chunked rule's."""
    sizes = {"data": 2, "tensor": 2}
    _assert_same(*_packed_loss_and_grads("pallas", sizes), *_packed_loss_and_grads("xla", sizes))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_sharded_kernel_takes_a_state_and_keeps_key_head_groups_whole():
    """`sharded_gated_delta_rule` on data x tensor with an initial state and packed rows equals
    the jnp rule (output and final state); key heads that do not split over the head axes as
    the value heads do are refused in one line."""
    from jaxtrain import sharding
    from jaxtrain.pallas_kernels.gated_delta import sharded_gated_delta_rule

    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    keys = iter(jax.random.split(jax.random.key(9), 8))
    b, s, hk, hv, d = 2, 40, 2, 4, 8
    q, k = (jax.random.normal(next(keys), (b, s, hk, d)) for _ in range(2))
    v = jax.random.normal(next(keys), (b, s, hv, d))
    g = -jax.nn.softplus(jax.random.normal(next(keys), (b, s, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(next(keys), (b, s, hv)))
    state = jax.random.normal(next(keys), (b, hv, d, d))
    segment_ids = jnp.asarray([[1] * 25 + [2] * 15, [1] * s])
    run = jax.jit(
        lambda *xs: sharded_gated_delta_rule(
            *xs, mesh=mesh, batch_axes="data", head_axes="tensor", chunk_size=16
        )
    )
    out, final = run(q, k, v, g, beta, state, segment_ids)
    ref_out, ref_final = gdn.chunked_gated_delta_rule(q, k, v, g, beta, state, segment_ids, chunk_size=16)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, ref_final, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="key heads 1 and value heads 4 must both divide") as e:
        sharded_gated_delta_rule(
            q[:, :, :1], k[:, :, :1], v, g, beta, mesh=mesh, batch_axes="data", head_axes="tensor"
        )
    assert "\n" not in str(e.value)


def test_linear_attention_impl_auto_resolves_to_xla_and_a_bad_one_is_refused():
    """`auto` resolves to xla on every platform for now (the kernel has not run or been timed
    on a TPU or GPU), logged with why; a model without linear layers logs nothing; an unknown
    value is refused naming the key."""
    from jaxtrain.planning.resolve import Placement, check_resolved, resolve

    cfg = tiny_config(None, *_TRAIN)
    assert cfg.model.linear_attention.impl == "auto"
    for platform, chip in (("cpu", None), ("gpu", "h100"), ("tpu", "v5p")):
        r = resolve(cfg, Placement(platform, {"data": 1}, chip=chip))
        assert r.config.model.linear_attention.impl == "xla"
        check_resolved(r.config)
        (note,) = [n for n in r.notes if n.startswith("model.linear_attention.impl=auto -> xla: ")]
        assert "not yet run or timed" in note
    chosen = resolve(tiny_config(None, *_TRAIN, "model.linear_attention.impl=pallas"), Placement("cpu", {}))
    assert chosen.config.model.linear_attention.impl == "pallas"
    assert not any(n.startswith("model.linear_attention.impl") for n in chosen.notes)
    with pytest.raises(ConfigError) as e:
        tiny_config(None, *_TRAIN, "model.linear_attention.impl=triton")
    assert "model.linear_attention.impl='triton': expected one of ('auto', 'xla', 'pallas')" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.composes("linear_attention+qk_clip")
def test_qk_clip_scales_the_full_layers_heads_over_tau():
    """QK-clip on the hybrid (optimizer.qk_clip.tau): the step records each full layer's
    per-head maxima as the plain-jnp forward finds them (through the linear layers before
    them), and is the unclipped step with each full layer's query weights scaled by
    tau / maximum where over tau (grouped heads: keys untouched); the linear layers, the gate
    and everything else as the unclipped step left them."""
    from tests.test_qk_clip import one_step, tau_between_heads

    hybrid = (
        "model.n_layers=4",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.layer_types=[linear_attention, full_attention]",
        "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 8}",
        "model.attention_output_gate=true",
        "model.partial_rotary_factor=0.5",
        "model.norm_scale_offset=1.0",
    )
    cfg, initial, batch, plain, _ = one_step(*hybrid)

    def full_layer_maxima(params, tokens):  # one program, not an eager op per line
        maxima = []
        reference_forward(params, tokens, cfg.model, maxima=maxima)
        return jnp.stack(maxima)

    logits = np.asarray(
        jax.jit(full_layer_maxima)(initial, jnp.asarray(batch["inputs"]))
    )  # [layers 1, 3; heads]
    tau = tau_between_heads(logits)
    assert (logits > tau).any() and (logits < tau).any()
    _, _, _, clipped, metrics = one_step(*hybrid, f"optimizer.qk_clip.tau={tau}")
    np.testing.assert_allclose(metrics["attention/max_logit"], logits.max(), rtol=1e-5)
    g = np.where(logits > tau, tau / logits, 1.0)
    full_plain, full_clipped = plain["blocks"]["layer_1"]["attn"], clipped["blocks"]["layer_1"]["attn"]
    np.testing.assert_allclose(full_clipped["wq"], full_plain["wq"] * g[:, None, :, None], rtol=2e-5)
    rest = lambda p: [  # noqa: E731
        (jax.tree_util.keystr(path), v)
        for path, v in jax.tree_util.tree_flatten_with_path(p)[0]
        if "layer_1']['attn']['wq']" not in jax.tree_util.keystr(path)
    ]
    assert len(rest(clipped)) == len(jax.tree.leaves(clipped)) - 1
    for (path, a), (_, b) in zip(rest(clipped), rest(plain), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.layer_types=[linear_attention, dense]",), "expected kinds from"),
        (("model.layer_types=[linear_attention, linear_attention, full_attention]",), "divides it"),
        (("model.linear_attention=null",), "expected model.linear_attention"),
        (("model.layer_types=[]",), "model.linear_attention is set but model.layer_types is empty"),
        (("model.linear_attention.num_value_heads=3",), "num_value_heads=3: expected a multiple"),
        (("model.partial_rotary_factor=0.1",), "expected an even number"),
        (("model.partial_rotary_factor=0",), "expected a number in (0, 1]"),
        (("mesh.stage=2",), "mesh.stage=2 with linear_attention layers"),
        (("mesh.context=2",), "mesh.context=2 with linear_attention layers"),
        (("model.moe={num_experts: 4, top_k: 2, every: 2}",), "model.moe.every=2 with model.layer_types"),
        (("model.moe={num_experts: 4, shared_expert_gate: true}",), "num_shared_experts=0: expected shared"),
        (("model.fp8=true",), "model.fp8"),
        (("model.mtp={depth: 1}",), "model.mtp="),
        (("model.attention_pattern=[local, global]", "model.sliding_window=8"), "attention_pattern"),
        (("mesh.tensor=4", "model.n_heads=4", "model.n_kv_heads=4"), "num_key_heads=2: expected a multiple"),
    ],
)
def test_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        tiny_config(None, *_TRAIN, *overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_decode_carries_the_deltanet_state_across_chunks():
    """Right-padded prompts of 70 (past a 64-token chunk of the rule), 5 and 66 tokens through
    two hybrid groups: prefill's last logits and three decode steps' equal the full forward's
    at those positions (the padding leaves the state as the prompt's end left it; the conv
    window is the prompt's last inputs)."""
    cfg = hybrid_config(n_layers=8)
    model, _ = random_model(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(6), (3, 75), 0, cfg.vocab_size)
    full = np.asarray(jax.jit(lambda t: model(t))(tokens))
    lengths = np.array([70, 5, 66])
    rows = np.arange(3)
    logits, cache = nnx.jit(generation.prefill, static_argnums=3)(
        model, tokens[:, :70], jnp.asarray(lengths), 80
    )
    assert cache.k.shape[0] == 2 and cache.state.shape == (6, 3, 4, 8, 8)  # 2 full, 6 DeltaNet
    close(logits, full[rows, lengths - 1], MODEL_TOL)
    step = nnx.jit(generation.decode_step)
    for t in range(3):
        logits, cache = step(model, tokens[rows, lengths + t], jnp.asarray(lengths + t), cache)
        close(logits, full[rows, lengths + t], MODEL_TOL)


@pytest.mark.deviceless
@pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")
def test_decode_compiles_for_h100_with_the_state_beside_the_cache(capsys):
    """`compile --mode decode` on fsdp=4 x tensor=2: the KV cache holds the full layers only (1
    of 4), the DeltaNet layers' conv windows and states are a fixed size per row, both split as
    the cache and donated to the decode step."""
    from jaxtrain import cli

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    args = [tiny, *_TRAIN, "mesh.fsdp=4", "mesh.tensor=2", "--target", "gpu:h100", "--mode", "decode"]
    assert cli.main(["compile", *args, "--batch", "8", "--max-len", "512", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    kv = 2 * 1 * 8 * 2 * 512 * 16 * 4  # k and v, 1 full layer, 8 rows, 2 kv heads, 512, head_dim 16
    conv, state = 3 * 8 * 3 * 2 * (2 * 8 + 2 * 8) * 4, 3 * 8 * 4 * 8 * 8 * 4  # 3 DeltaNet layers
    assert (r["kv_cache_bytes"], r["linear_state_bytes"]) == (kv, conv + state)
    # rows over fsdp, key-head groups over tensor, as the cache's kv heads
    assert r["linear_state_bytes_per_device"] == (conv + state) // 8
    assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes_per_device_compiled"] == kv // 8
    assert r["fits"] and r["decode"]["memory"]["alias"] >= (kv + conv + state) // 8


@pytest.mark.deviceless
@pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
def test_train_step_compiles_for_tpu_without_a_negative_estimate(capsys):
    """The train step (the chunked rule in XLA, Pallas flash attention on the full layer)
    compiles for a TPU v5p slice and fits; XLA's cost analysis gives its layer variants a
    negative time, which the report leaves out with a note instead of printing."""
    from jaxtrain import cli

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    args = [tiny, *_TRAIN, "train.seq_len=64", "mesh.fsdp=-1", "--target", "tpu:v5p-8", "--json"]
    assert cli.main(["compile", *args]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] and r.get("step_seconds_xla") is None
    assert any("no XLA step-time estimate" in n for n in r["notes"])


def test_the_cli_generates_from_a_hybrid(capsys):
    """`jaxtrain generate --random-init` on the hybrid: text comes out on one device and on
    data x tensor, the same tokens."""
    from jaxtrain import cli

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    train = [o for o in _TRAIN if not o.startswith("model.vocab_size")]  # the byte tokenizer's 257
    args = [
        tiny,
        *train,
        "logging.progress=false",
        "--random-init",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
    ]
    outs = []
    for mesh in ([], ["mesh.tensor=2", "mesh.data=2"]):
        assert cli.main(["generate", *args, *mesh]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ({}, None),
        (dict(attention_output_gate=False), "model.attention_output_gate=False"),
        (dict(norm_scale_offset=0.0), "model.norm_scale_offset=0.0"),
        (dict(qk_norm="none"), "model.qk_norm='none'"),
    ],
)
def test_hugging_face_export_is_qwen3_5_or_names_the_key(overrides, refused):
    """These layers export as Qwen3_5ForCausalLM (its logits and tensors against transformers:
    tests/test_hf.py, tests/test_hf_qwen3_5.py); a hybrid the class does not compute is refused."""
    from jaxtrain.models import hf

    if refused is None:
        assert hf.hf_config(hybrid_config())["architectures"] == ["Qwen3_5ForCausalLM"]
        return
    with pytest.raises(hf.HFConversionError, match=re.escape(refused)):
        hf.hf_config(hybrid_config(**overrides))


def test_cached_decode_of_gated_partial_rope_attention_equals_full_forward():
    """The KV-cache path applies the output gate and partial RoPE as the training forward does:
    prefill's last logits and one decode step's equal the full forward's at those tokens."""
    cfg = hybrid_config(n_layers=2, layer_types=(), linear_attention=None)
    model, _ = random_model(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size)
    full = model(tokens)
    logits, cache = generation.prefill(model, tokens[:, :8], jnp.array([8, 8]), 16)
    close(logits, full[:, 7], MODEL_TOL)
    logits, _ = generation.decode_step(model, tokens[:, 8], jnp.array([8, 8]), cache)
    close(logits, full[:, 8], MODEL_TOL)


def test_partial_rotary_and_gate_alone_match_the_reference():
    """The attention options on a plain (all full attention) model: the reference's full layer."""
    cfg = hybrid_config(n_layers=2, layer_types=("full_attention",), linear_attention=None)
    model, params = random_model(cfg, seed=2)
    tokens = jax.random.randint(jax.random.key(5), (2, 24), 0, cfg.vocab_size)
    stacked = {**params, "blocks": {"layer_0": params["blocks"]}}
    expected = jax.jit(reference_forward, static_argnums=2)(stacked, tokens, cfg)
    close(jax.jit(lambda t: model(t))(tokens), expected, MODEL_TOL)
