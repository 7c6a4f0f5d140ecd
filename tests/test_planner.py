"""`jaxtrain plan` and `model.remat: auto` (jaxtrain/planner.py, footprint.estimate).

Oracles: config validation and the compiler (CPU devices here, a deviceless H100 target in
the slow test), never the planner's own figures alone."""

import dataclasses
import os

import jax
import pytest
import yaml
from conftest import REPO, tiny_config

from jaxtrain.compile import compile_report, config_for_target, parse_target
from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.footprint import REMAT_BY_COST, estimate
from jaxtrain.planner import (
    MESH_ORDER,
    Candidate,
    apply,
    plan,
    resolve_remat,
    resolve_remat_for_devices,
    write_config,
)
from jaxtrain.sharding import targets

TINY = os.path.join(REPO, "configs", "tiny.yaml")
MiB = 2**20


def _auto(cfg, **train):
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat="auto"),
        train=dataclasses.replace(cfg.train, **train),
    )


def test_auto_is_the_default_and_picks_none_on_cpu_for_tiny_models():
    from jaxtrain.models.config import ModelConfig

    assert ModelConfig().remat == "auto"
    cfg, line = resolve_remat_for_devices(_auto(tiny_config()), jax.devices())
    assert cfg.model.remat == "none"
    assert line.startswith("model.remat=auto -> none") and "host memory / 8 simulated devices" in line


def test_auto_picks_a_saving_policy_when_memory_is_short_and_it_really_saves():
    """A device of 1.5 MiB (the planner's capacity parameter): `none` does not fit by the
    estimate, so auto walks REMAT_BY_COST to the first that does. Oracle: the CPU compiler's
    temp memory for the chosen policy is below that of `none`."""
    base = _auto(tiny_config())
    mesh = {"fsdp": 8}
    none_need = estimate(dataclasses.replace(base, model=dataclasses.replace(base.model, remat="none")), mesh)
    capacity = int(none_need.total / 0.9) - 1  # none misses by a byte
    cfg, line = resolve_remat(base, mesh, capacity, attention_impl="xla")
    chosen = cfg.model.remat
    assert chosen != "none" and chosen in REMAT_BY_COST, line
    assert estimate(cfg, mesh, attention_impl="xla").total <= 0.9 * capacity
    assert f"-> {chosen}" in line and "none needs" in line
    # Ample memory: none.
    assert resolve_remat(base, mesh, 100 * capacity)[0].model.remat == "none"

    from jaxtrain import head_sharding, sharding
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.train_step import abstract_batch, build_program

    def temp(c):
        c = dataclasses.replace(c, mesh=dataclasses.replace(c.mesh, fsdp=8))
        mesh_ = sharding.make_mesh({"fsdp": 8})
        rules = head_sharding.axis_rules(c, mesh_.shape)
        with jax.set_mesh(mesh_), sharding.axis_rules(rules):
            program = build_program(c, mesh_, rules)
            shapes = jax.eval_shape(program.init)
            state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                shapes,
                program.state_shardings,
            )
            compiled = program.step.lower(state, abstract_batch(c, program.batch_sharding)).compile()
        return compiled_memory(compiled)["temp"]

    none_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="none"))
    assert temp(cfg) < temp(none_cfg)


def test_auto_is_recorded_in_the_run_dir_and_logged(tmp_path, capsys):
    from jaxtrain.trainer import train

    cfg = _auto(tiny_config(tmp_path, "train.steps=2", "checkpoint.every=0"))
    train(cfg, devices=jax.devices()[:1])
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["remat"] == "none"
    captured = capsys.readouterr()
    assert "model.remat=auto -> none" in captured.out + captured.err


def test_rejected_shape_reasons_are_true():
    """tensor beyond kv_heads and a batch the data axes do not divide: the planner's reasons,
    and the config checks `jaxtrain compile` runs refuse the same candidates."""
    cfg = tiny_config()  # n_kv_heads=2, global batch 8
    p = plan(cfg, parse_target("tpu:v5p-8"), compile=False)
    reasons = {r.candidate: r.reason for r in p.rejected}
    mesh = lambda **s: tuple((a, s.get(a, 1)) for a in MESH_ORDER)
    heads = Candidate(mesh(tensor=4), "none", 1)
    batch = Candidate(mesh(fsdp=4), "none", 4)
    assert reasons[heads] == "tensor=4 > kv_heads=2"
    assert reasons[batch].startswith(
        "global batch 8 is not a multiple of data*fsdp*expert=4 x microbatches=4"
    )
    for cand, key in ((heads, "n_kv_heads"), (batch, "global_batch_size")):
        with pytest.raises(ConfigError, match=key):
            validate(apply(cfg, cand), num_devices=4)


