"""Context parallelism in the whole model: the tiny config trained with
mesh.context > 1 (ring and Ulysses) gives the losses of mesh.context=1.

Oracle: the single-device run on the same data. The context run sees every
batch in zig-zag order (positions and segment ids travel with the tokens), so
only the order of f32 sums changes: rtol 1e-4 on the losses, as for the other
mesh-equivalence tests.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.trainer import train
from tests.conftest import tiny_config

LOSS_RTOL = 1e-4


def _cfg(tmp_path, name, *overrides):
    cfg = tiny_config(
        None,
        "model.d_model=64",
        "model.mlp_dim=128",
        "train.seq_len=32",
        "model.vocab_size=128",
        "train.steps=5",
        *overrides,
    )
    return dataclasses.replace(cfg, output_dir=str(tmp_path / name))


def _losses(cfg):
    n = max(cfg.mesh.data, 1) * max(cfg.mesh.context, 1) * max(cfg.mesh.fsdp, 1) * max(cfg.mesh.tensor, 1)
    return [r["loss"] for r in train(cfg, devices=jax.devices()[:n]).metrics]


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
    return _losses(_cfg(tmp_path_factory.mktemp("one"), "one"))


def test_ring_context4_matches_single_device(tmp_path, single_device_losses):
    losses = _losses(_cfg(tmp_path, "ring", "mesh.context=4"))
    print("context=1:", single_device_losses, "\ncontext=4 ring:", losses)
    np.testing.assert_allclose(losses, single_device_losses, rtol=LOSS_RTOL)
    assert single_device_losses[-1] < single_device_losses[0]


@pytest.mark.slow
def test_ulysses_data2_context2_matches_single_device(tmp_path, single_device_losses):
    losses = _losses(_cfg(tmp_path, "ulysses", "mesh.context=2", "mesh.data=2", "model.context_impl=ulysses"))
    np.testing.assert_allclose(losses, single_device_losses, rtol=LOSS_RTOL)


@pytest.mark.composes("lm+context", "dense+context", "data+context", "tensor+context", "context+adamw")
def test_ring_context2_tensor2_data2_matches_single_device(tmp_path, single_device_losses):
    """Context composes with tensor parallelism (heads split inside the ring's
    shard_map) and data parallelism on one 8-device mesh."""
    losses = _losses(
        _cfg(tmp_path, "ring_tp", "mesh.context=2", "mesh.tensor=2", "mesh.data=2", "mesh.fsdp=1")
    )
    np.testing.assert_allclose(losses, single_device_losses, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_ulysses_sliding_window_context2_matches_single_device(tmp_path):
    """Mistral-style sliding window under context parallelism (Ulysses sees the
    whole sequence per head, so the window is applied in sequence order)."""
    window = ("model.sliding_window=8",)
    one = _losses(_cfg(tmp_path, "win_one", *window))
    full = _losses(_cfg(tmp_path, "win_full"))
    losses = _losses(_cfg(tmp_path, "win_ulysses", *window, "mesh.context=2", "model.context_impl=ulysses"))
    np.testing.assert_allclose(losses, one, rtol=LOSS_RTOL)
    assert not np.allclose(one, full, rtol=LOSS_RTOL)  # the window changes the model


def test_config_validation():
    with pytest.raises(ConfigError, match="multiple of 2 \\* mesh.context"):
        tiny_config(None, "mesh.context=4", "train.seq_len=36")
    with pytest.raises(ConfigError, match="ulysses"):
        tiny_config(None, "mesh.context=8", "model.context_impl=ulysses")  # 4 heads
    with pytest.raises(ConfigError, match="context_impl"):
        tiny_config(None, "model.context_impl=zigzag")
    assert tiny_config(None, "mesh.context=2").mesh.context == 2
