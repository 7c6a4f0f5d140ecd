"""Write tests/golden/tiny_loss_curve.json from the current code: run it only after an
intended numerical change (and say so in the commit). Refuses to run in CI, so that CI can
never bless its own output.

    python tests/golden/regenerate.py
"""

import json
import os
import sys
import tempfile
from pathlib import Path

if os.environ.get("CI"):
    sys.exit("tests/golden/regenerate.py: refusing to rewrite the stored curve in CI (CI is set)")

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from jaxtrain.trainer import train  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.test_loss_curve import GOLDEN, STEPS  # noqa: E402

with tempfile.TemporaryDirectory() as out:
    losses = [r["loss"] for r in train(tiny_config(out), devices=jax.devices()[:1]).metrics][:STEPS]
GOLDEN.write_text(json.dumps({"config": "configs/tiny.yaml", "losses": losses}, indent=1) + "\n")
print(f"wrote {GOLDEN}: {len(losses)} losses, {losses[0]:.4f} -> {losses[-1]:.4f}")
