"""Host offload through JAX memory kinds: `optimizer.offload(_params)` keeps the Adam
moments (and master weights) in pinned host memory, and `model.remat=offload_matmuls`
/ `custom` offloads saved activations. On CPU: the same losses as without offload,
the state really in `pinned_host`, and a checkpoint resume of an offloaded state.
Deviceless TPU and H100 compiles: the offloaded bytes show as host memory in the
program's memory stats."""

import jax
import pytest

from jaxtrain.planning.compile import compile_report, parse_target
from jaxtrain.sharding import targets
from jaxtrain.trainer import train
from tests.conftest import tiny_config

SMALL = ("model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128", "mesh.fsdp=2")
OFFLOAD = ("optimizer.offload=true", "optimizer.offload_params=true")


def run(tmp_path, name, *overrides):
    cfg = tiny_config(tmp_path / name, *SMALL, *overrides)
    return train(cfg, devices=jax.devices()[:2])


@pytest.mark.composes("lm+offload", "dense+offload", "fsdp+offload", "offload+adamw")
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


@pytest.mark.skipif(not targets.cuda_available(), reason="jax-cuda12-plugin not installed")
def test_offloaded_optimizer_state_is_host_memory_on_a_deviceless_h100():
    """Compile-only H100 devices list no memories, so JAX drops `pinned_host` from their
    shardings; the step then moves the offloaded state itself (jax.memory.Space). The
    oracle is the parameter count: the moments (2 x f32 per parameter) and the master
    weights (1 x f32) are host arguments, gone from HBM, and donated back."""
    target = parse_target("gpu:h100", gpus_per_host=2)
    cfg = lambda *o: tiny_config(None, "mesh.fsdp=2", "model.attention_impl=xla", *o)  # no Triton compile
    base, off = (compile_report(cfg(*o), target, estimate=False)["memory"] for o in ((), OFFLOAD))
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: _params(cfg()))))
    state = 3 * 4 * n_params / 2  # f32 params + 2 moments, every parameter split over fsdp=2
    assert base["host_total"] == 0 and base["argument"] == pytest.approx(state, rel=0.01)
    assert off["host_argument"] == pytest.approx(state, rel=0.01) and off["argument"] < 0.01 * state
    assert off["host_output"] == off["host_alias"] == off["host_argument"]  # donated back


def _params(cfg):
    from flax import nnx

    from jaxtrain import models

    return nnx.state(models.Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)
