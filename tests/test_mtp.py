"""Multi-token prediction (model.mtp; models/mtp.py, jaxtrain/trainer/mtp.py) against a plain-jnp
reference written here from the parameters (DeepSeek-V3 report section 2.2, the embedding
first in eh_proj's input as DeepSeek's checkpoints), one device against a sharded mesh, the
training loop's metrics, and generation, which must not depend on the prediction modules."""

import dataclasses
import functools
import json
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import mtp
from jaxtrain.models.hf import config_from_hf, from_hf, to_hf
from jaxtrain.planning.flops import flops_per_token
from jaxtrain.trainer import train
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.mtp import mtp_loss
from tests import reference_llama as reference
from tests.conftest import REPO, program_on_mesh, replace, tiny_config
from tests.reference_llama import rms_norm

CFG = models.ModelConfig(
    vocab_size=61,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    mlp_dim=48,
    rope_theta=500.0,
    remat="none",
    mtp=models.MTPConfig(depth=2, loss_weight=0.3),
)
LOSS_RTOL = 1e-5  # f32 losses: the same maths as the reference in another op order
GRAD_RTOL, GRAD_ATOL = 2e-4, 1e-6  # f32 gradients (as tests/test_sharded_training.py)


def assert_grads_close(grads, expected):
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    jax.tree.map(close, grads, expected)


# --- the reference, from the parameters alone -----------------------------------------------


def mean_ce(h, head, targets, mask):
    logp = jax.nn.log_softmax(h @ head, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / max(float(np.sum(mask)), 1.0)


def ref_losses(params, batch, cfg, segmented=True):
    """(main mean CE, [module k's mean CE, k = 1..depth]). Module k at position t: input
    token t + k, target token t + k + 1, counted when the main loss counts target t + k and
    t + k is in t's document (written per position, not with models/mtp.py's shifts)."""
    inputs, targets, loss_mask = (np.asarray(batch[k]) for k in ("inputs", "targets", "loss_mask"))
    seg, positions = np.asarray(batch["segment_ids"]), batch["positions"]
    b, s = inputs.shape
    same = seg[:, :, None] == seg[:, None, :] if segmented else np.ones((b, s, s), bool)
    mask = np.tril(np.ones((s, s), bool))[None] & same
    x = params["embedding"][inputs]
    for kind, p in reference.layers(params, cfg):
        x = reference.block(p, x, positions, mask, cfg, kind)
    head = params["lm_head"]
    pattern = cfg.attention_pattern  # a module's block: the kind of the layer after the last
    module_kind = pattern[cfg.n_layers % len(pattern)] if pattern else None
    main = mean_ce(rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps), head, targets, loss_mask)
    row = np.concatenate([inputs, targets[:, -1:]], axis=1)  # the row's tokens 0 .. s
    h, ahead = x, []
    for k in range(1, cfg.mtp.depth + 1):
        p = jax.tree.map(lambda a, k=k: a[k - 1], params["mtp"])
        tok_k, tgt_k, m_k = (np.zeros((b, s), np.int32) for _ in range(3))
        m_k = m_k.astype(np.float32)
        for r in range(b):
            for t in range(s):
                tok_k[r, t] = row[r, min(t + k, s)]
                if t + k < s:
                    tgt_k[r, t] = targets[r, t + k]
                    m_k[r, t] = loss_mask[r, t + k] * (seg[r, t] == seg[r, t + k])
        e = rms_norm(params["embedding"][tok_k], p["enorm"]["scale"], cfg.norm_eps)
        hn = rms_norm(h, p["hnorm"]["scale"], cfg.norm_eps)
        x_k = jnp.concatenate([e, hn], axis=-1) @ p["eh_proj"]
        h = reference.block(p["block"], x_k, positions, mask, cfg, module_kind)
        ahead.append(mean_ce(rms_norm(h, p["head_norm"]["scale"], cfg.norm_eps), head, tgt_k, m_k))
    return main, ahead


