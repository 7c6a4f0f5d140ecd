"""ZeRO-1 (`optimizer.shard_state`): the optimizer state split over `data`, parameters
replicated. Oracles: the single-device run (same losses and parameters), and the
byte count of the moments (the compiled per-device memory shrinks by their share)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.sharding.collectives import collectives_by_axes
from jaxtrain.sharding.targets import compiled_memory
from jaxtrain.trainer.batches import abstract_batch, batch_to_device
from tests.conftest import program_on_mesh, replace, tiny_config

STEPS = 3
# f32, 3 AdamW steps: sharded reductions change the summation order only.
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5


def cfg_for(shard_state: bool, data: int):
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=128", "model.vocab_size=128", "train.seq_len=32"
    )
    return replace(
        cfg,
        mesh=dict(data=data, rules="data_parallel"),
        optimizer=dict(shard_state=shard_state, warmup_steps=0),
    )


def run(cfg):
    """Losses of STEPS steps, final params, the state's shardings, compiled memory and HLO."""
    with program_on_mesh(cfg) as (program, state, data):
        initial = jax.device_get(state.params)
        compiled = program.step.lower(state, abstract_batch(cfg, program.batch_sharding)).compile()
        losses = []
        for _ in range(STEPS):
            state, metrics = program.step(state, batch_to_device(next(data), program.batch_sharding))
            losses.append(float(metrics["loss"]))
        mesh = program.batch_sharding.mesh
        ops = collectives_by_axes(compiled.as_text(), mesh)
        return dict(
            losses=losses,
            initial=initial,
            params=jax.device_get(state.params),
            opt_specs=jax.tree.map(lambda x: x.sharding.spec, state.opt_state),
            param_specs=jax.tree.map(lambda x: x.sharding.spec, state.params),
            opt_state=state.opt_state,
            memory=compiled_memory(compiled),
            ops=ops,
        )


@pytest.fixture(scope="module")
def runs():
    return {
        "one": run(cfg_for(False, 1)),
        "dp": run(cfg_for(False, 8)),
        "zero1": run(cfg_for(True, 8)),
    }


def test_shard_further_by_hand():
    mesh = jax.sharding.AbstractMesh((2, 4), ("fsdp", "data"))
    # the largest local dimension data divides, after the axes already there
    assert sharding.shard_further(P(), (8, 64), mesh) == P(None, "data")
    assert sharding.shard_further(P("fsdp"), (16, 12), mesh) == P("fsdp", "data")
    assert sharding.shard_further(P("fsdp"), (16, 6), mesh) == P(("fsdp", "data"))
    assert sharding.shard_further(P(), (6,), mesh) == P()  # data divides nothing: unchanged
    assert sharding.shard_further(P("data"), (8,), mesh) == P("data")  # already there
    assert sharding.shard_further(P(), (8,), mesh, "tensor") == P()  # no such axis


def test_memory_estimates_split_the_moments_over_data():
    """footprint's lower bound (the door check) and estimate (planner, remat: auto) both count
    ZeRO-1's moments split over data: hand-computed from the parameter count (f32 params,
    grads and the two Adam moments; 1/8 of the moments on data=8)."""
    from jaxtrain.planning import footprint

    plain = tiny_config(None, "train.loss_chunk=0")  # estimate takes a resolved loss_chunk
    zero1 = tiny_config(None, "train.loss_chunk=0", "optimizer.shard_state=true")
    n = plain.model.param_count()
    sizes = {"data": 8}
    assert footprint.estimate(plain, sizes).state == 16 * n
    assert footprint.estimate(zero1, sizes).state == 8 * n + 8 * n // 8
    assert footprint.lower_bound(plain, sizes).state == 16 * n
    assert footprint.lower_bound(zero1, sizes).state == int(4 * (2 + 2 / 8) * n)


@pytest.mark.composes("data+zero1", "adamw+zero1", "lm+zero1", "dense+zero1")
def test_zero1_matches_one_device_and_plain_data_parallelism(runs):
    one, dp, z = runs["one"], runs["dp"], runs["zero1"]
    np.testing.assert_allclose(z["losses"], one["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(z["losses"], dp["losses"], rtol=LOSS_RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=PARAM_ATOL), z["params"], one["params"])
    # the updates are real (lr 3e-3 from step 0): parameters moved, the loss fell
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), z["params"], z["initial"])
    assert min(jax.tree.leaves(moved)) > 1e-4
    assert one["losses"][-1] < one["losses"][0]


def test_zero1_shards_the_moments_over_data_and_replicates_params(runs):
    z = runs["zero1"]
    assert all(spec == P() for spec in jax.tree.leaves(z["param_specs"]))
    mu = z["opt_specs"][1][0].mu  # clip_by_global_norm, then (ScaleByAdamState, ...)
    assert all("data" in str(spec) for spec in jax.tree.leaves(mu))
    assert all(spec == P() for spec in jax.tree.leaves(runs["dp"]["opt_specs"]))


def test_zero1_saves_the_moments_share_of_per_device_memory(runs):
    """Plain DP holds every moment whole on each device; ZeRO-1 holds 1/8 of each one that
    data divides. The compiled arguments (the donated state) shrink by exactly that."""
    moments = [x for x in jax.tree.leaves(runs["zero1"]["opt_state"]) if x.ndim > 0]
    saved = sum(x.nbytes - x.addressable_shards[0].data.nbytes for x in moments)
    assert saved > 0.8 * sum(x.nbytes for x in moments) * 7 / 8  # nearly all moments split
    dp, z = runs["dp"]["memory"], runs["zero1"]["memory"]
    assert dp["argument"] - z["argument"] == saved
    assert z["total"] < dp["total"]


def test_zero1_gathers_updated_params_over_data(runs):
    """The communication ZeRO-1 trades for the memory: parameters come back whole with an
    all-gather over data (plain DP has none); gradients are still reduced over data."""
    kinds = lambda r: {(op.kind, op.axes) for op in r["ops"]}
    assert ("all-gather", ("data",)) in kinds(runs["zero1"])
    assert ("all-gather", ("data",)) not in kinds(runs["dp"])
    assert {("all-reduce", ("data",)), ("reduce-scatter", ("data",))} & kinds(runs["zero1"])
