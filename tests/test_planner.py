"""`jaxtrain plan` and `model.remat: auto` (planning/planner.py, planning/resolve.py,
footprint.estimate).

Oracles: config validation and the compiler (CPU devices here, a deviceless H100 target in
the slow test), never the planner's own figures alone."""

import dataclasses
import os

import jax
import pytest
import yaml
from conftest import REPO, tiny_config

from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.planning.compile import compile_report, config_for_target, parse_target
from jaxtrain.planning.footprint import REMAT_BY_COST, estimate, pipeline_inputs_held
from jaxtrain.planning.planner import MESH_ORDER, Candidate, apply, plan, write_config
from jaxtrain.planning.resolve import Placement, placement_of_devices, resolve
from jaxtrain.sharding import targets
from tests._deviceless_compiles import each_program_compiled_once

TINY = os.path.join(REPO, "configs", "tiny.yaml")
MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _each_program_compiled_once():
    """A program the planner compiles is not compiled again by the test that checks its verdict
    (test_a_compiled_rejection_is_true: the rejected row, and the pick where there is one),
    tests/_deviceless_compiles.py."""
    with each_program_compiled_once():
        yield


def _auto(cfg, **train):
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat="auto"),
        train=dataclasses.replace(cfg.train, **train),
    )


def resolve_remat(cfg, mesh, capacity):
    """(the config with model.remat resolved for a CPU device of `capacity` bytes, its line)."""
    resolution = resolve(cfg, Placement("cpu", mesh, capacity))
    return resolution.config, next(n for n in resolution.notes if n.startswith("model.remat"))


def test_auto_is_the_default_and_picks_none_on_cpu_for_tiny_models():
    from jaxtrain.models.config import ModelConfig

    assert ModelConfig().remat == "auto"
    resolution = resolve(_auto(tiny_config()), placement_of_devices(tiny_config(), jax.devices()))
    line = next(n for n in resolution.notes if n.startswith("model.remat"))
    assert resolution.config.model.remat == "none"
    assert line.startswith("model.remat=auto -> none") and "host memory / 8 simulated devices" in line


def test_auto_picks_a_saving_policy_when_memory_is_short_and_it_really_saves():
    """A device of 1.5 MiB (the planner's capacity parameter): `none` does not fit by the
    estimate, so auto walks REMAT_BY_COST to the first that does. Oracle: the CPU compiler's
    temp memory for the chosen policy is below that of `none`."""
    base = _auto(tiny_config(None, "mesh.fsdp=8"))
    mesh = {"fsdp": 8}
    none = resolve(
        dataclasses.replace(base, model=dataclasses.replace(base.model, remat="none")), Placement("cpu", mesh)
    )
    capacity = int(estimate(none.config, mesh).total / 0.9) - 1  # none misses by a byte
    cfg, line = resolve_remat(base, mesh, capacity)
    chosen = cfg.model.remat
    assert chosen != "none" and chosen in REMAT_BY_COST, line
    assert estimate(cfg, mesh).total <= 0.9 * capacity
    assert f"-> {chosen}" in line and "none needs" in line
    # Ample memory: none.
    assert resolve_remat(base, mesh, 100 * capacity)[0].model.remat == "none"

    from jaxtrain import sharding
    from jaxtrain.planning.resolve import axis_rules
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.trainer.batches import abstract_batch
    from jaxtrain.trainer.program import build_program

    def temp(c):
        mesh_ = sharding.make_mesh({"fsdp": 8})
        rules = axis_rules(c)
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