def packed_batch(b=2, s=16, vocab=61, seed=3):
    """Row 0: two documents and padding (positions restart, the loss stops at each document's
    end); row 1: one document with its first targets masked out (a prompt)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, s + 1)).astype(np.int32)
    seg = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * s], np.int32)[:b]
    positions = np.array([list(range(6)) + list(range(7)) + [0] * 3, list(range(s))], np.int32)[:b]
    loss_mask = np.array([[1] * 5 + [0] + [1] * 6 + [0] * 4, [0] * 4 + [1] * (s - 5) + [0]], np.float32)[:b]
    fields = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=seg, positions=positions)
    return dict(fields, loss_mask=loss_mask)


# --- the modules and their loss -------------------------------------------------------------


def test_lookahead_by_hand():
    inputs = jnp.array([[10, 11, 12, 13, 14]])
    targets = jnp.array([[11, 12, 13, 14, 15]])
    seg = jnp.array([[1, 1, 1, 2, 2]])
    loss_mask = jnp.array([[1.0, 1.0, 0.0, 1.0, 0.0]])  # target 2 crosses into document 2; 4 is past it
    np.testing.assert_array_equal(
        mtp.lookahead_tokens(inputs, targets, 2)[:, 0], [[11, 12, 13, 14, 15], [12, 13, 14, 15, 0]]
    )
    np.testing.assert_array_equal(
        mtp.lookahead_targets(targets, 2)[:, 0], [[12, 13, 14, 15, 0], [13, 14, 15, 0, 0]]
    )
    # k=1 at t: target t+1 counted and t+1 in t's document; k=2 likewise with t+2
    np.testing.assert_array_equal(
        mtp.lookahead_mask(loss_mask, seg, 2)[:, 0], [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    )


@functools.cache
def value_and_grads(cfg, chunk=0):
    """The modules' loss (trainer/mtp.py `mtp_loss`) on `packed_batch` and its gradients with
    respect to every parameter, jitted, for the model `cfg` at seed 0."""
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    graphdef, params = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params):
        model, seg = nnx.merge(graphdef, params), batch["segment_ids"]
        residual, _ = model.hidden(
            batch["inputs"], positions=batch["positions"], segment_ids=seg, normed=False
        )
        value, stats = mtp_loss(model, residual, batch, segment_ids=seg, chunk=chunk)
        assert stats is None  # a dense model's blocks are dense
        return value

    value, grads = jax.device_get(jax.jit(jax.value_and_grad(loss))(params))
    return value, nnx.to_pure_dict(grads), nnx.to_pure_dict(params)


# the layer features a module's block takes from the main layers (GPT-OSS's sinks, Qwen3's
# query/key norms, a local/global pattern: the module's block is the next layer's kind, local)
LAYER_FEATURES = dataclasses.replace(
    CFG, attention_sinks=True, qk_norm="head", attention_pattern=("local", "global"), sliding_window=5
)


# DeepSeek-V3's modules: latent attention in the main layers and in each module's block
LATENT = dataclasses.replace(
    CFG,
    n_kv_heads=4,
    mla=models.MLAConfig(
        q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5
    ),
)


@functools.cache
def reference_value_and_grads(cfg=CFG):
    batch = packed_batch()
    _, _, params = value_and_grads(cfg)
    mean_ahead = lambda p: jnp.mean(jnp.stack(ref_losses(p, batch, cfg)[1]))
    return jax.device_get(jax.jit(jax.value_and_grad(mean_ahead))(params))


@pytest.mark.parametrize(
    "chunk,cfg",
    [
        pytest.param(0, CFG, id="plain"),
        pytest.param(4, CFG, id="chunked", marks=pytest.mark.composes("mtp+chunked_loss")),
        pytest.param(
            0,
            LAYER_FEATURES,
            id="sinks-qknorm-pattern",
            marks=pytest.mark.composes("mtp+sinks", "mtp+qk_norm", "mtp+attention_pattern"),
        ),
        pytest.param(0, LATENT, id="mla", marks=pytest.mark.composes("mla+mtp")),
    ],
)
def test_loss_and_gradients_match_the_reference(chunk, cfg):
    value, grads, _ = value_and_grads(cfg, chunk)
    ref_value, ref_grads = reference_value_and_grads(cfg)
    np.testing.assert_allclose(value, ref_value, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert np.abs(grads["mtp"]["eh_proj"]).max() > 0
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads["mtp"]["block"]["attn"]))  # sinks, norms


@pytest.mark.composes("mtp+remat")
def test_remat_and_unrolled_modules_change_nothing():
    """The modules under remat full and unrolled (model.scan_layers false) give the loss and
    gradients of remat none, scanned: the policy only changes what the backward recomputes."""
    ref_value, ref_grads, _ = value_and_grads(CFG)
    value, grads, _ = value_and_grads(dataclasses.replace(CFG, remat="full", scan_layers=False))
    np.testing.assert_allclose(value, ref_value, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


def test_param_count_and_axes():
    for cfg in (CFG, dataclasses.replace(CFG, moe=models.MoEConfig(num_experts=4, top_k=2, score_bias=True))):
        params = nnx.state(models.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        assert sum(x.size for x in jax.tree.leaves(params)) == cfg.param_count()
        assert cfg.mtp_param_count() == sum(x.size for x in jax.tree.leaves(params["mtp"]))
    axes = models.logical_axes(nnx.state(models.Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param))
    assert axes["mtp"]["eh_proj"] == ("mtp_depth", "mtp_concat", "embed")
    assert axes["mtp"]["block"]["attn"]["wq"] == ("mtp_depth", "embed", "heads", "head_dim")


def test_flops_count_the_modules():
    """Per module: its parameters, the shared head once more, one more layer of attention."""
    plain = dataclasses.replace(CFG, mtp=None)
    d, v, s, depth = CFG.d_model, CFG.vocab_size, 16, CFG.mtp.depth
    attn_layer = 12 * s * CFG.n_heads * CFG.resolved_head_dim / 2
    extra = 6 * (CFG.mtp_param_count() + depth * d * v) + depth * attn_layer
    assert flops_per_token(CFG, s) == flops_per_token(plain, s) + extra


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.mtp.depth=0", "model.mtp.depth"),
        ("model.mtp.loss_weight=-0.1", "model.mtp.loss_weight"),
        ("model.fp8=true", "model.fp8"),
        ("mesh.context=2", "mesh.context"),
        ("mesh.stage=2", "mesh.stage"),
    ],
)
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(None, "model.mtp.depth=1", override)


# --- the step: objective, gradients, meshes ---------------------------------------------------


def step_cfg(*overrides, **mesh):
    cfg = tiny_config(
        None,
        "model.d_model=32",
        "model.mlp_dim=48",
        "model.vocab_size=61",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.rope_theta=500.0",
        "train.seq_len=16",
        "train.global_batch_size=4",
        "model.mtp.depth=2",
        "model.mtp.loss_weight=0.3",
        *overrides,
    )
    return replace(cfg, mesh=dict(dict(data=1, fsdp=1, tensor=1), **mesh))


def step_batch():
    """Synthetic-style rows (one document each: the step gives synthetic data's model no
    segment ids) with some targets masked out."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 61, (4, 17)).astype(np.int32)
    loss_mask = np.ones((4, 16), np.float32)
    loss_mask[0, :3] = loss_mask[1, 10:] = loss_mask[2, 7] = 0
    return dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        segment_ids=np.ones((4, 16), np.int32),
        positions=np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)).copy(),
        loss_mask=loss_mask,
    )


