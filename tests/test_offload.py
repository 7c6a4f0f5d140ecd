"""Host offload through JAX memory kinds: `optimizer.offload(_params)` keeps the Adam
moments (and master weights) in pinned host memory, and `model.remat=offload_matmuls`
/ `custom` offloads saved activations. On CPU: the same losses as without offload,
the state really in `pinned_host`, and a checkpoint resume of an offloaded state.
Deviceless TPU compile: the offloaded bytes show as host memory in the program's
memory stats."""

import jax
import pytest

from jaxtrain.compile import compile_report, parse_target
from jaxtrain.sharding import targets
from jaxtrain.trainer import train
from tests.conftest import tiny_config

SMALL = ("model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128", "mesh.fsdp=2")
OFFLOAD = ("optimizer.offload=true", "optimizer.offload_params=true")


def run(tmp_path, name, *overrides):
    cfg = tiny_config(tmp_path / name, *SMALL, *overrides)
    return train(cfg, devices=jax.devices()[:2])


def test_offloaded_optimizer_state_trains_identically_and_resumes(tmp_path):
    ref = run(tmp_path, "ref", "train.steps=4")
    first = run(tmp_path, "off", "train.steps=2", "checkpoint.every=2", *OFFLOAD)
    moments = [x for x in jax.tree.leaves(first.state.opt_state) if x.ndim > 0]
    assert moments and all(x.sharding.memory_kind == "pinned_host" for x in moments)
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(first.state.params))
    resumed = run(tmp_path, "off", "train.steps=4", "checkpoint.every=2", *OFFLOAD)
    assert resumed.start_step == 2
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(resumed.state.params))
    losses = [m["loss"] for m in first.metrics + resumed.metrics]
    assert losses == [m["loss"] for m in ref.metrics]  # bit for bit


@pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
def test_offloaded_bytes_are_host_memory_in_the_compiled_program():
    target = parse_target("tpu:v5p-8")
    mem = {}
    for name, overrides in {
        "base": (),
        "opt": ("optimizer.offload=true",),
        "opt+params": OFFLOAD,
        "remat": ("model.remat=offload_matmuls",),
    }.items():
        mem[name] = compile_report(tiny_config(None, *overrides), target, estimate=False)["memory"]
    assert mem["base"]["host_total"] == 0
    # Adam's two moments (f32, like the params) leave HBM for pinned host memory.
    moved = mem["opt"]["host_argument"]
    assert moved > 0 and mem["opt"]["argument"] == pytest.approx(mem["base"]["argument"] - moved, rel=0.01)
    assert mem["opt+params"]["host_argument"] == pytest.approx(1.5 * moved, rel=0.01)
    assert mem["opt+params"]["argument"] < 0.01 * mem["base"]["argument"]
    # Offloaded activations: host temp buffers, less HBM temp.
    assert mem["remat"]["host_temp"] > 0 and mem["remat"]["temp"] < mem["base"]["temp"]