def test_apply_never_writes_over_its_input_and_asks_before_replacing(tmp_path, capsys):
    """`plan --apply` refuses the config it plans (even with --force) and an existing file
    (without --force), before the search, leaving both as they were."""
    from pathlib import Path

    from jaxtrain import cli

    mine = tmp_path / "mine.yaml"
    mine.write_text(Path(TINY).read_text())
    before = mine.read_text()
    argv = ["plan", str(mine), "--target", "tpu:v5p-8", "--no-compile", "--apply"]
    for force in ([], ["--force"]):
        assert cli.main([*argv, str(mine), *force]) == 2
        assert "that is the config being planned" in capsys.readouterr().err
    assert mine.read_text() == before
    existing = tmp_path / "plan.yaml"
    existing.write_text("kept\n")
    assert cli.main([*argv, str(existing)]) == 2
    assert "the file exists; pass --force to replace it" in capsys.readouterr().err
    assert existing.read_text() == "kept\n"
    assert cli.main([*argv, str(existing), "--force"]) == 0
    validate(load_config(existing), num_devices=4)


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
    (Measured: none, fsdp=4, one microbatch: 187 MiB compiled; full: 70 MiB.) The layer loop is
    scanned: unrolled, XLA keeps less than the estimate under none (docs/memory-and-precision.md)."""
    cfg = tiny_config(None, "train.seq_len=2048", "model.scan_layers=true")
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
    fit by a fresh compile_report of that candidate, and the pick really does (tiny model,
    deviceless v5p-8, device memory stated as 12 MiB). The report's config, program and
    lowering are made afresh; the device compiler's run on the lowered program, identical to
    the one the planner compiled, is not repeated (tests/_deviceless_compiles.py)."""
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
    (0.5x to 1.3x, docs/planning.md) of the compiler's figure."""
    cfg = tiny_config(None, "model.n_layers=4", "train.seq_len=512")
    p = plan(cfg, parse_target("tpu:v5p-8"), compile=False, top=10_000)
    rows = p.ranked + p.rejected
    staged = [r for r in rows if dict(r.candidate.mesh)["stage"] > 1]
    assert {dict(r.candidate.mesh)["stage"] for r in staged} == {2, 4}
    assert {r.candidate.pipeline[1:] for r in staged} == {
        ("gpipe", 1),
        ("circular", 2),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zero_bubble", 1),
    }
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


def test_each_schedule_holds_its_own_count_of_stage_inputs():
    """Hand counts of the [T/M, D] stage inputs a device keeps: gpipe and circular one per
    iteration (M R + S - 1); the 1f1b family a stash and an inbox, each of the most its table
    keeps alive at once on a stage (tests/test_pipeline_schedules.py counts them), whatever
    M: 1f1b S inputs and one gradient, zero_bubble S and S (gradients wait for the deferred
    W), interleaved_1f1b at S=4, R=2 8 and 3. The estimate differs between schedules by
    exactly that count x T/M x D x a."""
    assert [pipeline_inputs_held("gpipe", 4, m, 1) for m in (8, 32)] == [11, 35]
    assert pipeline_inputs_held("circular", 4, 8, 2) == 19
    held = [pipeline_inputs_held(s, 4, m, 1) for s in ("1f1b", "zero_bubble") for m in (8, 32)]
    assert held == [5, 5, 8, 8]
    assert [pipeline_inputs_held("interleaved_1f1b", 4, m, 2) for m in (8, 32)] == [11, 11]
    mesh = {"stage": 4}

    def saved(schedule, m):
        cfg = tiny_config(
            None, "model.n_layers=8", "train.loss_chunk=0", "mesh.stage=4", f"pipeline.schedule={schedule}"
        )
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, microbatches=m))
        return estimate(cfg, mesh).saved

    one = 8 * 128 // 32 * 128 * 4  # a microbatch of 8 x 128 tokens / 32, d_model 128, f32
    assert saved("gpipe", 32) - saved("1f1b", 32) == (35 - 5) * one
    assert saved("zero_bubble", 32) - saved("1f1b", 32) == (8 - 5) * one


