"""`jaxtrain compile`: deviceless AOT compiles of the real train step (TPU via libtpu,
H100 via the CUDA PJRT plugin). Skipped where those plugins are not installed."""

import json
import os

import pytest

from jaxtrain import cli
from jaxtrain.config import ConfigError
from jaxtrain.planning.compile import parse_target
from jaxtrain.sharding import targets
from tests._deviceless_compiles import each_program_compiled_once

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
LLAMA2_7B = os.path.join(REPO, "configs", "llama2-7b.yaml")
LLAMA2_70B = os.path.join(REPO, "configs", "llama2-70b.yaml")

needs_tpu = pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
needs_cuda = pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")


@pytest.fixture(autouse=True, scope="module")
def _each_program_compiled_once():
    """The tiny v5p-8 step that the CLI compiles in test_tiny_compiles_for_tpu_v5p_8 (and its 1-
    and 2-layer cost variants) is compiled once for the file: test_two_slices_put_data_parallelism_on_dcn
    compiles the same single-slice program and test_uncharged_kernels_drop_exactly_the_attention_flops
    the same charged variants (tests/_deviceless_compiles.py)."""
    with each_program_compiled_once():
        yield


def run_compile(capsys, *args):
    code = cli.main(["compile", *args, "--json"])
    out = capsys.readouterr().out.strip()
    return code, (json.loads(out.splitlines()[-1]) if out else None)


@pytest.mark.parametrize(
    "text, topology, chips",
    [
        ("tpu:v5p-8", "v5p:2x2x1", 4),
        ("tpu:v5p-64", "v5p:2x4x4", 32),
        ("tpu:v5p-256", "v5p:4x4x8", 128),
        ("tpu:v5p-512", "v5p:4x8x8", 256),
        ("tpu:v4-128", "v4:4x4x4", 64),
        ("tpu:v5e-256", "v5e:16x16", 256),
        ("tpu:v6e-64", "v6e:8x8", 64),
    ],
)
def test_parse_tpu_targets(text, topology, chips):
    t = parse_target(text)
    assert (t.topology, t.chips, t.num_devices) == (topology, chips, chips)


@pytest.mark.parametrize(
    "text, wraps",
    [
        ("tpu:v5p-8", False),
        ("tpu:v5p-64", False),
        ("tpu:v5p-128", True),
        ("tpu:v5p-512", True),
        ("tpu:v4-128", False),
    ],
)
def test_v5p_slices_from_4x4x4_are_tori(text, wraps):
    """MaxText's accelerator table: v5p slices of 4x4x4 and up wrap around in every dim;
    smaller v5p slices and v4 do not."""
    from jaxtrain.planning.compile import tpu_wraparound

    assert tpu_wraparound(parse_target(text)) == (wraps,) * 3


