"""Does peft load jaxtrain's LoRA export with our logits? (run by hand, with torch + peft)

Step 1, in jaxtrain's venv: the oracle's final adapter (tests/assets/lora/final) is read into
our layout, perturbed by a fixed amount so that the export is ours and not a copy, written
back with `interchange.peft.write_adapter`, and our logits of the adapted tiny Llama on
tokens.npy are saved beside it:
    .venv/bin/python tests/assets/check_lora_export.py export /tmp/lora-export
Step 2, with torch + transformers + peft (see make_lora_assets.py): the base loads with
`PeftModel.from_pretrained(base, /tmp/lora-export)` and its logits are compared with ours:
    /tmp/hf311/bin/python tests/assets/check_lora_export.py load /tmp/lora-export
It prints the largest difference and fails above 1e-5.
"""

import sys
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).parent
BASE = ASSETS / "hf" / "llama_gqa_rope_llama3"


def export(out: Path) -> None:
    import dataclasses

    import jax
    from flax import nnx

    from jaxtrain import models
    from jaxtrain.interchange.peft import read_adapter, write_adapter
    from jaxtrain.models import lora
    from jaxtrain.models.hf import config_from_hf, load_hf_params, read_hf_config

    base_cfg = config_from_hf(read_hf_config(BASE))
    targets = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    cfg = dataclasses.replace(base_cfg, lora=models.config.LoRAConfig(rank=4, alpha=8, targets=targets))
    adapters = read_adapter(ASSETS / "lora" / "final", cfg)
    rng = np.random.default_rng(7)
    adapters = jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(np.float32), adapters)
    write_adapter(adapters, cfg, out, base=str(BASE))
    graphdef, abstract = models.abstract_model(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    model = models.merge(graphdef, abstract, lora.join(load_hf_params(BASE, base_cfg), adapters))
    tokens = np.load(BASE / "tokens.npy").astype(np.int32)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "logits.npy", np.asarray(model(tokens), np.float32))
    print("exported", out)


def load(out: Path) -> None:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(BASE, attn_implementation="eager", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    tokens = torch.tensor(np.load(out / "tokens.npy").astype(np.int64))
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    worst = float(np.abs(logits - np.load(out / "logits.npy")).max())
    print(f"{type(model).__name__} over {type(base).__name__}: max |logits - ours| = {worst:.3g}")
    if worst > 1e-5:
        sys.exit(f"FAIL: {worst} > 1e-5")


if __name__ == "__main__":
    {"export": export, "load": load}[sys.argv[1]](Path(sys.argv[2]))