def test_plan_ranks_1f1b_before_gpipe_when_it_holds_less():
    """Same mesh, remat and microbatches: 1f1b's analytic step equals gpipe's (the same
    bubble, (S-1)/(M+S-1)); its S inputs and one gradient buffered against gpipe's M+S-1
    make it the smaller, and so the first ranked, from M = 3 on (at M = 2 both hold S+1)."""
    cfg = tiny_config(None, "model.n_layers=4", "train.seq_len=512")
    p = plan(cfg, parse_target("tpu:v5p-8"), compile=False, top=10_000)
    by = {}
    for r in p.ranked:
        c = r.candidate
        if c.pipeline is not None:
            by[(c.mesh, c.remat, c.pipeline[0], c.pipeline[1])] = (r, p.ranked.index(r))
    pairs = [(k, v) for k, v in by.items() if k[3] == "1f1b" and (*k[:3], "gpipe") in by]
    assert pairs
    assert {key[2] // dict(key[0])["stage"] for key, _ in pairs} == {1, 2, 4}
    for key, (row, rank) in pairs:
        gpipe, gpipe_rank = by[(*key[:3], "gpipe")]
        assert row.analytic_step_s == pytest.approx(gpipe.analytic_step_s, rel=1e-12)
        if key[2] > 2:
            assert row.analytic_bytes < gpipe.analytic_bytes and rank < gpipe_rank
        else:
            assert row.analytic_bytes == gpipe.analytic_bytes


@pytest.mark.parametrize(
    "preset, overrides, mesh, compiled_gib",
    [
        # compiled (args + temp) by `jaxtrain compile` deviceless, docs/parallelism.md
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

    from jaxtrain.planning.footprint import lower_bound

    cfg = load_config(os.path.join(REPO, "configs", f"{preset}.yaml"), overrides)
    bound = lower_bound(cfg, mesh).total / 2**30
    assert bound <= compiled_gib
    unstaged = lower_bound(cfg, {**mesh, "stage": 1}).total / 2**30
    assert unstaged > bound


class _Device:
    """A device that holds `limit` bytes (what check_fits reads of a real one)."""

    platform, device_kind = "tpu", "TPU v5p"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.param_dtype=float32", "train.loss_chunk=0"],
        ["model.param_dtype=bfloat16", "train.loss_chunk=128"],
        ["model.param_dtype=float32", "optimizer.offload=true", "train.loss_chunk=auto"],
        ["model.param_dtype=bfloat16", "optimizer.offload=true", "optimizer.offload_params=true"],
        ["mesh.data=2", "mesh.fsdp=2", "optimizer.shard_state=true", "train.loss_chunk=128"],
        ["mesh.stage=2", "mesh.fsdp=2", "model.param_dtype=bfloat16", "train.loss_chunk=128"],
    ],
    ids=["f32", "bf16-chunked", "offload-auto-chunk", "bf16-offload-params", "zero1-chunked", "stages-bf16"],
)
def test_the_door_never_refuses_a_config_that_compiles_and_fits(overrides):
    """footprint.lower_bound, which `jaxtrain train` checks before building anything, is at
    most the memory the compiler gives the step (deviceless TPU v5p-8) for each parameter
    dtype, optimizer offload, loss chunking, ZeRO-1 and pipeline stages; so a device holding
    exactly that much passes the door. Before, the bound charged 4 bytes per parameter,
    gradient and moment whatever the dtype, the offloaded moments, and the whole f32 logits
    under a chunked loss: it was over the compiled figure in five of these six (bf16 with a
    chunked loss: a 169 MiB bound against 100 MiB compiled; now 53)."""
    from jaxtrain.planning.footprint import check_fits, lower_bound

    cfg = load_config(
        TINY,
        ["model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2", "model.mlp_dim=768",
         "model.n_layers=2",
         "model.vocab_size=16384", "model.compute_dtype=bfloat16", "model.remat=full", "train.seq_len=512",
         "train.global_batch_size=16", "mesh.fsdp=-1", *overrides],
    )  # fmt: skip
    target = parse_target("tpu:v5p-8")
    cfg, ici, _ = config_for_target(cfg, target)
    compiled = compile_report(cfg, target, estimate=False)["memory"]["total"]
    bound = lower_bound(cfg, ici).total
    assert bound <= compiled, (bound / MiB, compiled / MiB)
    check_fits(cfg, ici, _Device(compiled))
    with pytest.raises(ConfigError, match="needs at least"):
        check_fits(cfg, ici, _Device(bound - 1))


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
    Mixtral plan's compiled candidates hold (docs/planning.md)."""
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
    from jaxtrain.planning.compile import resolved_for_target

    target = parse_target("tpu:v5p-8")
    cfg, ici, dcn = config_for_target(cfg, target)
    est = estimate(resolved_for_target(cfg, target, ici, dcn)[0], ici, "tpu").total
    got = compile_report(cfg, target, estimate=False)["memory"]["total"]
    assert 0.8 <= est / got <= 1.2, (overrides, est / MiB, got / MiB)


def test_analytic_step_charges_the_grouped_matmuls_padding_rows():
    """The dropless grouped matmul runs over its whole receive buffer (R rows for A routed
    assignments: R = 8A at expert=8, the worst case; 1.25A with receive_factor=1.25; A
    without expert parallelism), and XLA's TPU cost model charges a Pallas kernel what its
    cost estimate declares. Oracle: megablox's own declared FLOPs (its gmm forward and the
    gmm + tgmm backward, traced at the Mixtral preset's per-device shapes) for R rows less
    for A rows, for the three expert weights of every MoE layer, is exactly what the analytic
    step adds to the compute time, at the chip table's peak."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.pallas_kernels.flash_attention import declared_costs
    from jaxtrain.pallas_kernels.grouped_matmul import megablox_grouped_matmul
    from jaxtrain.planning.planner import analytic_step
    from jaxtrain.sharding import hardware

    chip = hardware.chip("v5p")
    path = os.path.join(REPO, "configs", "mixtral-8x7b.yaml")
    m = load_config(path).model
    d, f, k = m.d_model, m.moe.mlp_dim(m), m.moe.top_k

    def declared(rows: int, experts: int) -> int:
        """megablox's declared FLOPs, forward and backward, for one expert weight."""
        grad = jax.grad(
            lambda a, w: jnp.sum(megablox_grouped_matmul(a, w, jnp.zeros((experts,), jnp.int32), full=True)),
            argnums=(0, 1),
        )
        args = (
            jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((experts, d, f), jnp.bfloat16),
        )
        return sum(v["flops"] for v in declared_costs(jax.make_jaxpr(grad)(*args)).values())

    assignments = 256 * 4096 // 64 * k  # per device: the preset's batch over 64 chips, top_k each
    compute = {}
    for label, overrides, mesh in [
        ("fsdp", ["mesh.expert=1"], {"fsdp": 64}),
        ("ep8", [], {"fsdp": 8, "expert": 8}),
        ("ep8-rf1.25", ["model.moe.receive_factor=1.25"], {"fsdp": 8, "expert": 8}),
    ]:
        cfg = load_config(path, overrides)
        compute[label] = analytic_step(cfg, mesh, chip, 4)["compute_s"]
    peak = chip.peak_flops("bfloat16")
    per_layer = lambda rows: 3 * (declared(rows, 1) - declared(assignments, 1))  # w_gate, w_up, w_down
    layers = m.moe.num_moe_layers(m)
    assert compute["ep8"] - compute["fsdp"] == pytest.approx(
        layers * per_layer(8 * assignments) / peak, rel=1e-9
    )
    assert compute["ep8-rf1.25"] - compute["fsdp"] == pytest.approx(
        layers * per_layer(int(1.25 * assignments)) / peak, rel=1e-9
    )


@pytest.mark.deviceless
def test_moe_recompute_counts_the_expert_w_down_unless_mlp_out_is_kept():
    """The analytic recompute (planner.recompute_flops_per_token): the router weights'
    gradient needs the expert outputs, so a policy that keeps everything but mlp_out redoes
    the experts' w_down (2 D F top_k per token per MoE layer). Oracle: the TPU compiler's
    cost analysis of the tiny MoE model's forward and backward, layers unrolled (so that the
    recompute is counted, not CSE'd), deviceless: save_attention less save_except_mlp_in."""
    if not targets.tpu_available():
        pytest.skip("libtpu not installed")
    from flax import nnx

    from jaxtrain import sharding
    from jaxtrain.planning.compile import resolved_for_target, target_mesh
    from jaxtrain.planning.planner import recompute_flops_per_token
    from jaxtrain.planning.resolve import axis_rules
    from jaxtrain.sharding.targets import compiled_cost
    from jaxtrain.trainer.batches import abstract_batch
    from jaxtrain.trainer.program import build_program

    target = parse_target("tpu:v5p-8")

    def flops(remat):
        """(XLA's FLOPs per device, the analytic recompute per device) under `remat`."""
        overrides = [f"model.remat={remat}", "model.scan_layers=false", "mesh.fsdp=-1", "train.seq_len=256"]
        cfg, ici, dcn = config_for_target(
            load_config(os.path.join(REPO, "configs", "tiny-moe.yaml"), overrides), target
        )
        cfg, _ = resolved_for_target(cfg, target, ici, dcn)
        mesh, rules = target_mesh(target, ici, dcn), axis_rules(cfg)
        with sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            params = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                nnx.to_pure_dict(program.abstract_params),
                program.state_shardings.params,
            )
            batch = abstract_batch(cfg, program.batch_sharding)
            compiled = program.loss_and_grads.lower(params, batch).compile()
        tokens = cfg.train.global_batch_size * cfg.train.seq_len / mesh.size
        return compiled_cost(compiled)["flops"], recompute_flops_per_token(cfg) * tokens

    (xla_attention_kept, analytic_attention_kept), (xla_all_but_mlp_in, analytic_all_but_mlp_in) = (
        flops("save_attention"),
        flops("save_except_mlp_in"),
    )
    analytic = analytic_attention_kept - analytic_all_but_mlp_in
    m = load_config(os.path.join(REPO, "configs", "tiny-moe.yaml")).model
    assert analytic == pytest.approx(m.n_layers * 2 * m.d_model * m.moe.expert_mlp_dim * m.moe.top_k * 512)
    assert xla_attention_kept - xla_all_but_mlp_in == pytest.approx(analytic, rel=1e-3)
    dense = load_config(
        os.path.join(REPO, "configs", "llama2-7b.yaml")
    )  # a dense MLP's output is never needed
    assert recompute_flops_per_token(dense, "save_attention") == recompute_flops_per_token(
        dense, "save_except_mlp_in"
    )


