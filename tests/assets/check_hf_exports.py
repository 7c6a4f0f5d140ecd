"""Does transformers load jaxtrain's exports with the same logits? (run by hand, with torch)

Step 1, in jaxtrain's venv, exports every asset through `models.to_hf`:
    .venv/bin/python tests/assets/check_hf_exports.py export /tmp/hf-exports
Step 2, with torch + transformers (see make_hf_assets.py), loads each export with
`AutoModelForCausalLM` (eager attention, float32) and compares its logits on tokens.npy with
the logits transformers computed from the original checkpoint (logits.npy):
    /tmp/hf311/bin/python tests/assets/check_hf_exports.py load /tmp/hf-exports
It prints the class transformers built and the largest difference, and fails above 1e-5.
"""

import sys
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).parent / "hf"
NAMES = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())


def export(out: Path) -> None:
    from jaxtrain import models

    for name in NAMES:
        models.to_hf(models.from_hf(ASSETS / name), out / name)
        print("exported", name)


def load(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    worst = 0.0
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(
            out / name, attn_implementation="eager", dtype=torch.float32
        )
        tokens = torch.tensor(np.load(ASSETS / name / "tokens.npy").astype(np.int64))
        with torch.no_grad():
            logits = model.eval()(tokens).logits.float().numpy()
        diff = float(np.abs(logits - np.load(ASSETS / name / "logits.npy")).max())
        worst = max(worst, diff)
        print(f"{name}: {type(model).__name__}, max |logit difference| {diff:.2e}")
    assert worst <= 1e-5, worst


if __name__ == "__main__":
    {"export": export, "load": load}[sys.argv[1]](Path(sys.argv[2]))
