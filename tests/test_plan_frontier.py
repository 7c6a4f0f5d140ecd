"""The planner's model of the frontier MoE models (issue 52): latent attention (model.mla),
multi-token prediction (model.mtp), attention sinks and the output bias (GPT-OSS).

Oracles: the built models' own parameters (tiny models, abstract: nnx.eval_shape), counted
by where they sit and by their logical axes; MaxText's MLA FLOPs formula written out here
(maxtext_utils.calculate_mla_tflops_per_device); the planner's grouped-query formulas
(footprint.py's table) rewritten in the test with latent attention's widths; and `jaxtrain
plan` itself on the DeepSeek-V3 and Moonlight presets."""

import dataclasses
import os

import jax
import pytest
from conftest import REPO, tiny_config
from flax import nnx

from jaxtrain import models
from jaxtrain.config import load_config
from jaxtrain.models.config import MLAConfig, MoEConfig, MTPConfig
from jaxtrain.planning import footprint
from jaxtrain.planning.flops import flops_per_token
from jaxtrain.planning.planner import recompute_flops_per_token
from jaxtrain.trainer.optimizer import muon_labels

MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
DEEPSEEK_MOE = MoEConfig(
    num_experts=8, top_k=2, expert_mlp_dim=16, num_shared_experts=1, scoring="sigmoid", score_bias=True,
    num_groups=4, top_k_groups=2, routed_scaling_factor=2.5, first_dense_layers=1,
)  # fmt: skip
GPT_OSS_MOE = MoEConfig(
    num_experts=4, top_k=2, expert_mlp_dim=24, router_logit_bias=True, expert_bias=True,
    expert_activation="clamped_swiglu",
)  # fmt: skip
SHAPES = {
    "deepseek-v3": dict(mla=MLA, moe=DEEPSEEK_MOE, mtp=MTPConfig(depth=2)),
    "mla-no-q-latent-dense-mtp": dict(mla=MLAConfig(**{**vars(MLA), "q_lora_rank": None}), mtp=MTPConfig()),
    "gpt-oss": dict(
        n_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        attention_pattern=("local", "global"),
        sliding_window=4,
        moe=GPT_OSS_MOE,
    ),  # fmt: skip
}


def small(name: str, **extra):
    """A tiny run config of one of SHAPES (4 layers, d_model 32, 4 heads, float32)."""
    cfg = tiny_config(
        None, "model.d_model=32", "model.mlp_dim=48", "model.vocab_size=96", "model.n_layers=4",
        "model.n_heads=4", "model.n_kv_heads=4", "train.seq_len=64", "train.global_batch_size=2",
    )  # fmt: skip
    model = dataclasses.replace(cfg.model, **SHAPES[name], **extra)
    model.validate()
    return dataclasses.replace(cfg, model=model)