def test_apply_writes_a_config_that_loads_to_the_pick(tmp_path):
    cfg = load_config(TINY)
    p = plan(cfg, parse_target("tpu:v5p-8"), compile=False)
    best = p.best.candidate
    out = tmp_path / "plan.yaml"
    write_config(cfg, best, out, source=TINY)
    loaded = load_config(out)
    overrides = [f"{k}={v}" for k, v in best.overrides().items()]
    assert loaded == load_config(TINY, overrides) == apply(cfg, best)
    validate(loaded, num_devices=4)


def test_cli_plan_no_compile_prints_the_table(tmp_path, capsys):
    from jaxtrain import cli

    out = tmp_path / "p.yaml"
    args = [
        "plan",
        TINY,
        "--target",
        "tpu:v5p-8",
        "--no-compile",
        "--show-rejected",
        "999",
        "--apply",
        str(out),
    ]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "ranked by the analytic model" in text and "tensor=4 > kv_heads=2" in text
    assert load_config(out).model.remat in REMAT_BY_COST


@pytest.mark.slow
@pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")
def test_pick_compiles_and_fits_and_a_memory_rejection_really_does_not_fit():
    """Deviceless H100 x 4, tiny model at seq 2048, device memory stated as 150 MiB: the
    estimate rejects remat none with one microbatch on the pick's mesh (analytic > 0.9 x 150
    MiB); the compiler agrees (it does not fit 150 MiB); the pick is compiled and fits.
    (Measured: none, fsdp=4, one microbatch: 187 MiB compiled; full: 70 MiB.)"""
    cfg = tiny_config(None, "train.seq_len=2048")
    target = parse_target("gpu:h100", gpus_per_host=4)
    hbm = 150 * MiB
    p = plan(cfg, target, top=1, hbm_bytes=hbm)
    best = p.best
    assert best is not None and best.compiled_bytes is not None and best.compiled_bytes <= hbm
    assert p.ranked_by == "analytic"  # GPU: no cost estimate
    mesh = best.candidate.mesh
    memory = [r for r in p.rejected if r.candidate.mesh == mesh and r.reason.startswith("analytic")]
    assert memory, [r.reason for r in p.rejected[:5]]
    rejected = memory[0]
    assert rejected.analytic_bytes > 0.9 * hbm
    r = compile_report(
        apply(cfg, rejected.candidate), dataclasses.replace(target, hbm_bytes=hbm), estimate=False
    )
    assert not r["fits"] and r["memory"]["total"] > hbm


def test_a_compiled_rejection_is_true():
    """With the analytic check out of the way (headroom 100), the compiler has the verdict on
    the fastest candidates; a row rejected as `compiled X GiB does not fit` really does not
    fit by a fresh compile of that candidate, and the pick really does (tiny model,
    deviceless v5p-8, device memory stated as 12 MiB)."""
    cfg = tiny_config()
    target = dataclasses.replace(parse_target("tpu:v5p-8"), hbm_bytes=12 * MiB)
    p = plan(cfg, target, top=1, headroom=100.0, charge_kernels=False)
    compiled = [r for r in p.rejected if r.reason.startswith("compiled")]
    assert compiled, [r.reason for r in p.rejected[:5]]
    row = compiled[0]
    assert row.reason == f"compiled {row.compiled_bytes / 2**30:.2f} GiB does not fit 0.01 GiB HBM"
    r = compile_report(apply(cfg, row.candidate), target, estimate=False)
    assert not r["fits"] and r["memory"]["total"] > 12 * MiB
    if p.best is not None:
        r = compile_report(apply(cfg, p.best.candidate), target, estimate=False)
        assert r["fits"] and r["memory"]["total"] <= 12 * MiB