@needs_tpu
def test_weights_gather_with_all_gathers_on_a_v5p_128_torus():
    """An fsdp all-gather over a v5p-128 compiles to an `all-gather`. Compiled without the
    slice's wraparound (as before), XLA:TPU lowered every one as a zero broadcast +
    dynamic-update-slice + all-reduce, and estimated a Mixtral layer 8% slower than
    MaxText's at the same mesh. Oracle: the collectives of the compiled program."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import sharding
    from jaxtrain.planning.compile import target_devices

    mesh = sharding.make_mesh({"fsdp": 64}, target_devices(parse_target("tpu:v5p-128")))
    w = jax.ShapeDtypeStruct((8, 4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
    gather = jax.jit(lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())) * 2)
    text = gather.lower(w).compile().as_text()
    assert len(re.findall(r" all-gather(?:-start)?\(", text)) == 1
    assert "dynamic-update-slice(" not in text


def test_parse_bad_targets():
    for bad in ("tpu:v5p-6x", "tpu:v9-8", "gpu:v100", "h100", "tpu:v5p-24"):
        with pytest.raises(ConfigError, match="--target"):
            parse_target(bad)
    assert parse_target("gpu:h100", hosts=2, gpus_per_host=8).num_devices == 16


def test_config_error_exits_2(capsys):
    assert cli.main(["compile", TINY, "--target", "tpu:v5q-8"]) == 2
    assert "--target" in capsys.readouterr().err
    # tensor=3 does not divide the 4 chips of a v5p-8
    assert cli.main(["compile", TINY, "mesh.tensor=2", "mesh.fsdp=3", "--target", "tpu:v5p-8"]) == 2
    assert "does not equal the device count 4" in capsys.readouterr().err


def test_all_one_mesh_fills_fsdp_on_a_multi_device_target():
    """A mesh left at 1 everywhere (tiny.yaml, written for one device) gets mesh.fsdp filled
    to the devices per slice/host instead of failing on the device count; a mesh the user
    set is left alone."""
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import config_for_target

    cfg, ici, dcn = config_for_target(load_config(TINY), parse_target("tpu:v5p-8"))
    assert cfg.mesh.fsdp == ici["fsdp"] == 4 and dcn == {}
    cfg, ici, dcn = config_for_target(load_config(TINY), parse_target("tpu:v5p-8", slices=2))
    assert cfg.mesh.fsdp == ici["fsdp"] == 4 and dcn == {"data": 2}  # per slice; slices on DCN data
    big_batch = load_config(TINY, ["train.global_batch_size=16"])
    _, ici, _ = config_for_target(big_batch, parse_target("gpu:h100", hosts=2))
    assert ici["fsdp"] == 16  # one flat mesh over both hosts
    with pytest.raises(ConfigError, match="does not equal the device count 4"):
        config_for_target(load_config(TINY, ["mesh.tensor=2"]), parse_target("tpu:v5p-8"))


@needs_tpu
def test_tiny_compiles_for_tpu_v5p_8(capsys):
    code, r = run_compile(capsys, TINY, "mesh.fsdp=-1", "--target", "tpu:v5p-8")
    assert code == 0 and r["fits"] and r["num_devices"] == 4 and r["device_kind"].startswith("TPU v5")
    assert r["attention_impl"] == "pallas" and r["pallas_in_program"]  # auto resolved for the target
    assert 0 < r["memory"]["total"] < r["hbm_bytes"]
    assert "all-gather" in r["collectives"]  # FSDP gathers the weights
    # The 1-/2-layer extrapolation matches the analytic count (tiny, remat none: within 2x).
    assert 0.5 < r["xla_flops_over_model_flops"] < 2.0
    assert r["step_seconds_est"] > 0 and 0 < r["mfu_est"] < 1


@needs_cuda
def test_tiny_compiles_for_h100_1x8(capsys):
    code, r = run_compile(
        capsys, TINY, "mesh.fsdp=-1", "--target", "gpu:h100", "--hosts", "1", "--gpus-per-host", "8"
    )
    assert code == 0 and r["fits"] and r["num_devices"] == 8 and "H100" in r["device_kind"]
    assert r["pallas_in_program"] and r["step_seconds_est"] is None  # no cost analysis on GPU


@needs_tpu
def test_two_slices_put_data_parallelism_on_dcn(capsys):
    code, r = run_compile(
        capsys, TINY, "mesh.fsdp=-1", "--target", "tpu:v5p-8", "--slices", "2", "--no-estimate"
    )
    assert code == 0 and r["num_devices"] == 8
    assert r["mesh"] == {"data": 2, "fsdp": 4} and r["mesh_dcn"] == {"data": 2}
    # The gradient reduction across slices is a DCN (megascale) all-reduce in the compiled program;
    # a single slice has none.
    assert r["collectives"]["dcn-all-reduce"]["count"] > 0
    # tiny.yaml's all-1 mesh: compile fills mesh.fsdp itself and says so.
    _, single = run_compile(capsys, TINY, "--target", "tpu:v5p-8", "--no-estimate")
    assert not any(k.startswith("dcn-") for k in single["collectives"])
    assert single["mesh"] == {"fsdp": 4}
    assert any("filled mesh.fsdp=4" in note for note in single["notes"])


@needs_tpu
def test_uncharged_kernels_drop_exactly_the_attention_flops():
    """XLA charges a Mosaic kernel what its pl.CostEstimate says and nothing without one
    (MaxText's splash attention carries none). Leaving ours uncharged must remove exactly
    the attention kernels' FLOPs from a layer, counted by hand."""
    from jaxtrain import sharding
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import _extrapolated_cost, config_for_target, target_devices
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh

    t = parse_target("tpu:v5p-8")
    cfg, ici, _ = config_for_target(load_config(TINY, ["mesh.fsdp=-1", "model.attention_impl=pallas"]), t)
    mesh = sharding.make_mesh(ici, target_devices(t))
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    charged = _extrapolated_cost(cfg, mesh, rules, "tpu")
    free = _extrapolated_cost(cfg, mesh, rules, "tpu", charge_kernels=False)
    # Per device: batch 8 / 4 chips = 2, 4 query heads, seq 128 = one causal block, all of it
    # visited; head_dim 32. Matmuls of 128 x 128 x 32 per (batch, head):
    # forward 2 (QK^T, PV), and on TPU by default the fused backward's 5 (KQ^T, V dO^T,
    # P^T dO, dS^T Q, dS K; the split dQ + dK/dV kernels would be 3 + 4);
    # remat none, so nothing is recomputed.
    per_matmul = 2 * 128 * 128 * 32
    # (XLA's count differs by a few scalar FLOPs elsewhere in the two programs: 32 of 75.5M.)
    assert charged["flops per layer"] - free["flops per layer"] == pytest.approx(
        2 * 4 * (2 + 5) * per_matmul, rel=1e-5
    )
    assert free["optimal_seconds per layer"] < charged["optimal_seconds per layer"]


@needs_tpu
def test_two_slice_mesh_puts_slices_on_the_data_axis():
    from jaxtrain import sharding
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import config_for_target, target_devices

    t = parse_target("tpu:v5p-8", slices=2)
    _, ici, dcn = config_for_target(load_config(TINY, ["mesh.fsdp=-1"]), t)
    mesh = sharding.make_mesh(ici, target_devices(t), dcn_axis_sizes=dcn)
    data_axis = list(mesh.axis_names).index("data")
    for i in range(2):
        assert {d.slice_index for d in mesh.devices.take(i, axis=data_axis).flat} == {i}


@needs_tpu
def test_70b_on_v5p_8_does_not_fit(capsys):
    code = cli.main(
        ["compile", LLAMA2_70B, "train.global_batch_size=16", "--target", "tpu:v5p-8", "--no-estimate"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT" in out and "over" in out
    assert "GiB over" in out
    assert "use at least ~17 devices" in out  # names the knob that would help: more devices


@pytest.mark.slow
@needs_tpu
def test_llama2_7b_fits_on_v5p_64(capsys):
    code, r = run_compile(capsys, LLAMA2_7B, "--target", "tpu:v5p-64", "--no-estimate")
    assert code == 0 and r["fits"] and r["num_devices"] == 32 and r["per_device_batch"] == 4
    assert r["memory"]["total"] < 17.0 * 2**30  # MaxText 0.2.5, same batch/seq/remat: 17.0 GiB
    assert r["pallas_in_program"]


@pytest.mark.slow
@needs_cuda
def test_llama2_7b_fits_on_2x8_h100(capsys):
    code, r = run_compile(
        capsys,
        LLAMA2_7B,
        "train.global_batch_size=64",
        "--target",
        "gpu:h100",
        "--hosts",
        "2",
        "--gpus-per-host",
        "8",
    )
    assert code == 0 and r["fits"] and r["num_devices"] == 16 and r["per_device_batch"] == 4
    assert r["memory"]["total"] < 36.3 * 2**30  # MaxText 0.2.5, same batch/seq/remat: 36.3 GiB
    assert r["attention_impl"] == "cudnn" and r["cudnn_in_program"]  # the GPU dispatcher's pick


# --- decode: prefill + one decode step over a KV cache (`--mode decode`) -----------------


def _kv_bytes_by_hand(layers, batch, kv_heads, max_len, head_dim, itemsize, shards):
    return 2 * layers * batch * kv_heads * max_len * head_dim * itemsize // shards


@pytest.mark.deviceless
@needs_tpu
def test_decode_compile_for_tpu_v5p_8(capsys):
    """tiny (2 layers, 2 kv heads of 32, float32) at batch 64 x 4096 on 4 chips: the batch
    over fsdp=4, so a quarter of the cache per device, as the compiled step's arguments say;
    the decode step updates the donated cache in place (no second copy in temp)."""
    decode = ["--target", "tpu:v5p-8", "--mode", "decode", "--batch", "64", "--max-len", "4096"]
    code, r = run_compile(capsys, TINY, "mesh.fsdp=-1", *decode, "--prompt-len", "256")
    assert code == 0 and r["fits"] and r["mode"] == "decode" and r["num_devices"] == 4
    kv = _kv_bytes_by_hand(2, 64, 2, 4096, 32, 4, shards=4)
    assert r["kv_cache_shards"] == 4 and r["kv_cache_bytes"] == 4 * kv
    assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes_per_device_compiled"] == kv
    assert r["attention_impl"] == "pallas" and (r["prompt_len"], r["cache_len"]) == (256, 4096)
    dec, pre = r["decode"]["memory"], r["prefill"]["memory"]
    assert dec["alias"] >= kv and dec["temp"] < kv / 4  # donated and written in place
    assert pre["output"] >= kv and kv < dec["total"] < 1.1 * kv + r["param_bytes_per_device"]
    # A sliding window caps the cache at the window (a ring), whatever --max-len says.
    code, r = run_compile(capsys, TINY, "mesh.fsdp=-1", "model.sliding_window=64", *decode[:-1], "256")
    assert code == 0 and r["cache_len"] == 64 and r["prompt_len"] == 256
    assert r["kv_cache_bytes_per_device_compiled"] == _kv_bytes_by_hand(2, 64, 2, 64, 32, 4, shards=4)


@pytest.mark.deviceless
@needs_cuda
def test_decode_compile_for_h100_1x8_tensor_parallel(capsys):
    """batch over fsdp=4 and the 2 kv heads over tensor=2: an eighth of the cache per GPU."""
    mesh = ["mesh.fsdp=4", "mesh.tensor=2", "model.compute_dtype=bfloat16"]
    decode = ["--mode", "decode", "--batch", "64", "--max-len", "4096", "--prompt-len", "256"]
    code, r = run_compile(capsys, TINY, *mesh, "--target", "gpu:h100", *decode)
    assert code == 0 and r["fits"] and r["num_devices"] == 8 and "H100" in r["device_kind"]
    kv = _kv_bytes_by_hand(2, 64, 2, 4096, 32, 2, shards=8)
    assert r["kv_cache_spec"] == "P(None, 'fsdp', 'tensor')"
    assert r["kv_cache_bytes_per_device"] == r["kv_cache_bytes_per_device_compiled"] == kv
    assert r["decode"]["memory"]["alias"] >= kv and r["decode"]["memory"]["temp"] < kv


def test_decode_compile_bad_arguments_exit_2(capsys):
    base = [TINY, "--target", "tpu:v5p-8", "--mode", "decode"]
    assert cli.main(["compile", *base, "--batch", "8"]) == 2
    assert "expected --batch B and --max-len L" in capsys.readouterr().err
    assert cli.main(["compile", *base, "--batch", "8", "--max-len", "16", "--prompt-len", "32"]) == 2
    assert "--prompt-len=32: expected at most --max-len=16" in capsys.readouterr().err
    assert cli.main(["compile", *base, "--batch", "0", "--max-len", "16"]) == 2
    assert "--batch=0" in capsys.readouterr().err
    assert cli.main(["compile", TINY, "mesh.context=2", *base[1:], "--batch", "8", "--max-len", "16"]) == 2
    assert "generation needs mesh.context=1" in capsys.readouterr().err
