"""`jaxtrain plan` and `model.remat: auto` (jaxtrain/planner.py, footprint.estimate).

Oracles: config validation and the compiler (CPU devices here, a deviceless H100 target in
the slow test), never the planner's own figures alone."""

import dataclasses
import os

import jax
import pytest
import yaml
from conftest import REPO, tiny_config

from jaxtrain.compile import compile_report, parse_target
from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.footprint import REMAT_BY_COST, estimate
from jaxtrain.planner import Candidate, apply, plan, resolve_remat, resolve_remat_for_devices, write_config
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

    from jaxtrain import sharding
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.train_step import abstract_batch, build_program

    def temp(c):
        c = dataclasses.replace(c, mesh=dataclasses.replace(c.mesh, fsdp=8))
        mesh_ = sharding.make_mesh({"fsdp": 8})
        rules = sharding.PRESETS[c.mesh.rules]
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
    heads = Candidate((("data", 1), ("fsdp", 1), ("tensor", 4), ("context", 1), ("expert", 1)), "none", 1)
    batch = Candidate((("data", 1), ("fsdp", 4), ("tensor", 1), ("context", 1), ("expert", 1)), "none", 4)
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
