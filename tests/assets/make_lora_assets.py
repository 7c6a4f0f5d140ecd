"""Build the LoRA oracle in tests/assets/lora/ (run once by hand, commit the output).

Needs torch + transformers + peft, which the project does not depend on; on this machine:
    /tmp/hf311/bin/python tests/assets/make_lora_assets.py
From the tiny HF Llama tests/assets/hf/llama_gqa_rope_llama3 (the base, float32, eager
attention) it writes:
  initial/        a PEFT adapter (r=4, alpha=8, every attention and MLP projection, no
                  dropout), saved by peft itself, with lora_B made non-zero so that the
                  adapter matters from step 0
  final/          the adapter after STEPS steps of torch AdamW over peft's trainable
                  parameters (constant lr, betas, eps, weight decay, global-norm clip 0.3,
                  below every step's norm, so that clipping over the adapters alone is tested)
  batches.npz     the STEPS batches in order: inputs, targets, loss_mask [steps, rows, seq]
  expected.json   per-step losses (the mean token cross-entropy over loss_mask, before each
                  step's update), the optimizer settings, the base's logits' fingerprint
The test (tests/test_lora.py) trains the same in jaxtrain on data=2 x fsdp=2 and compares.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

HERE = Path(__file__).parent
BASE = HERE / "hf" / "llama_gqa_rope_llama3"
OUT = HERE / "lora"
STEPS, ROWS, SEQ = 4, 8, 16
OPT = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=0.3)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batches(vocab: int) -> dict:
    rng = np.random.default_rng(35)
    tokens = rng.integers(0, vocab, size=(STEPS, ROWS, SEQ + 1))
    # a prompt of 2..8 tokens per row is not trained on (as chat SFT masks), the rest is
    prompt = rng.integers(2, 9, size=(STEPS, ROWS, 1))
    mask = (np.arange(SEQ)[None, None, :] >= prompt).astype(np.float32)
    return {
        "inputs": tokens[..., :-1].astype(np.int32),
        "targets": tokens[..., 1:].astype(np.int32),
        "loss_mask": mask,
    }


def masked_loss(model, inputs, targets, mask):
    logits = model(input_ids=torch.from_numpy(inputs).long()).logits.float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).long().reshape(-1), reduction="none"
    )
    m = torch.from_numpy(mask).reshape(-1)
    return (ce * m).sum() / m.sum()


def main():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM.from_pretrained(
        BASE, dtype=torch.float32, attn_implementation="eager"
    )
    base.eval()  # no dropout anywhere (the adapter has none either)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    model.save_pretrained(OUT / "initial")
    data = batches(base.config.vocab_size)
    np.savez_compressed(OUT / "batches.npz", **data)

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trainable,
        lr=OPT["lr"],
        betas=(OPT["b1"], OPT["b2"]),
        eps=OPT["eps"],
        weight_decay=OPT["weight_decay"],
    )
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = masked_loss(model, data["inputs"][step], data["targets"][step], data["loss_mask"][step])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, OPT["clip_norm"])))
        opt.step()
        losses.append(float(loss))
    model.save_pretrained(OUT / "final")
    for d in ("initial", "final"):  # the base's path is this machine's; keep the files stable
        (OUT / d / "README.md").unlink(missing_ok=True)
        cfg_path = OUT / d / "adapter_config.json"
        saved = json.loads(cfg_path.read_text())
        saved["base_model_name_or_path"] = "llama_gqa_rope_llama3"
        saved["target_modules"] = sorted(saved["target_modules"])
        cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    expected = {
        "base": str(BASE.relative_to(HERE)),
        "steps": STEPS,
        "optimizer": OPT,
        "losses": losses,
        "grad_norms": norms,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(json.dumps(expected, indent=2))


if __name__ == "__main__":
    main()