@pytest.mark.parametrize("name", list(SHAPES))
def test_planner_parameter_counts_are_the_built_models(name):
    """Every count the planner's memory and time models read, against the built model's
    parameters: all of them (param_count), the routed experts' (expert_params: every parameter
    on the `expert` axis, the prediction modules' blocks and GPT-OSS's expert biases
    included), the layer stack's (layer_stack_params: all but the embedding, final norm and
    head), Muon's matrices (muon_param_count: the optimizer's own labels)."""
    m = small(name).model
    _, state = models.abstract_model(lambda: models.Transformer(m, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    sizes = jax.tree.leaves(jax.tree.map(lambda x: x.size, params))
    axes = jax.tree.leaves(models.logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))
    assert m.param_count() == sum(sizes)
    assert footprint.expert_params(m) == sum(s for s, a in zip(sizes, axes) if "expert" in a)
    outside = params["embedding"].size + params["final_norm"]["scale"].size + params["lm_head"].size
    assert footprint.layer_stack_params(m) == sum(sizes) - outside
    labels = jax.tree.leaves(muon_labels(models.logical_axes(state)))
    assert footprint.muon_param_count(m) == sum(s for s, label in zip(sizes, labels) if label == "muon")
    if m.mtp is not None:  # what the modules add, counted apart
        assert m.mtp_param_count() == sum(x.size for x in jax.tree.leaves(params["mtp"]))


def test_deepseek_v3_flops_are_maxtexts_mla_formula():
    """flops_per_token on the DeepSeek-V3 preset against MaxText's per-token training FLOPs for
    latent attention (maxtext_utils.calculate_mla_tflops_per_device, times 3 for forward and
    backward, causal attention halved) with the MoE and head terms of its
    calculate_tflops_training_per_device, written out from the preset's numbers:
        q    = 2 (D q_lora + q_lora H (nope + rope))        kv = 2 (D (kv_lora + rope) + kv_lora H (nope + v))
        attn = 2 S H (nope + rope + v) / 2 (causal)          out = 2 H v D
        ffn  = 2 x 3 D F_dense (3 layers), 2 x 3 D F_expert (top_k + shared) + 2 D E (router) (58 layers)
        head = 2 D V;  training = 3 x forward.
    The 6N convention also counts each norm scale and the selection bias (6 FLOPs a parameter a
    token): 2 D + q_lora + kv_lora per layer, E per MoE layer, D for the final norm: added
    here, 0.0001% of the total. DeepSeek-V3's report: 37B activated parameters a token."""
    m = load_config(os.path.join(REPO, "configs", "deepseek-v3-671b.yaml")).model
    S, D, H, V, L = 4096, 7168, 128, 129280, 61
    nope, rope, v, ql, kvl = 128, 64, 128, 1536, 512
    E, k, F, F_dense, dense = 256, 8, 2048, 18432, 3
    q = 2 * (D * ql + ql * H * (nope + rope))
    kv = 2 * (D * (kvl + rope) + kvl * H * (nope + v))
    attention = 2 * S * H * (nope + rope + v) / 2
    out = 2 * H * v * D
    ffn = dense * 2 * 3 * D * F_dense + (L - dense) * (2 * 3 * D * F * (k + 1) + 2 * D * E)
    forward = L * (q + kv + attention + out) + ffn + 2 * D * V
    scales = L * (2 * D + ql + kvl) + (L - dense) * E + D
    assert flops_per_token(m, S) == pytest.approx(3 * forward + 6 * scales, rel=1e-12)
    assert m.param_count() == 671_026_419_200  # the preset's 671.0B (its compile report's `params`)
    assert 37e9 < m.active_param_count() < 38e9


def test_mla_activation_bytes_are_the_gqa_formulas_with_its_widths():
    """footprint's per-token bytes for latent attention: the grouped-query formulas
    (footprint.py's table: qkv_proj (H + 2K) hd, context H (hd a + 4), q/k before RoPE
    (H + K) hd) with MLA's widths written in: q and k H (nope + rope) and v H v after RoPE,
    context H v, q and the key/value up-projection H (nope + rope) + H (nope + v) before it,
    and its latents (q_lora + kv_lora + rope, not split over tensor) with their two norms."""
    cfg = small("deepseek-v3")
    m, a, t = cfg.model, 4, 2  # float32 compute in the tiny config; tensor = 2
    assert m.compute_dtype == "float32"
    H, qk, v, nope = 4, 12, 12, 8
    gqa = footprint.name_bytes_per_token(small("gpt-oss").model, t)
    assert gqa["qkv_proj"] == (4 + 2 * 2) * 8 * a / t  # GQA as before: H = 4, K = 2, hd = 8
    names = footprint.name_bytes_per_token(m, t)
    assert names["qkv_proj"] == H * (2 * qk + v) * a / t
    assert names["context"] == H * (v * a + 4) / t
    dense = footprint.layer_bytes_per_token(m, t) - sum(names.values())
    norms, residual, swiglu = 2 * 32 * (4 + 4 + a), 32 * a, 1.5 * names["mlp_in"]
    before_rope = (H * qk + H * (nope + v)) * a / t
    latents = (24 + 16 + 4) * a + (24 + 16) * (4 + 4 + a)
    moe = (1 + 1) * 2 * 32 * a + 32 * a  # top_k = 2, one row per assignment (no expert axis)
    assert dense == pytest.approx(norms + before_rope + latents + residual + swiglu + moe, rel=1e-12)


def test_mtp_modules_add_a_layer_each_and_their_logits():
    """The prediction modules (depth 2): each keeps what a layer keeps plus its token
    embedding (saved), their blocks' experts count as experts (state), and their losses hold
    their own f32 logits (unchunked: depth more [T, V]; chunked: depth more d loss / d x)."""
    cfg = small("deepseek-v3", remat="full")
    no_mtp = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp=None))
    mesh = {"fsdp": 1}
    tokens, a, D, V = 2 * 64, 4, 32, 96
    for chunk in (0, 16):
        chunked = lambda c: dataclasses.replace(c, train=dataclasses.replace(c.train, loss_chunk=chunk))
        with_it, without = (footprint.estimate(chunked(c), mesh) for c in (cfg, no_mtp))
        assert with_it.saved - without.saved == 2 * tokens * (D * a + D * a)  # full keeps the input
        assert with_it.working == without.working
        extra = 2 * tokens * (4 * D if chunk else 4 * V)
        assert with_it.logits - without.logits == extra
    assert footprint.expert_params(cfg.model) - footprint.expert_params(no_mtp.model) == 2 * 8 * 3 * D * 16


