"""Build the Muon oracle in tests/assets/muon/ (run once by hand, commit the output).

Needs torch >= 2.9 (torch.optim.Muon) + transformers, which the project does not depend on;
on this machine:
    /tmp/hf311/bin/python tests/assets/make_muon_assets.py
A tiny HF Llama (GQA: 4 query heads of 8 over 2 key heads, d_model 24, MLP 40, vocab 32,
2 layers; q_proj [32, 24] is tall, k_proj [16, 24] wide) trained for STEPS steps in float32:
  * torch.optim.Muon for the hidden matrices (q/k/v/o, gate/up/down of each layer), with
    every option passed explicitly (adjust_lr_fn "match_rms_adamw", momentum, nesterov,
    coefficients, eps, steps) and its Newton-Schulz iteration patched to run in float32
    (torch's runs in bfloat16; jaxtrain's default is float32);
  * torch.optim.AdamW for the rest: embeddings and LM head with weight decay, norm scales
    without;
  * global-norm clipping (torch.nn.utils.clip_grad_norm_) over all gradients first, at a
    norm that binds on the first steps;
  * one lr schedule for both, optax's warmup_cosine_decay_schedule written out below
    (jaxtrain's, optimizer.*), each optimizer's peak its own: AdamW optimizer.lr, Muon
    optimizer.muon.lr.
It writes:
  initial/       the model before training (config.json + model.safetensors)
  final/         after STEPS steps (model.safetensors)
  batches.npz    the STEPS batches in order: inputs, targets [steps, rows, seq]
  expected.json  per-step losses (mean token cross-entropy before each step's update), the
                 gradient norms before clipping, the settings
The test (tests/test_muon.py) trains the same in jaxtrain on data x fsdp and fsdp x tensor.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.optim._muon as torch_muon
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).parent
OUT = HERE / "muon"
STEPS, ROWS, SEQ = 12, 8, 16
OPT = dict(
    lr=1e-2,  # AdamW's peak (optimizer.lr)
    warmup_steps=2,
    min_lr_ratio=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,  # AdamW's (optimizer.weight_decay)
    clip_norm=0.5,
)
MUON = dict(
    lr=2e-2,
    weight_decay=0.05,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=[3.4445, -4.775, 2.0315],
    eps=1e-7,
    ns_steps=5,
    adjust_lr="match_rms_adamw",
)
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lr_at(step: int, peak: float) -> float:
    """optax.warmup_cosine_decay_schedule(0, peak, warmup, decay_steps=STEPS, peak * min_lr_ratio)
    at `step` (the update's count, from 0)."""
    warmup = OPT["warmup_steps"]
    if step < warmup:
        return peak * step / warmup
    alpha = OPT["min_lr_ratio"]
    t = min(step - warmup, STEPS - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * t / (STEPS - warmup)))
    return peak * ((1 - alpha) * cosine + alpha)


def newton_schulz_f32(grad, ns_coefficients, ns_steps, eps):
    """torch's `_zeropower_via_newtonschulz` with float32 in place of bfloat16, nothing else."""
    a, b, c = ns_coefficients
    ortho_grad = grad.float()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            initializer_range=0.1,
            attn_implementation="eager",
        )
    )
    with torch.no_grad():  # random norm scales, so that their AdamW updates matter
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return m.eval()


def main():
    assert hasattr(torch.optim, "Muon"), "torch >= 2.9 needed"
    torch_muon._zeropower_via_newtonschulz = newton_schulz_f32
    m = model()
    if OUT.exists():
        shutil.rmtree(OUT)
    m.save_pretrained(OUT / "initial", safe_serialization=True)
    (OUT / "initial" / "generation_config.json").unlink(missing_ok=True)
    rng = np.random.default_rng(55)
    tokens = rng.integers(0, m.config.vocab_size, size=(STEPS, ROWS, SEQ + 1))
    data = {"inputs": tokens[..., :-1].astype(np.int32), "targets": tokens[..., 1:].astype(np.int32)}
    np.savez_compressed(OUT / "batches.npz", **data)

    named = dict(m.named_parameters())
    hidden = [p for n, p in named.items() if n.split(".")[-2] in HIDDEN]
    decayed = [named["model.embed_tokens.weight"], named["lm_head.weight"]]
    undecayed = [p for n, p in named.items() if "norm" in n]
    assert len(hidden) + len(decayed) + len(undecayed) == len(named)
    muon = torch.optim.Muon(
        hidden,
        lr=MUON["lr"],
        weight_decay=MUON["weight_decay"],
        momentum=MUON["momentum"],
        nesterov=MUON["nesterov"],
        ns_coefficients=tuple(MUON["ns_coefficients"]),
        eps=MUON["eps"],
        ns_steps=MUON["ns_steps"],
        adjust_lr_fn=MUON["adjust_lr"],
    )
    adamw = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": OPT["weight_decay"]},
            {"params": undecayed, "weight_decay": 0.0},
        ],
        lr=OPT["lr"],
        betas=(OPT["b1"], OPT["b2"]),
        eps=OPT["eps"],
    )
    losses, norms = [], []
    for step in range(STEPS):
        for opt, peak in ((muon, MUON["lr"]), (adamw, OPT["lr"])):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, peak)
        muon.zero_grad()
        adamw.zero_grad()
        logits = m(input_ids=torch.from_numpy(data["inputs"][step]).long()).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.from_numpy(data["targets"][step]).long().reshape(-1)
        )
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(named.values()), OPT["clip_norm"])))
        muon.step()
        adamw.step()
        losses.append(float(loss))
    m.save_pretrained(OUT / "final", safe_serialization=True)
    for f in ("config.json", "generation_config.json"):  # initial/'s config describes both
        (OUT / "final" / f).unlink(missing_ok=True)
    expected = {
        "steps": STEPS,
        "optimizer": OPT,
        "muon": MUON,
        "losses": losses,
        "grad_norms": norms,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(json.dumps(expected, indent=2))


if __name__ == "__main__":
    main()
