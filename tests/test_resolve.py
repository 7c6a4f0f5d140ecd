"""planning/resolve.py: every `auto` setting resolved once, for where the program runs.

Oracles: the table of choices by platform stated in the module (each row checked), the
resolved config that `jaxtrain train` records (no `auto` left, the values of the log lines),
and the compiled programs themselves: a TPU program resolved here has no CPU program change
in it and runs the Pallas kernel, a CPU one has the CPU changes."""

import dataclasses

import jax
import pytest
import yaml

from jaxtrain.config import load_config
from jaxtrain.planning.footprint import estimate
from jaxtrain.planning.resolve import Placement, check_resolved, placement_of_devices, resolve
from jaxtrain.sharding import targets
from tests.conftest import REPO, replace, tiny_config

MOE = f"{REPO}/configs/tiny-moe.yaml"


@pytest.mark.parametrize(
    "platform,attention,cpu_tuning,exchange,grouped",
    [
        ("cpu", "xla", True, "padded", "ragged_dot"),
        ("gpu", "pallas", False, "ragged", "triton"),  # our Pallas grouped matmul (grouped_matmul_choice.py)
        ("tpu", "pallas", False, "ragged", "megablox"),
    ],
)
def test_platform_choices(platform, attention, cpu_tuning, exchange, grouped):
    resolution = resolve(load_config(MOE), Placement(platform, {"fsdp": 8}))
    m = resolution.config.model
    assert (m.attention_impl, m.cpu_tuning, m.moe.exchange, m.moe.grouped_matmul) == (
        attention,
        cpu_tuning,
        exchange,
        grouped,
    )
    notes = "\n".join(resolution.notes)
    assert f"model.cpu_tuning=auto -> {str(cpu_tuning).lower()}: " in notes
    assert f"model.attention_impl=auto -> {attention}: " in notes


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_latent_attention_with_a_narrower_value_keeps_the_flash_kernel(platform):
    """MLA's value head dim (v_head_dim) differs from its query/key one (nope + rope): the
    portable flash kernel takes that (TPU, Triton), cuDNN and the Hopper kernel do not, so auto
    keeps the platform's flash kernel and on a GPU runs it in Triton."""
    mla = (
        "model.n_kv_heads=4",
        "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=8",
    )
    for v in (8, 16):
        got = resolve(tiny_config(None, *mla, f"model.mla.v_head_dim={v}"), Placement(platform, {"fsdp": 8}))
        assert got.config.model.attention_impl == {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"}[platform]
        if platform == "gpu" and v == 8:
            assert got.config.model.gpu_flash_kernel == "triton"


@pytest.mark.parametrize(
    "platform,overrides,mesh,scanned,logged",
    [
        ("cpu", (), {}, True, True),
        ("tpu", (), {}, True, True),
        ("gpu", (), {}, False, True),  # 2 layers on one GPU: unrolled
        ("gpu", ("model.n_layers=32",), {}, False, True),  # UNROLL_MAX_LAYERS
        ("gpu", ("model.n_layers=33",), {}, True, True),  # deeper: one compiled layer body
        ("gpu", (), {"fsdp": 8}, True, True),  # several GPUs: scanned
        ("gpu", (), {"data": 2}, True, True),
        ("gpu", ("mesh.stage=2",), {"stage": 2}, True, False),  # stages loop themselves: unused, unlogged
    ],
)
def test_scan_layers_auto_unrolls_on_one_gpu_up_to_a_depth(platform, overrides, mesh, scanned, logged):
    """The table of the module docstring, row model.scan_layers; a value given is kept."""
    placement = Placement(platform, {"fsdp": 1, **mesh})
    resolution = resolve(tiny_config(None, *overrides), placement)
    assert resolution.config.model.scan_layers is scanned
    assert resolution.config.model.unrolled_layers is (not scanned)
    lines = [n for n in resolution.notes if n.startswith("model.scan_layers=")]
    expected = f"model.scan_layers=auto -> {str(scanned).lower()}: "
    assert len(lines) == logged and all(n.startswith(expected) for n in lines)
    given = resolve(tiny_config(None, *overrides, "model.scan_layers=true"), placement)
    assert given.config.model.scan_layers is True
    assert not any(n.startswith("model.scan_layers") for n in given.notes)


def test_scan_layers_refuses_anything_but_auto_true_or_false():
    with pytest.raises(ValueError, match=r"model.scan_layers='sometimes': expected auto, true or false"):
        tiny_config(None, "model.scan_layers=sometimes")


def test_a_setting_given_a_value_is_kept_and_not_logged():
    cfg = tiny_config(None, "model.attention_impl=pallas", "model.cpu_tuning=false", "train.loss_chunk=32")
    resolution = resolve(cfg, Placement("cpu", {}))
    assert resolution.config.model.attention_impl == "pallas"
    assert resolution.config.model.cpu_tuning is False
    assert resolution.config.train.loss_chunk == 32
    assert not any(
        n.startswith(("model.attention_impl", "model.cpu_tuning", "train.loss_chunk"))
        for n in resolution.notes
    )


GPU_ATTENTION = {
    "cudnn": ("model.compute_dtype=bfloat16",),
    "pallas_mosaic": ("model.compute_dtype=bfloat16", "model.head_dim=64"),
}


@pytest.mark.parametrize("impl", list(GPU_ATTENTION))
def test_a_gpu_attention_is_refused_for_a_program_that_runs_elsewhere(impl):
    """cuDNN's attention has no CPU lowering (a CPU run died with an internal error) and the
    Mosaic GPU kernel's interpreter never finished a CPU step in 10 minutes: for a CPU or TPU
    program resolution refuses either in one line naming it and what to use; for a GPU (what
    `jaxtrain compile --target gpu:*` resolves for) it is kept."""
    from jaxtrain.config import ConfigError

    cfg = tiny_config(None, f"model.attention_impl={impl}", *GPU_ATTENTION[impl])
    for platform, instead in [("cpu", "xla or auto"), ("tpu", "pallas (the Mosaic TPU flash kernel)")]:
        with pytest.raises(ConfigError, match=rf"model.attention_impl={impl}: .* runs only on .*GPUs") as e:
            resolve(cfg, Placement(platform, {}))
        assert f"this program runs on {platform.upper()}; expected {instead}" in str(e.value)
        assert "--target gpu:h100" in str(e.value) and "\n" not in str(e.value)
    assert resolve(cfg, Placement("gpu", {}, chip="h100")).config.model.attention_impl == impl


def test_every_auto_is_gone_after_resolving_and_the_builder_refuses_one_left():
    cfg = dataclasses.replace(
        load_config(MOE), model=dataclasses.replace(load_config(MOE).model, remat="auto")
    )
    resolved = resolve(cfg, Placement("cpu", {"fsdp": 8}, device_memory=2**30)).config
    check_resolved(resolved)
    values = lambda tree: [x for v in tree.values() for x in (values(v) if isinstance(v, dict) else [v])]
    assert "auto" not in values(dataclasses.asdict(resolved))
    with pytest.raises(ValueError, match=r"model.attention_impl=auto reached the program builder unresolved"):
        check_resolved(cfg)
    with pytest.raises(ValueError, match=r"train.loss_chunk=auto: resolve the config first"):
        estimate(cfg, {"fsdp": 8})


def test_remat_auto_needs_the_device_memory_and_a_resume_keeps_what_was_recorded():
    cfg = tiny_config(None, "model.remat=auto")
    unknown = resolve(cfg, Placement("cpu", {}))
    assert unknown.config.model.remat == "none"
    assert "model.remat=auto -> none: device memory unknown" in unknown.notes
    kept = resolve(cfg, Placement("cpu", {}, device_memory=1), recorded_remat="save_qkv_proj")
    assert kept.config.model.remat == "save_qkv_proj"
    assert any("as recorded by this run's earlier attempt" in n for n in kept.notes)


def test_placement_of_simulated_cpu_devices():
    p = placement_of_devices(tiny_config(None, "mesh.fsdp=-1", "mesh.tensor=2"), jax.devices())
    assert p.platform == "cpu"
    assert p.mesh_shape == {"data": 1, "stage": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    assert p.memory_source == "host memory / 8 simulated devices" and p.device_memory > 0


def test_the_run_records_the_resolved_values(tmp_path):
    """config.yaml holds what resolve chose, so a reader (and a resume) sees the program that ran."""
    from jaxtrain.trainer import train

    cfg = replace(tiny_config(tmp_path, "train.steps=1"), model=dict(remat="auto"))
    result = train(cfg, devices=jax.devices()[:1])
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["attention_impl"] == "xla" and saved["model"]["cpu_tuning"] is True
    assert saved["model"]["remat"] == "none" and saved["mesh"]["head_sharding"] == "embed"
    assert saved["train"]["loss_chunk"] == 0
    assert result.program is not None


@pytest.mark.deviceless
def test_a_tpu_program_has_no_cpu_change_and_runs_the_flash_kernel():
    """Resolved for a TPU slice by `jaxtrain compile`: the step holds the Pallas (Mosaic)
    kernel and no optimization barrier (the CPU changes' mark, in the program as lowered);
    the same config resolved for this CPU host holds the barriers."""
    if not targets.tpu_available():
        pytest.skip("libtpu not installed")
    from jaxtrain import sharding
    from jaxtrain.planning.compile import (
        config_for_target,
        lower_step,
        parse_target,
        resolved_for_target,
        target_mesh,
    )
    from jaxtrain.planning.resolve import resolve_for_mesh

    target = parse_target("tpu:v5p-8")
    cfg, ici, dcn = config_for_target(tiny_config(None, "mesh.fsdp=-1"), target)
    tpu_cfg, notes = resolved_for_target(cfg, target, ici, dcn)
    assert tpu_cfg.model.cpu_tuning is False and tpu_cfg.model.attention_impl == "pallas", notes
    tpu = lower_step(tpu_cfg, target_mesh(target, ici, dcn))
    assert "optimization_barrier" not in tpu.as_text()
    assert "tpu_custom_call" in tpu.compile().as_text()
    mesh = sharding.make_mesh({"fsdp": 4}, jax.devices()[:4])
    cpu_cfg = resolve_for_mesh(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=4)), mesh)
    assert cpu_cfg.model.cpu_tuning is True
    assert "optimization_barrier" in lower_step(cpu_cfg, mesh).as_text()
