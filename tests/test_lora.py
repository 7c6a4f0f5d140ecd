"""LoRA (models/lora.py, trainer with a frozen base, PEFT interchange) against torch + peft.

The oracle is tests/assets/lora/ (tests/assets/make_lora_assets.py, torch 2.13 + peft 0.21):
a PEFT adapter with non-zero B on the tiny HF Llama, four fixed batches with loss masks,
and torch AdamW over peft's trainable parameters (clip 0.3, which binds at every step).
tests/assets/lora_qwen3_5/ (the same script's `qwen3_5`): peft's adapter on every projection of
the tiny Qwen3.5 hybrid (gated DeltaNet and gated attention) and peft's logits with it.
"""

import functools
import json
import math
import operator
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import models, sharding
from jaxtrain.interchange.convert import hf_to_ckpt
from jaxtrain.interchange.peft import read_adapter, write_adapter
from jaxtrain.models import lora
from jaxtrain.models.hf import config_from_hf, load_hf_params, read_hf_config
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.recovery.checkpoint import abstract_state
from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.loop import initial_state
from jaxtrain.trainer.program import build_program
from tests.conftest import replace, tiny_config

ASSETS = Path(__file__).parent / "assets"
LORA = ASSETS / "lora"
BASE = ASSETS / "hf" / "llama_gqa_rope_llama3"
EXPECTED = json.loads((LORA / "expected.json").read_text())
TARGETS = "[wq, wk, wv, wo, w_gate, w_up, w_down]"
# what the base's config.json fixes (the rest is configs/tiny.yaml's: dtypes, impls)
ARCH_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "mlp_dim",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "tie_embeddings",
    "init_std",
)


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_base")
    hf_to_ckpt(BASE, out / "base")
    return out / "base"


def lora_config(tmp_path, base_ckpt, *overrides):
    """The oracle's run: the HF base, the initial PEFT adapter, its optimizer, f32, data=2 x fsdp=2."""
    o = EXPECTED["optimizer"]
    cfg = tiny_config(
        tmp_path,
        f"train.init_from={base_ckpt}",
        f"model.lora={{rank: 4, alpha: 8, targets: {TARGETS}, init_from: {LORA / 'initial'}}}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "train.global_batch_size=8",
        "train.seq_len=16",
        f"train.steps={EXPECTED['steps']}",
        "train.loss_chunk=0",
        f"optimizer.lr={o['lr']}",
        "optimizer.warmup_steps=0",
        "optimizer.min_lr_ratio=1.0",  # constant lr, as the torch run
        f"optimizer.b1={o['b1']}",
        f"optimizer.b2={o['b2']}",
        f"optimizer.eps={o['eps']}",
        f"optimizer.weight_decay={o['weight_decay']}",
        f"optimizer.clip_norm={o['clip_norm']}",
        "model.remat=none",
        *overrides,
    )
    hf = config_from_hf(read_hf_config(BASE))
    arch = {k: getattr(hf, k) for k in ARCH_KEYS}
    return replace(cfg, model=arch)


def oracle_batches():
    data = np.load(LORA / "batches.npz")
    steps, rows, seq = data["inputs"].shape
    for s in range(steps):
        yield {
            "inputs": data["inputs"][s],
            "targets": data["targets"][s],
            "loss_mask": data["loss_mask"][s],
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
            "segment_ids": np.ones((rows, seq), np.int32),
        }


def on_mesh(cfg):
    n = math.prod(cfg.mesh.sizes().values())
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:n])
    cfg = resolve_for_mesh(cfg, mesh)
    return cfg, mesh, axis_rules(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_ckpt):
    """The oracle's four steps in jaxtrain: (cfg, program, first state's frozen base, final state, losses)."""
    cfg, mesh, rules = on_mesh(lora_config(tmp_path_factory.mktemp("lora_run"), base_ckpt))
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = initial_state(cfg, program, abstract_state(program), lambda _: None)
        losses = []
        for rows in oracle_batches():
            state, metrics = program.step(state, batch_to_device(rows, program.batch_sharding))
            losses.append(float(metrics["loss"]))
    return cfg, mesh, program, state, losses  # outside the mesh: later tests set their own


