"""Sharded equals unsharded: one step's loss and gradients on several meshes
match the single-device run (oracle), and a few training steps give the same losses."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxtrain import sharding
from jaxtrain.trainer import train
from jaxtrain.trainer.batches import batch_to_device
from tests.conftest import program_on_mesh, replace, tiny_config

MESHES = [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]
# f32: sharded reductions change the summation order only.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6


def small_cfg(**mesh):
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128"
    )
    return replace(cfg, mesh=mesh)


def loss_and_grads(cfg):
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, count, grads = program.loss_and_grads(state.params, batch)
        specs = jax.tree.map(lambda g: g.sharding.spec, grads)
        return float(loss), jax.device_get(grads), specs


@pytest.fixture(scope="module")
def single_device():
    return loss_and_grads(small_cfg(data=1, fsdp=1, tensor=1))


@pytest.mark.parametrize("data,fsdp,tensor", MESHES, ids=lambda x: str(x))
def test_loss_and_grads_match_single_device(single_device, data, fsdp, tensor):
    ref_loss, ref_grads, _ = single_device
    loss, grads, specs = loss_and_grads(small_cfg(data=data, fsdp=fsdp, tensor=tensor))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )
    # The parameters really are sharded as the rules say (not silently replicated).
    wq = specs["blocks"]["attn"]["wq"]
    assert wq == sharding.logical_to_spec(
        ("layers", "embed", "heads", "head_dim"),
        sharding.DEFAULT_RULES,
        sharding.make_mesh(dict(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor]),
    )


def test_microbatches_match_one_batch(single_device):
    ref_loss, ref_grads, _ = single_device
    cfg = small_cfg(data=2, fsdp=2, tensor=1)
    loss, grads, _ = loss_and_grads(replace(cfg, train=dict(microbatches=2)))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )


@pytest.mark.composes(
    "lm+data",
    "lm+fsdp",
    "lm+tensor",
    "dense+data",
    "dense+fsdp",
    "dense+tensor",
    "data+fsdp",
    "data+tensor",
    "data+adamw",
    "fsdp+tensor",
    "fsdp+adamw",
    "tensor+adamw",
)
def test_training_losses_match_across_meshes(tmp_path):
    """Five AdamW steps of the tiny model: (2,2,2) mesh vs one device."""

    def losses(name, **mesh):
        cfg = replace(small_cfg(**mesh), train=dict(steps=5))
        cfg = dataclasses.replace(cfg, output_dir=str(tmp_path / name))
        n = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
        return [r["loss"] for r in train(cfg, devices=jax.devices()[:n]).metrics]

    one = losses("one", data=1, fsdp=1, tensor=1)
    many = losses("many", data=2, fsdp=2, tensor=2)
    np.testing.assert_allclose(many, one, rtol=1e-4)
    assert one[-1] < one[0]
