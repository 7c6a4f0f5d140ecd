"""Megatron sequence parallelism (`mesh.rules=fsdp_tensor_sp`): the residual stream and its
norms split on seq over `tensor`. Oracles: the single-device loss and gradients, and the
definition of the technique read off the TPU compiler's program: where plain tensor
parallelism all-reduces a [batch, seq, embed] activation over tensor, sequence parallelism
reduce-scatters it, and all-gathers it back at the next tensor-parallel region's input."""

import jax
import numpy as np
import pytest

from jaxtrain.sharding import targets
from jaxtrain.sharding.collectives import collectives_by_axes
from jaxtrain.trainer.batches import batch_to_device
from tests.conftest import program_on_mesh
from tests.test_collectives import compiled_hlo, small_config

# f32: sharded reductions change the summation order only (as tests/test_sharded_training.py).
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6


def loss_and_grads(cfg):
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        return float(loss), jax.device_get(grads)


@pytest.mark.slow  # two compiles of the train program on 8 devices
@pytest.mark.composes(
    "lm+sequence_parallel",
    "dense+sequence_parallel",
    "data+sequence_parallel",
    "fsdp+sequence_parallel",
    "tensor+sequence_parallel",
)
def test_sequence_parallel_matches_one_device():
    ref_loss, ref_grads = loss_and_grads(small_config((), dict(data=1), "fsdp_tensor"))
    loss, grads = loss_and_grads(small_config((), dict(data=2, fsdp=2, tensor=2), "fsdp_tensor_sp"))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )


@pytest.mark.skipif(not targets.tpu_available(), reason="libtpu not installed")
def test_sequence_parallel_turns_tensor_all_reduces_into_reduce_scatters_on_tpu():
    devices = targets.tpu_topology_devices("v5p:2x2x1")  # 4 chips: data=2 x tensor=2
    ops = {}
    for rules in ("fsdp_tensor", "fsdp_tensor_sp"):
        cfg = small_config((), dict(data=2, tensor=2), rules)
        _, mesh, lowered = compiled_hlo(cfg, devices)
        ops[rules] = collectives_by_axes(lowered.compile().as_text(), mesh)
    # [batch per data shard, seq, d_model]: the residual stream's full (unsplit) shape
    residual = (cfg.train.global_batch_size // 2, cfg.train.seq_len, cfg.model.d_model)

    def count(rules, kind):
        dims = lambda op: tuple(int(d) for d in op.shape.split("[")[1].split("]")[0].split(","))
        return sum(op.kind == kind and op.axes == ("tensor",) and dims(op) == residual for op in ops[rules])

    tp_all_reduces = count("fsdp_tensor", "all-reduce")
    assert tp_all_reduces > 0 and count("fsdp_tensor", "reduce-scatter") == 0
    assert count("fsdp_tensor", "all-gather") == 0
    # every residual all-reduce of plain TP is a reduce-scatter under SP, and none is left
    assert count("fsdp_tensor_sp", "all-reduce") == 0
    assert count("fsdp_tensor_sp", "reduce-scatter") >= tp_all_reduces
    assert count("fsdp_tensor_sp", "all-gather") > 0
    # and no weight is gathered: every all-gather over tensor is a residual-stream activation
    gathers = [op for op in ops["fsdp_tensor_sp"] if op.kind == "all-gather"]
    assert all(op.shape.split("]")[0].endswith(",".join(map(str, residual))) for op in gathers), gathers