@pytest.mark.composes("lm+lora", "dense+lora", "data+lora", "lora+adamw")
def test_losses_and_final_adapters_equal_torch_peft(trained):
    cfg, _, _, state, losses = trained
    # f32 on both sides; summation orders differ (data=2 x fsdp=2 here, one device in torch)
    np.testing.assert_allclose(losses, EXPECTED["losses"], rtol=1e-5)
    want = read_adapter(LORA / "final", cfg.model)
    got = jax.device_get(state.params)
    # atol 1e-6, save where Adam's first step divides a gradient of the size of eps (1e-8) by
    # itself: there summation-order noise in the gradient moves the update (at most lr = 1e-2);
    # 2 of 7424 values were at 1.7e-6 and 4.8e-6 when this was written
    diffs = np.concatenate(
        [np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    )
    assert diffs.size == cfg.model.adapter_param_count()
    assert diffs.max() < 1e-5 and np.mean(diffs > 1e-6) < 1e-3, (diffs.max(), np.sum(diffs > 1e-6))


def test_base_is_bit_identical_after_training(trained):
    cfg, _, _, state, _ = trained
    want = load_hf_params(BASE, config_from_hf(read_hf_config(BASE)))
    got = jax.device_get(state.frozen)
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]] == [p for p, _ in flat_want]
    for (path, w), g in zip(flat_want, jax.tree.leaves(got)):
        assert np.array_equal(np.asarray(g), w), jax.tree_util.keystr(path)


def test_optimizer_state_holds_only_adapters(trained):
    cfg, _, program, state, _ = trained
    n_adapters = cfg.model.adapter_param_count()
    assert sum(x.size for x in jax.tree.leaves(state.params)) == n_adapters
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapters  # Adam's mu and nu, nothing of the base
    # the compiled step's arguments: the base once, the adapters with their two moments, the
    # batch; a full fine-tune's would hold the base three times
    batch = next(oracle_batches())
    compiled = program.step.lower(state, batch_to_device(batch, program.batch_sharding)).compile()
    per_device = compiled.memory_analysis().argument_size_in_bytes
    base_bytes = sum(
        math.prod(s.sharding.shard_shape(s.shape)) * 4
        for s in jax.tree.leaves(abstract_state(program).frozen)
    )
    adapter_bytes = 4 * n_adapters  # an upper bound per device (some are sharded)
    assert base_bytes < per_device < base_bytes + 3 * adapter_bytes + 64 * 1024


def test_peft_export_equals_peft_saved_adapter(trained, tmp_path):
    """Keys, shapes, dtypes and config fields of our export equal what peft saved."""
    from safetensors.numpy import load_file

    cfg, _, _, state, _ = trained
    theirs = load_file(LORA / "initial" / "adapter_model.safetensors")
    initial = read_adapter(LORA / "initial", cfg.model)
    out = write_adapter(initial, cfg.model, tmp_path / "adapter", base="llama_gqa_rope_llama3")
    ours = load_file(out / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype, k
        assert np.array_equal(ours[k], theirs[k]), k  # a read and written round trip is exact
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (LORA / "initial" / "adapter_config.json").read_text()
    )
    # the trained adapters export to exactly the values we hold (read back in our layout),
    # which are torch's final ones (see the training test for the tolerance)
    held = jax.device_get(state.params)
    write_adapter(held, cfg.model, tmp_path / "trained")
    back = read_adapter(tmp_path / "trained", cfg.model)
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    final = load_file(LORA / "final" / "adapter_model.safetensors")
    exported = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    for k in final:
        np.testing.assert_allclose(exported[k], final[k], atol=1e-5, rtol=0, err_msg=k)


