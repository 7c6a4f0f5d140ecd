"""A known-good loss curve: configs/tiny.yaml's first 20 losses, stored.

Regenerate (only after an intended numerical change, and say so in the commit):
    JAXTRAIN_UPDATE_GOLDEN=1 make test ARGS=tests/test_loss_curve.py
"""

import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxtrain.trainer import train
from tests.conftest import tiny_config

GOLDEN = Path(__file__).parent / "golden" / "tiny_loss_curve.json"
# Same pinned XLA on CPU: differences come only from CPU vector width / thread
# count changing reduction order, far below 1e-4 relative.
RTOL = 1e-4


def test_tiny_config_loss_curve_matches_golden(tmp_path):
    cfg = tiny_config(tmp_path)
    losses = [r["loss"] for r in train(cfg, devices=jax.devices()[:1]).metrics][:20]
    if os.environ.get("JAXTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"config": "configs/tiny.yaml", "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    np.testing.assert_allclose(losses, golden, rtol=RTOL)
    assert golden[-1] < golden[0] - 1.0, "the tiny model should learn the synthetic task"