def test_mla_recompute_is_its_projections_and_attention():
    """planner.recompute_flops_per_token with latent attention: `full` redoes every layer's
    forward (2 x its active parameters, norms included, and S H (qk + v) of causal attention)
    and each prediction module's input projection; `save_qkv_proj` skips MaxText's q and kv
    projection FLOPs (written out) in every layer and module block."""
    cfg = small("deepseek-v3", remat="full")
    m, S, H, D = cfg.model, 64, 4, 32
    layers = m.n_layers + 2  # two prediction modules
    head_and_final = 96 * D + D
    mtp_inputs = 2 * (3 * D + 2 * D * D)
    blocks = m.active_param_count(include_embedding=False) - head_and_final - mtp_inputs
    want = 2 * blocks + layers * S * H * (12 + 12) + 2 * 2 * 2 * D * D
    assert recompute_flops_per_token(cfg) == pytest.approx(want, rel=1e-12)
    q = 2 * (D * 24 + 24 * H * 12)
    kv = 2 * (D * (16 + 4) + 16 * H * (8 + 12))
    diff = recompute_flops_per_token(cfg, "save_out_proj") - recompute_flops_per_token(cfg, "save_qkv_proj")
    assert diff == pytest.approx(layers * (q + kv) - layers * 2 * H * 12 * D, rel=1e-12)


@pytest.mark.parametrize(
    "preset,target",
    [("deepseek-v3-671b", "tpu:v5p-1024"), ("moonlight-16b-a3b", "gpu:h100")],
)
def test_plan_runs_on_the_latent_attention_presets(preset, target, capsys):
    """`jaxtrain plan` (analytic, --no-compile) ranks candidates that fit on both presets."""
    from jaxtrain import cli

    path = os.path.join(REPO, "configs", f"{preset}.yaml")
    code = cli.main(["plan", path, "--target", target, "--no-compile"])
    out = capsys.readouterr().out
    assert code == 0, out
    rank1 = next(line for line in out.splitlines() if line.startswith("1 "))
    assert "%" in rank1, out


def test_cost_variants_keep_the_dense_prefix_and_extrapolate_the_moe_layers(monkeypatch):
    """The TPU step estimate compiles two unrolled variants and extrapolates; DeepSeek-V3's 3
    dense first layers must stay in both (a 1-layer variant is no valid model: first_dense_layers
    3 >= 1 layer). Oracle: a cost that is exactly 7 + 10 per dense layer + 100 per MoE layer
    (the compile replaced by that count of the variant's layers) extrapolates to 7 + 3 x 10 +
    58 x 100 FLOPs, one microbatch."""
    from jaxtrain.planning import compile as compile_mod

    cfg = load_config(os.path.join(REPO, "configs", "deepseek-v3-671b.yaml"))
    built = []

    def compile_step(variant, *args):
        variant.model.validate()
        built.append(variant.model.n_layers)
        return variant

    def cost(variant):
        m = variant.model
        return {"flops": 7.0 + 10 * m.moe.first_dense_layers + 100 * m.moe.num_moe_layers(m)}

    monkeypatch.setattr(compile_mod, "_compile_step", compile_step)
    monkeypatch.setattr(compile_mod, "compiled_cost", cost)
    out = compile_mod._extrapolated_cost(cfg, None, None, "tpu")
    assert built == [4, 5]
    assert out["flops"] == 7 + 3 * 10 + 58 * 100 and out["flops per layer"] == 100