def test_cpu_remat_none_estimate_counts_the_gathered_weights():
    """With model.cpu_tuning in bfloat16 under remat none the layers' fsdp-gathered matmul
    weights are residuals (models/cpu_tuning.py gathered_weight), and footprint.estimate adds
    them: (layer parameters) x compute bytes / tensor. Oracle: the CPU compiler's temp memory
    with the gathered copies kept, less the same program without them (the partitioner's
    layout, every other CPU change kept), is within 75-100% of that term (the norms' scales
    are in the term, and XLA shares a few buffers)."""
    from unittest import mock

    from jaxtrain import sharding
    from jaxtrain.models.config import ModelConfig
    from jaxtrain.planning.footprint import layer_stack_params
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.trainer.batches import abstract_batch
    from jaxtrain.trainer.program import build_program

    mesh = sharding.make_mesh({"fsdp": 8})
    base = tiny_config(None, "model.remat=none", "model.compute_dtype=bfloat16", "mesh.fsdp=8")
    tuned, portable = (
        resolve_for_mesh(
            dataclasses.replace(base, model=dataclasses.replace(base.model, cpu_tuning=on)), mesh
        )
        for on in (True, False)
    )

    def temp(cfg):
        rules = axis_rules(cfg)
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
            state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                jax.eval_shape(program.init),
                program.state_shardings,
            )
            compiled = program.step.lower(state, abstract_batch(cfg, program.batch_sharding)).compile()
        return compiled_memory(compiled)["temp"]

    term = layer_stack_params(base.model) * 2  # bf16, tensor = 1
    sizes = {"fsdp": 8}
    assert estimate(tuned, sizes).saved - estimate(portable, sizes).saved == term
    full = lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, remat="full"))
    assert estimate(full(tuned), sizes) == estimate(full(portable), sizes)
    f32 = lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, compute_dtype="float32"))
    assert estimate(f32(tuned), sizes).saved == estimate(f32(portable), sizes).saved  # float32 keeps none
    kept = temp(tuned)
    with mock.patch.object(ModelConfig, "gathers_weights_once", property(lambda self: False)):
        partitioned = temp(tuned)
    assert 0.75 * term <= kept - partitioned <= term, (kept - partitioned, term)