def test_fresh_adapter_is_the_base_and_disabled_adapters_give_the_base(base_ckpt):
    """B = 0 at init (PEFT's default), A kaiming-uniform within 1/sqrt(fan_in); with adapters
    off the logits are exactly the base's, whatever B holds."""
    cfg = models.ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp_dim=48,
        lora=models.config.LoRAConfig(rank=4, alpha=8, targets=("wq", "wo", "w_down")),
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    base, adapters = lora.split(params)
    attn = adapters["blocks"]["attn"]
    assert float(np.abs(attn["wq_lora"]["a"]).max()) <= 1 / math.sqrt(32)
    assert float(np.abs(attn["wo_lora"]["a"]).max()) <= 1 / math.sqrt(4 * 8)
    for ad in (attn["wq_lora"], attn["wo_lora"], adapters["blocks"]["mlp"]["w_down_lora"]):
        assert not np.any(ad["b"])
    plain = models.ModelConfig(**{**cfg.__dict__, "lora": None})
    g, abstract = models.abstract_model(lambda: models.Transformer(plain, rngs=nnx.Rngs(0)))
    base_model = models.merge(g, abstract, base)
    tokens = np.arange(16).reshape(2, 8) % 64
    np.testing.assert_array_equal(model(tokens), base_model(tokens))
    noisy = jax.tree.map(lambda x: x + 0.1, adapters)
    g2, abstract2 = models.abstract_model(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    adapted = models.merge(g2, abstract2, lora.join(base, noisy))
    assert float(np.abs(adapted(tokens) - base_model(tokens)).max()) > 1e-3
    with lora.adapters_disabled():
        np.testing.assert_array_equal(adapted(tokens), base_model(tokens))
    # merged weights (W + alpha/r A B) give the adapted logits
    merged = models.merge(g, abstract, lora.merged(lora.join(base, noisy), cfg))
    np.testing.assert_allclose(merged(tokens), adapted(tokens), atol=2e-5)


def test_run_resumes_exactly_exports_and_generates_as_the_merged_model(tmp_path, base_ckpt):
    """A LoRA run through `jaxtrain train`'s loop (adapter dropout on): a checkpoint holds the
    adapters alone and a run resumed from it repeats the uninterrupted losses and adapters
    exactly; a different base or adapter shape is refused; `ckpt-to-hf --adapter` writes
    the adapters, `ckpt-to-hf` the merged model, which generates what the run's model does."""
    import orbax.checkpoint as ocp

    from jaxtrain.interchange import generate as gen
    from jaxtrain.interchange.convert import ckpt_to_hf
    from jaxtrain.recovery.checkpoint import CheckpointMismatchError
    from jaxtrain.trainer.loop import train

    run = [
        "model.lora.dropout=0.1",
        "checkpoint.every=2",
        "checkpoint.async_save=false",
        "data.source=synthetic",
    ]
    whole = train(lora_config(tmp_path / "whole", base_ckpt, *run), devices=jax.devices()[:4])
    assert not any("frozen" in str(p) for p in (tmp_path / "whole" / "checkpoints" / "4" / "state").iterdir())
    first = train(
        lora_config(tmp_path / "split", base_ckpt, *run, "train.steps=2"), devices=jax.devices()[:4]
    )
    second = train(lora_config(tmp_path / "split", base_ckpt, *run), devices=jax.devices()[:4])
    assert second.start_step == 2
    losses = lambda r: [m["loss"] for m in r.metrics]
    assert losses(first) + losses(second) == losses(whole)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(second.state.params)),
        jax.tree.leaves(jax.device_get(whole.state.params)),
    ):
        np.testing.assert_array_equal(a, b)

    # another base (one value changed) or another adapter shape: refused, checkpoint untouched
    other = tmp_path / "other_base"
    params = ocp.StandardCheckpointer().restore(Path(base_ckpt) / "params")
    params["final_norm"]["scale"] = np.asarray(params["final_norm"]["scale"]).copy()
    params["final_norm"]["scale"][0] += 1e-3
    with ocp.StandardCheckpointer() as ckptr:  # saves asynchronously: leaving the block waits for it
        ckptr.save((other / "params").absolute(), params)
    (other / "model.yaml").write_text((Path(base_ckpt) / "model.yaml").read_text())
    with pytest.raises(CheckpointMismatchError, match="fingerprint"):
        train(
            lora_config(tmp_path / "split", base_ckpt, *run, f"train.init_from={other}"),
            devices=jax.devices()[:4],
        )
    with pytest.raises(CheckpointMismatchError, match="wk_lora.*in the checkpoint but"):
        train(
            lora_config(
                tmp_path / "split", base_ckpt, *run, "model.lora.rank=8", "model.lora.init_from=null"
            ),
            devices=jax.devices()[:4],
        )

    cfg = lora_config(tmp_path / "whole", base_ckpt, *run)
    ckpt_to_hf(tmp_path / "whole", tmp_path / "adapter", adapter=True)
    exported = read_adapter(tmp_path / "adapter", cfg.model)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(jax.device_get(whole.state.params))):
        np.testing.assert_array_equal(a, b)
    ckpt_to_hf(tmp_path / "whole", tmp_path / "merged")
    merged = models.from_hf(tmp_path / "merged")

    src = gen.open_source(str(tmp_path / "whole"), ["mesh.data=1", "mesh.fsdp=2"])
    mesh = gen.make_mesh(src.cfg)
    run_cfg = resolve_for_mesh(src.cfg, mesh)
    prompt = np.asarray([[5, 17, 99, 3, 42, 7]], np.int32)
    with jax.set_mesh(mesh), sharding.axis_rules(axis_rules(run_cfg)):
        model = gen.load_model(src, mesh, run_cfg)
        assert model.cfg.lora is not None  # the adapters run beside the base weights
        adapted = np.asarray(models.generate(model, prompt, max_new_tokens=12))
        logits = np.asarray(model(prompt))
    src.close()
    np.testing.assert_allclose(logits, np.asarray(merged(prompt)), atol=2e-5)
    np.testing.assert_array_equal(adapted, np.asarray(models.generate(merged, prompt, max_new_tokens=12)))