def step_loss_and_grads(cfg):
    with program_on_mesh(cfg) as (program, state, _):
        batch = batch_to_device(step_batch(), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        return float(loss), jax.device_get(state.params), jax.device_get(grads)


@pytest.fixture(scope="module")
def one_device():
    return step_loss_and_grads(step_cfg())


@pytest.mark.composes("lm+mtp", "dense+mtp")
def test_step_objective_matches_the_reference(one_device):
    """The step differentiates main CE + loss_weight x mean over depths of the modules' CE, and
    reports the main CE as `loss`."""
    loss, params, grads = one_device
    cfg = step_cfg().model
    batch = step_batch()

    def objective(p):
        main, ahead = ref_losses(p, batch, cfg, segmented=False)
        return main + cfg.mtp.loss_weight * jnp.mean(jnp.stack(ahead)), main

    (_, main), ref_grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    np.testing.assert_allclose(loss, float(main), rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert np.abs(grads["mtp"]["eh_proj"]).max() > 0


MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.expert_mlp_dim=32",
    "model.moe.score_bias=true",
)
SHARDED = {
    "fsdp2,tensor2": pytest.param((), dict(fsdp=2, tensor=2), marks=pytest.mark.composes("mtp+tensor")),
    # the chunked loss's vocab-parallel form (trainer/loss.py) on the modules' hidden states
    "vocab-parallel-chunked": (("mesh.head_sharding=vocab", "train.loss_chunk=4"), dict(fsdp=4)),
    # MoE prediction blocks under expert parallelism (a second model to compile: 2 x 20 s)
    "moe-expert2,fsdp2,tensor2": pytest.param(
        (*MOE, "mesh.expert=2"),
        dict(fsdp=2, tensor=2),
        marks=[pytest.mark.slow, pytest.mark.composes("mtp+tensor", "mtp+expert")],
    ),
}


@pytest.mark.composes("mtp+fsdp")
@pytest.mark.parametrize("overrides,mesh", SHARDED.values(), ids=SHARDED.keys())
def test_sharded_step_matches_one_device(one_device, overrides, mesh):
    """Simulated devices against one device: same loss and gradients (f32, summation order)."""
    if any(o.startswith("model.moe") for o in overrides):
        ref_loss, _, ref_grads = step_loss_and_grads(step_cfg(*MOE))
    else:
        ref_loss, _, ref_grads = one_device
    loss, _, grads = step_loss_and_grads(step_cfg(*overrides, **mesh))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


# --- training and generation ------------------------------------------------------------------


@pytest.mark.slow  # a 30 s compile on 2 shared cores
def test_moe_model_trains_and_logs_mtp_loss(tmp_path):
    """tiny-moe with a prediction module: `mtp_loss` in every metrics record, falling; the
    module's router bias moves by its own load as the main layers' do."""
    cfg = load_config(
        os.path.join(REPO, "configs", "tiny-moe.yaml"),
        [
            "logging.progress=false",
            "logging.tensorboard=false",
            f"output_dir={tmp_path}",
            "train.steps=12",
            "train.seq_len=32",
            "model.d_model=64",
            "model.moe.score_bias=true",
            "model.mtp.depth=1",
        ],
    )
    result = train(cfg, devices=jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ahead = [r["mtp_loss"] for r in records if "loss" in r]
    assert len(ahead) == 12 and all(math.isfinite(v) for v in ahead)
    assert ahead[-1] < ahead[0] - 0.1, ahead  # measured: 6.24 -> 6.07
    for stack in (result.state.params["moe_blocks"], result.state.params["mtp"]["block"]):
        assert np.abs(jax.device_get(stack["mlp"]["router_bias"])).max() > 0


def test_generation_ignores_the_prediction_modules():
    """Logits and greedy generation of a model with MTP equal those of the same weights
    without it (its prediction modules are not read)."""
    model = models.Transformer(CFG, rngs=nnx.Rngs(0))
    plain = models.Transformer(dataclasses.replace(CFG, mtp=None), rngs=nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(plain, {k: v for k, v in params.items() if k != "mtp"})
    prompt = jnp.asarray(packed_batch()["inputs"][:, :6])
    np.testing.assert_array_equal(model(prompt), plain(prompt))
    out = models.generate(model, prompt, max_new_tokens=5)
    np.testing.assert_array_equal(out, models.generate(plain, prompt, max_new_tokens=5))


# --- DeepSeek-V3 directories -----------------------------------------------------------------

DEEPSEEK = Path(__file__).parent / "assets" / "hf" / "deepseek_v3_yarn"  # a dense first layer, q_lora


def test_deepseek_modules_are_written_and_read_at_layer_num_hidden_layers(tmp_path):
    """A DeepSeek-V3 model with 2 modules: `to_hf` writes them as layers n_layers and n_layers
    + 1 under DeepSeek's names (eh_proj as torch's Linear(2 d, d), the embedding's half first,
    and copies of the embedding and head), config.json says num_nextn_predict_layers 2, and
    `from_hf` reads every tensor back exactly."""
    from safetensors import safe_open

    cfg = dataclasses.replace(
        config_from_hf(json.loads((DEEPSEEK / "config.json").read_text())), mtp=models.MTPConfig(depth=2)
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    out = to_hf(model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    tensors = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    d, n = cfg.d_model, cfg.n_layers
    for i in range(2):
        layer = f"model.layers.{n + i}."
        np.testing.assert_array_equal(tensors[layer + "eh_proj.weight"], params["mtp"]["eh_proj"][i].T)
        assert tensors[layer + "eh_proj.weight"].shape == (d, 2 * d)
        np.testing.assert_array_equal(tensors[layer + "enorm.weight"], params["mtp"]["enorm"]["scale"][i])
        np.testing.assert_array_equal(
            tensors[layer + "shared_head.norm.weight"], params["mtp"]["head_norm"]["scale"][i]
        )
        np.testing.assert_array_equal(tensors[layer + "embed_tokens.weight"], params["embedding"])
        np.testing.assert_array_equal(tensors[layer + "shared_head.head.weight"], params["lm_head"].T)
        np.testing.assert_array_equal(
            tensors[layer + "mlp.gate.e_score_correction_bias"],
            params["mtp"]["block"]["mlp"]["router_bias"][i],
        )
        for name in ("hnorm.weight", "self_attn.q_a_proj.weight", "mlp.experts.7.down_proj.weight"):
            assert layer + name in tensors
    assert f"model.layers.{n + 2}.eh_proj.weight" not in tensors
    back = from_hf(out)
    assert back.cfg.mtp == models.MTPConfig(depth=2)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(back, nnx.Param)), params)


def test_deepseek_directory_without_the_modules_reads_without_them(tmp_path):
    """transformers saves a model without the prediction layers but keeps config.json's
    num_nextn_predict_layers: such a directory loads as the main model alone."""
    local = Path(shutil.copytree(DEEPSEEK, tmp_path / "hf"))
    hf = json.loads((local / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    assert from_hf(local).cfg.mtp is None


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_modules_block_is_the_kind_of_the_layer_after_the_last(moe):
    """With a layer pattern the module's block attends as the next layer would: global after
    (global, local) x 1 here, so no window; the MoE block took no kind before (issue #62), which
    is a window on every layer."""
    from jaxtrain.models.mtp import MTPLayer

    cfg = dataclasses.replace(
        CFG,
        attention_pattern=("global", "local"),
        sliding_window=4,
        moe=models.MoEConfig(num_experts=4, top_k=2, expert_mlp_dim=16) if moe else None,
    )
    block = MTPLayer(cfg, rngs=nnx.Rngs(0)).block
    assert block.attn.kind == "global" and block.attn.window is None
