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

    /tmp/hf311/bin/python tests/assets/make_lora_assets.py qwen3_5
writes tests/assets/lora_qwen3_5/ instead (`llama` the above; no argument: both): from the tiny
HF Qwen3.5 hybrid tests/assets/hf/qwen3_5_hybrid (gated DeltaNet layers, a full-attention
layer whose q_proj holds query and gate rows), a PEFT adapter (r=4, alpha=8) on every
projection, the DeltaNet ones included (HYBRID_TARGETS), lora_B drawn at random, and
  adapter/         the adapter as peft saves it
  expected.npz     tokens [2, 72] (over a 64-token chunk of the delta rule) and peft's logits
  expected.json    the versions that made it
"""

import json
import shutil
import sys
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
HYBRID_BASE = HERE / "hf" / "qwen3_5_hybrid"
HYBRID_OUT = HERE / "lora_qwen3_5"
HYBRID_TARGETS = [*TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


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


def versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def randomize_b(model, seed: int, std: float = 0.05) -> None:
    """lora_B drawn from N(0, std) (peft starts it at zero, where the adapter does nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def stable_config(path: Path, base: str) -> None:
    """adapter_config.json without this machine's base path, target_modules sorted."""
    saved = json.loads(path.read_text())
    saved["base_model_name_or_path"] = base
    saved["target_modules"] = sorted(saved["target_modules"])
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def hybrid():
    """tests/assets/lora_qwen3_5/ (module docstring): peft's adapter over the Qwen3.5 hybrid's
    gated DeltaNet projections and gated q_proj, and the logits peft computes with it."""
    torch.manual_seed(0)
    base = transformers.Qwen3_5ForCausalLM.from_pretrained(
        HYBRID_BASE, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=HYBRID_TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, config).eval()
    randomize_b(model, seed=2)
    tokens = np.random.default_rng(3).integers(0, base.config.vocab_size, size=(2, 72)).astype(np.int32)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(tokens).long()).logits.float().numpy()
    if HYBRID_OUT.exists():
        shutil.rmtree(HYBRID_OUT)
    HYBRID_OUT.mkdir(parents=True)
    model.save_pretrained(HYBRID_OUT / "adapter")
    (HYBRID_OUT / "adapter" / "README.md").unlink(missing_ok=True)
    stable_config(HYBRID_OUT / "adapter" / "adapter_config.json", HYBRID_BASE.name)
    np.savez_compressed(HYBRID_OUT / "expected.npz", tokens=tokens, logits=logits.astype(np.float32))
    expected = {"base": str(HYBRID_BASE.relative_to(HERE)), "targets": HYBRID_TARGETS, "versions": versions()}
    (HYBRID_OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print("qwen3_5 hybrid: max |logit|", float(np.abs(logits).max()))


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
    for name in sys.argv[1:] or ["llama", "qwen3_5"]:
        {"llama": main, "qwen3_5": hybrid}[name]()