def test_plan_memory_model_counts_no_base_gradients_or_moments():
    """`jaxtrain plan`'s state term: with model.lora the base holds 4 bytes a parameter (f32
    weights alone), the adapters 16 (weights, gradients, Adam's two moments)."""
    from jaxtrain.planning.footprint import estimate, lower_bound

    full = replace(tiny_config(), train=dict(loss_chunk=0), model=dict(remat="none"))
    lo = replace(full, model=dict(lora=models.config.LoRAConfig(rank=8, targets=("wq", "wv", "w_up"))))
    mesh = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    n, a = lo.model.param_count(), lo.model.adapter_param_count()
    # r x (in + out) per weight, 2 layers: wq 128 -> 4 x 32, wv 128 -> 2 x 32, w_up 128 -> 512
    assert a == 2 * 8 * ((128 + 128) + (128 + 64) + (128 + 512))
    assert estimate(full, mesh).state == 16 * full.model.param_count()
    assert estimate(lo, mesh).state == 4 * (n - a) + 16 * a
    assert lower_bound(lo, mesh).state == 4 * (n - a) + 16 * a


def _lora_moe_cfg(**mesh):
    """A tiny MoE (4 experts, top-2, dropless) whose first layer is dense, adapters on every
    target (the experts' too): one model covers dense and expert adapters."""
    cfg = tiny_config(
        None,
        "model.d_model=64",
        "model.mlp_dim=128",
        "model.vocab_size=128",
        "train.seq_len=32",
        "train.loss_chunk=0",
        "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 64, dispatch: dropless, first_dense_layers: 1}",
        f"model.lora={{rank: 4, alpha: 8, targets: {TARGETS}}}",
    )
    return replace(cfg, mesh=mesh)