def test_stage_is_searched_and_a_pipeline_candidate_compiles_as_estimated(tmp_path):
    """Four layers: stage 2 and 4 are in the space with their pipeline microbatches and
    schedules, stage 3 (not a divisor) is not; a pipeline candidate's overrides validate,
    compile deviceless, and its estimate is within the ratio measured on the pod presets
    (0.5x to 1.3x, README) of the compiler's figure."""
    cfg = tiny_config(None, "model.n_layers=4", "train.seq_len=512")
    p = plan(cfg, parse_target("tpu:v5p-8"), compile=False, top=10_000)
    rows = p.ranked + p.rejected
    staged = [r for r in rows if dict(r.candidate.mesh)["stage"] > 1]
    assert {dict(r.candidate.mesh)["stage"] for r in staged} == {2, 4}
    assert {r.candidate.pipeline[1:] for r in staged} == {("gpipe", 1), ("circular", 2)}
    assert all(r.candidate.microbatches == 1 for r in staged)
    best = min((r for r in staged if r.reason is None), key=lambda r: r.analytic_step_s)
    assert best.analytic_step_s >= min(r.analytic_step_s for r in p.ranked)  # bubble + recompute
    c = apply(cfg, best.candidate)
    validate(c, num_devices=4)
    assert c.mesh.stage > 1 and c.pipeline.microbatches == best.candidate.pipeline[0]
    write_config(cfg, best.candidate, tmp_path / "plan.yaml")  # --apply: the pipeline keys too
    assert load_config(tmp_path / "plan.yaml") == c
    r = compile_report(c, parse_target("tpu:v5p-8"), estimate=False)
    assert r["fits"]
    ratio = best.analytic_bytes / r["memory"]["total"]
    assert 0.5 <= ratio <= 1.3, (best.candidate, best.analytic_bytes, r["memory"])


@pytest.mark.parametrize(
    "preset, overrides, mesh, compiled_gib",
    [
        # compiled (args + temp) by `jaxtrain compile` deviceless, README "Pipeline parallelism"
        ("llama3-405b", [], {"stage": 2, "fsdp": 8, "tensor": 8}, 77.8),
        (
            "llama2-70b",
            ["train.global_batch_size=64", "mesh.stage=4", "mesh.fsdp=2", "mesh.tensor=8"],
            {"stage": 4, "fsdp": 2, "tensor": 8},
            36.8,
        ),
    ],
)
def test_the_door_check_splits_layers_over_stages(preset, overrides, mesh, compiled_gib):
    """The lower bound `jaxtrain train` checks at the door stays below what the compiler
    needs for pipelined presets that fit (405B on 16 x 8 H100 fits in 77.8 GiB; counting
    every layer's parameters and activations on each stage, the bound was 158 GiB and the
    door refused it; 70B on 8 x 8 H100: 226 GiB against 36.8 compiled)."""

    from jaxtrain.footprint import lower_bound

    cfg = load_config(os.path.join(REPO, "configs", f"{preset}.yaml"), overrides)
    bound = lower_bound(cfg, mesh).total / 2**30
    assert bound <= compiled_gib
    unstaged = lower_bound(cfg, {**mesh, "stage": 1}).total / 2**30
    assert unstaged > bound


@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.fsdp=4", "model.remat=full"],  # experts gathered whole, no exchange
        ["mesh.expert=4", "model.remat=full"],  # receive buffers of ep x A rows
        ["mesh.expert=4", "model.moe.receive_factor=1.25", "model.remat=none"],  # bounded receive
    ],
    ids=["fsdp", "expert", "receive_factor"],
)
def test_moe_estimate_is_near_the_compiled_memory(overrides):
    """The MoE terms of footprint.estimate (routed rows over the receive buffer, the experts
    gathered inside the shard_map, only the experts sharded over `expert`) against the
    deviceless TPU compiler. Dimensions are multiples of 128 so that TPU tile padding does
    not blur the comparison. Before these terms the estimate left out everything MoE-specific
    (the Mixtral preset read 0.33x of its compiled figure); 0.8x to 1.2x is the band the
    Mixtral plan's compiled candidates hold (README)."""
    cfg = load_config(
        os.path.join(REPO, "configs", "tiny-moe.yaml"),
        [
            "model.d_model=512",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.moe.expert_mlp_dim=512",
            "model.vocab_size=2048",
            "model.n_layers=4",
            "train.global_batch_size=8",
            "train.seq_len=512",
            *overrides,
        ],
    )
    target = parse_target("tpu:v5p-8")
    cfg, ici, _ = config_for_target(cfg, target)
    est = estimate(cfg, ici, attention_impl=cfg.model.attention_impl, platform="tpu").total
    got = compile_report(cfg, target, estimate=False)["memory"]["total"]
    assert 0.8 <= est / got <= 1.2, (overrides, est / MiB, got / MiB)


