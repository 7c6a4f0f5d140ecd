"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared fixtures."""
import os

from jaxtrain.platform import has_accelerator

if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(tmp_path=None, *overrides: str):
    """configs/tiny.yaml with quiet logging, written under tmp_path."""
    base = ["logging.progress=false", "logging.tensorboard=false"]
    if tmp_path is not None:
        base.append(f"output_dir={tmp_path}")
    return load_config(os.path.join(REPO, "configs", "tiny.yaml"), [*base, *overrides])


@pytest.fixture
def repo_root():
    return REPO


def replace(cfg, **sections):
    """dataclasses.replace on nested sections: replace(cfg, train=dict(steps=3))."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v)
                                       for k, v in sections.items()})