def _with_random_b(state) -> dict:
    """The whole parameter tree (host arrays) with each adapter's B drawn at random (a fresh B
    is zero, which leaves A without gradient and the adapters without effect)."""
    base, adapters = jax.device_get((state.frozen, state.params))
    rng = np.random.default_rng(0)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: rng.normal(0, 0.05, x.shape).astype(x.dtype) if p[-1].key == "b" else x, adapters
    )
    return lora.join(base, adapters)


def _adapter_loss_and_grads(cfg, whole=None):
    """(loss, adapter gradients, every parameter's PartitionSpec, the whole parameter tree) of one
    synthetic batch; `whole` None: the seed's base with B drawn at random (a fresh B is zero,
    which leaves A without gradient)."""
    from tests.conftest import program_on_mesh

    with program_on_mesh(cfg) as (program, state, data):
        if whole is None:
            whole = _with_random_b(state)
        loss, _, grads = program.loss_and_grads(whole, batch_to_device(next(data), program.batch_sharding))
        specs = jax.tree.map(lambda s: s.spec, program.param_shardings)
        return float(loss), jax.device_get(grads), specs, whole


@pytest.mark.composes(
    "moe+fsdp",
    "moe+tensor",
    "moe+expert",
    "fsdp+expert",
    "tensor+expert",
    "fsdp+lora",
    "tensor+lora",
    "expert+lora",
)
def test_adapters_on_tensor_and_expert_meshes_equal_one_device_and_follow_the_rules():
    """fsdp=2 x tensor=2 x expert=2 against one device: the loss and every adapter gradient
    (attention, the dense MLP, the experts') are equal (rtol 1e-5), and each adapter's A is
    sharded like its weight's input dims, B like its output dims, the rank dim whole."""
    ref_loss, ref_grads, _, whole = _adapter_loss_and_grads(_lora_moe_cfg(fsdp=1))
    loss, grads, specs, _ = _adapter_loss_and_grads(_lora_moe_cfg(fsdp=2, tensor=2, expert=2), whole)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
    assert len(flat) == 2 * 2 * 7  # A and B of 7 targets in each layer (the MoE layer's: the experts')
    for (path, want), got in zip(flat, jax.tree.leaves(grads), strict=True):
        assert np.abs(want).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # every adapter against its weight: A [*lead, *in, r] split as W's [*lead, *in], B
    # [*lead, r, *out] as W's [*lead, *out]; the rank dim whole (lead: layers, experts)
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))
    checked = 0
    for path, a in jax.tree_util.tree_flatten_with_path(lora.split(whole)[1])[0]:
        if path[-1].key != "a":
            continue
        *parent, name = [k.key for k in path[:-1]]
        node = lambda tree: functools.reduce(operator.getitem, parent, tree)
        w, b = node(whole)[name.removesuffix(lora.SUFFIX)], node(whole)[name]["b"]
        w_spec = pad(node(specs)[name.removesuffix(lora.SUFFIX)], w.ndim)
        a_spec, b_spec = pad(node(specs)[name]["a"], a.ndim), pad(node(specs)[name]["b"], b.ndim)
        lead = a.ndim + b.ndim - 2 - w.ndim
        assert a_spec == (*w_spec[: a.ndim - 1], None), (path, a_spec, w_spec)
        assert b_spec == (*w_spec[:lead], None, *w_spec[a.ndim - 1 :]), (path, b_spec, w_spec)
        checked += 1
    assert checked == 14
    # which is, for instance ([layers, ...] stacks: the layers dim on stage, 1 here)
    attn, experts = specs["blocks"]["attn"], specs["moe_blocks"]["mlp"]
    assert pad(attn["wq_lora"]["a"], 3) == (None, "fsdp", None)  # [L, embed, r]
    assert pad(attn["wq_lora"]["b"], 4) == (None, None, "tensor", None)  # [L, r, heads, head_dim]
    assert pad(experts["w_gate_lora"]["a"], 4) == (None, "expert", "fsdp", None)  # [L, E, embed, r]
    assert pad(experts["w_gate_lora"]["b"], 4) == (None, "expert", None, "tensor")  # [L, E, r, mlp]