def test_analytic_step_charges_the_grouped_matmuls_padding_rows():
    """XLA costs the dropless grouped matmul over its whole receive buffer (ragged_dot and
    megablox's cost estimate alike: 2 x rows x k x n), so the analytic compute adds
    (r - 1) x 18 x top_k x D x F x MoE layers per token, r = receive rows / assignments:
    8 at expert=8 (the worst case), 1.25 with receive_factor=1.25, 1 without expert
    parallelism. Oracle: the formula by hand on the Mixtral preset, peak from the chip table."""
    from jaxtrain.planner import analytic_step
    from jaxtrain.sharding import hardware

    chip = hardware.chip("v5p")
    path = os.path.join(REPO, "configs", "mixtral-8x7b.yaml")
    m = load_config(path).model
    per_token = 18 * m.moe.top_k * m.d_model * m.moe.mlp_dim(m) * m.moe.num_moe_layers(m)
    tokens = 256 * 4096 / 64
    compute = {}
    for label, overrides, mesh in [
        ("fsdp", ["mesh.expert=1"], {"fsdp": 64}),
        ("ep8", [], {"fsdp": 8, "expert": 8}),
        ("ep8-rf1.25", ["model.moe.receive_factor=1.25"], {"fsdp": 8, "expert": 8}),
    ]:
        cfg = load_config(path, overrides)
        compute[label] = analytic_step(cfg, mesh, chip, 4)["compute_s"]
    peak = chip.peak_flops("bfloat16")
    assert compute["ep8"] - compute["fsdp"] == pytest.approx(7 * per_token * tokens / peak, rel=1e-9)
    assert compute["ep8-rf1.25"] - compute["fsdp"] == pytest.approx(
        0.25 * per_token * tokens / peak, rel=1e-9
    )


def test_moe_recompute_counts_the_expert_w_down_unless_mlp_out_is_kept():
    """The analytic recompute (planner.recompute_flops_per_token) by hand for Mixtral: the
    router weights' gradient needs the expert outputs, so policies without mlp_out redo the
    experts' w_down (2 D F top_k per token per MoE layer); minimal keeps every matmul output
    and redoes only attention (2 S H hd); dense models never redo w_down."""
    from jaxtrain.planner import recompute_flops_per_token

    cfg = load_config(os.path.join(REPO, "configs", "mixtral-8x7b.yaml"))
    m = cfg.model
    w_down = m.n_layers * 2 * m.d_model * m.moe.expert_mlp_dim * m.moe.top_k
    attention = m.n_layers * 2 * cfg.train.seq_len * m.n_heads * m.resolved_head_dim
    r = lambda remat, c=cfg: recompute_flops_per_token(c, remat)
    assert r("save_attention") - r("save_except_mlp_in") == pytest.approx(w_down)
    assert r("minimal") == pytest.approx(attention)
    assert r("save_except_mlp_in") > r("minimal")
    dense = load_config(os.path.join(REPO, "configs", "llama2-7b.yaml"))
    assert r("minimal", dense) == pytest.approx(dense.model.n_layers * 2 * dense.train.seq_len * 4096)


def test_cpu_remat_none_estimate_counts_the_gathered_weights():
    """On CPU under remat none the layers' fsdp-gathered matmul weights are residuals
    (models/layers.py matmul_weight), and footprint.estimate adds them: (layer parameters)
    x compute bytes / tensor. Oracle: the CPU compiler's temp memory with the gathered
    copies kept, less the same program without them (the partitioner's layout), is within
    75-100% of that term (the norms' scales are in the term, and XLA shares a few buffers)."""
    from unittest import mock

    from jaxtrain import head_sharding, sharding
    from jaxtrain.footprint import layer_stack_params
    from jaxtrain.models import layers
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.train_step import abstract_batch, build_program

    cfg = tiny_config(None, "model.remat=none", "model.compute_dtype=bfloat16")
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=8))
    mesh = sharding.make_mesh({"fsdp": 8})

    def temp():
        rules = head_sharding.axis_rules(cfg, mesh.shape)
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
            state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                jax.eval_shape(program.init),
                program.state_shardings,
            )
            compiled = program.step.lower(state, abstract_batch(cfg, program.batch_sharding)).compile()
        return compiled_memory(compiled)["temp"]

    term = layer_stack_params(cfg.model) * 2  # bf16, tensor = 1
    sizes = {"fsdp": 8}
    assert estimate(cfg, sizes, platform="cpu").saved - estimate(cfg, sizes, platform="tpu").saved == term
    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full"))
    assert estimate(full, sizes, platform="cpu") == estimate(full, sizes, platform="tpu")
    kept = temp()
    with mock.patch.object(layers, "on_cpu", lambda: False):
        partitioned = temp()
    assert 0.75 * term <= kept - partitioned <= term, (kept - partitioned, term)