def _merged_by_hand(whole: dict, scale: float) -> dict:
    """Every adapted weight W replaced by W + scale * A B (A [*lead, *in, r], B [*lead, r, *out],
    W [*lead, *in, *out]) and the adapters dropped: numpy, from the shapes alone."""
    out = {}
    for key, value in whole.items():
        if key.endswith(lora.SUFFIX):
            continue
        if isinstance(value, dict):
            out[key] = _merged_by_hand(value, scale)
            continue
        adapter = whole.get(key + lora.SUFFIX)
        if adapter is None:
            out[key] = np.asarray(value)
            continue
        a, b, w = (np.asarray(x, np.float64) for x in (adapter["a"], adapter["b"], value))
        lead = a.ndim + b.ndim - 2 - w.ndim
        n_in = a.ndim - 1 - lead
        a2 = a.reshape(*a.shape[:lead], math.prod(a.shape[lead : lead + n_in]), a.shape[-1])
        b2 = b.reshape(*b.shape[: lead + 1], -1)
        out[key] = (w + scale * (a2 @ b2).reshape(w.shape)).astype(np.float32)
    return out


@pytest.mark.composes(
    "moe+lora", "mtp+lora", "sinks+lora", "attention_pattern+lora", "qk_norm+lora", "final_softcap+lora"
)
def test_adapters_beside_every_layer_feature_equal_the_weights_merged_by_hand():
    """An MoE model (adapters on the experts too) with prediction modules, sinks, a local/global
    pattern, query/key norms and a final softcap: its loss (the main, the modules' and the
    router losses) and every logit equal those of the same model without LoRA whose targeted
    weights are W + (alpha / r) A B, merged here by hand, B drawn at random."""
    from tests.conftest import program_on_mesh

    common = (
        "model.d_model=32",
        "model.mlp_dim=64",
        "model.vocab_size=128",
        "model.n_layers=2",
        "train.seq_len=16",
        "train.loss_chunk=0",
        "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 32}",
        "model.mtp={depth: 1}",
        "model.attention_sinks=true",
        "model.attention_pattern=[local, global]",
        "model.sliding_window=6",
        "model.qk_norm=head",
        "model.final_softcap=2.0",
    )
    results = []
    for cfg in (
        tiny_config(None, *common, f"model.lora={{rank: 4, alpha: 8, targets: {TARGETS}}}"),
        tiny_config(None, *common),
    ):
        with program_on_mesh(cfg) as (program, state, data):
            batch = next(data)
            if cfg.model.lora is not None:
                whole = _with_random_b(state)
                assert "mtp" in state.params and "moe_blocks" in state.params  # modules and experts adapted
            else:
                whole = _merged_by_hand(whole, 8 / 4)
            loss, _, _ = program.loss_and_grads(whole, batch_to_device(batch, program.batch_sharding))
            model = models.merge(program.graphdef, program.abstract_params, whole)
            logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
            results.append((float(loss), np.asarray(jax.device_get(logits))))
    (loss, logits), (want_loss, want_logits) = results
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


HYBRID = ASSETS / "lora_qwen3_5"  # tests/assets/make_lora_assets.py qwen3_5
HYBRID_BASE = ASSETS / "hf" / "qwen3_5_hybrid"
HYBRID_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", *models.config.LINEAR_LORA_TARGETS)


def _hybrid_run(tmp_path):
    """The Qwen3.5 hybrid as a user trains it: `hf-to-ckpt` of the HF base as train.init_from,
    peft's adapter as model.lora.init_from, on tensor=2 (the DeltaNet key-head groups and the
    attention heads split): (cfg, program, the initial state's whole parameter tree, host)."""
    model_cfg = hf_to_ckpt(HYBRID_BASE, tmp_path / "base")
    lo = models.config.LoRAConfig(rank=4, alpha=8, targets=HYBRID_TARGETS, init_from=str(HYBRID / "adapter"))
    cfg = tiny_config(
        tmp_path / "run", f"train.init_from={tmp_path / 'base'}", "mesh.tensor=2", "train.seq_len=72"
    )
    cfg = replace(cfg, model={**model_cfg.__dict__, "lora": lo, "remat": "none"})
    cfg, mesh, rules = on_mesh(cfg)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = initial_state(cfg, program, abstract_state(program), lambda _: None)
    return cfg, program, lora.join(*jax.device_get((state.frozen, state.params)))


@pytest.mark.composes("linear_attention+lora")
def test_peft_adapter_on_the_hybrids_deltanet_and_gated_query_gives_peft_logits(tmp_path):
    """peft's adapter (r=4, alpha=8, lora_B random) on every projection of the tiny Qwen3.5
    hybrid: the gated DeltaNet layers' in_proj_qkv (its lora_B rows regrouped per key head as
    the weight's), in_proj_z, in_proj_b, in_proj_a, out_proj, and the full-attention layer's
    q_proj, whose one adapter spans the query and gate halves. Read as a run reads it, the
    logits are peft's; merged into the base, too; it exports to the bytes peft saved."""
    from safetensors.numpy import load_file

    cfg, program, whole = _hybrid_run(tmp_path)
    expected = np.load(HYBRID / "expected.npz")
    tokens, want = expected["tokens"], expected["logits"]
    model = models.merge(program.graphdef, program.abstract_params, whole)
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=0, atol=1e-5)  # 3.6e-6 seen
    blocks = lora.split(whole)[1]["blocks"]  # layers 0-2 DeltaNet, 3 full attention
    assert blocks["layer_3"]["attn"]["wq_lora"]["b"].shape[-2:] == (4, 2 * 32)  # heads, query | gate
    assert blocks["layer_0"]["attn"]["in_proj_qkv_lora"]["b"].shape[-2:] == (2, 2 * 16 + 2 * 8)  # groups
    assert sum(x.size for x in jax.tree.leaves(lora.split(whole)[1])) == cfg.model.adapter_param_count()
    with lora.adapters_disabled():  # the adapter matters well beyond the tolerance
        assert np.abs(np.asarray(model(tokens)) - want).max() > 1e-2

    plain = models.ModelConfig(**{**cfg.model.__dict__, "lora": None})
    g, abstract = models.abstract_model(lambda: models.Transformer(plain, rngs=nnx.Rngs(0)))
    merged = models.merge(g, abstract, lora.merged(whole, cfg.model))
    np.testing.assert_allclose(np.asarray(merged(tokens)), want, rtol=0, atol=2e-5)

    out = write_adapter(lora.split(whole)[1], cfg.model, tmp_path / "adapter", base=HYBRID_BASE.name)
    theirs, ours = (
        load_file(HYBRID / "adapter" / "adapter_model.safetensors"),
        load_file(out / "adapter_model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert np.array_equal(ours[k], theirs[k]), k  # read and written back: exact
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (HYBRID / "adapter" / "adapter_config.json").read_text()
    )


def test_deltanet_targets_without_deltanet_layers_are_refused():
    """in_proj_qkv etc. name the gated DeltaNet layers' projections: on a model without such
    layers they would adapt nothing, so the config says so."""
    lo = models.config.LoRAConfig(targets=("wq", "in_proj_qkv"))
    with pytest.raises(ValueError, match=r"model.lora.targets \['in_proj_qkv'\].*no linear_attention layer"):
        models.ModelConfig(lora=lo).validate()
