"""Build the DPO oracle in tests/assets/dpo/ (run once, commit the output).

A plain torch implementation of DPO (TRL's sigmoid loss with label smoothing) trains the
tiny Hugging Face Llama of tests/assets/hf/llama_gqa_rope_llama3 for a few steps on fixed
preference batches, and records each step's loss, gradient norm and TRL's reward metrics
(taken before the step's update). tests/test_dpo.py runs jaxtrain's DPO step from the same
weights on the same batches and compares.

Needs torch + transformers, which the project does not depend on; on this machine:
    /tmp/hf311/bin/python tests/assets/make_dpo_assets.py

Everything is float32. The optimizer is AdamW as jaxtrain sets it up (trainer/optimizer.py)
with a constant learning rate (warmup 0, min_lr_ratio 1): weight decay on the matrices and
embeddings only (not the norm scales), decoupled and scaled by the learning rate as torch's
AdamW does; gradients clipped to global norm 1 with optax's rule (scaled by 1/norm when the
norm exceeds 1). The reference is a deep copy of the initial model, run under no_grad.
Output: expected.json.gz (batches and per-step values), gzip mtime 0 so a rerun writes the
same bytes.
"""

import copy
import gzip
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

HERE = Path(__file__).parent
MODEL = HERE / "hf" / "llama_gqa_rope_llama3"
OUT = HERE / "dpo"

STEPS, PAIRS, SEQ = 4, 4, 16
HPARAMS = dict(
    beta=0.5,
    label_smoothing=0.1,
    lr=2e-3,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_norm=1.0,
)


def make_sequence(prompt, response):
    """One sequence of n <= SEQ tokens as jaxtrain's pairs iterator lays it out (data/pairs.py):
    inputs the tokens, targets the next ones, segment 1 and positions 0.. on the tokens, loss_mask
    1 where the target is a response token, zeros after."""
    ids = np.concatenate([prompt, response])
    n = ids.size
    row = {k: np.zeros(SEQ, np.int64) for k in ("inputs", "targets", "positions", "segment_ids")}
    row["loss_mask"] = np.zeros(SEQ, np.float32)
    row["inputs"][:n] = ids
    row["targets"][: n - 1] = ids[1:]
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["loss_mask"][prompt.size - 1 : n - 1] = 1
    return row


def make_batches(rng):
    batches = []
    for _ in range(STEPS):
        fields = {k: np.zeros((PAIRS, 2, SEQ), np.float32 if k == "loss_mask" else np.int64)
                  for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}  # fmt: skip
        for p in range(PAIRS):
            prompt = rng.integers(3, 128, size=rng.integers(3, 9))
            for which in range(2):
                response = rng.integers(3, 128, size=rng.integers(2, SEQ + 1 - prompt.size))
                row = make_sequence(prompt, response)
                for k in fields:
                    fields[k][p, which] = row[k]
        batches.append(fields)
    return batches


def sequence_logps(model, batch):
    """[pairs, 2] sums of response-token log-probabilities."""
    flat = {k: torch.as_tensor(v.reshape(2 * PAIRS, SEQ)) for k, v in batch.items()}
    logits = model(input_ids=flat["inputs"], position_ids=flat["positions"]).logits.float()
    logp = torch.gather(F.log_softmax(logits, dim=-1), 2, flat["targets"][..., None])[..., 0]
    return (logp * flat["loss_mask"]).sum(-1).reshape(PAIRS, 2)


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(35)
    batches = make_batches(rng)
    policy = LlamaForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32, attn_implementation="eager")
    policy.train()  # no dropout in Llama; train mode only for clarity
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    h = HPARAMS
    decay = [p for p in policy.parameters() if p.ndim >= 2]
    no_decay = [p for p in policy.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": h["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=h["lr"],
        betas=(h["b1"], h["b2"]),
        eps=h["eps"],
    )
    steps = []
    for batch in batches:
        with torch.no_grad():
            ref = sequence_logps(reference, batch)
        logps = sequence_logps(policy, batch)
        ratios = logps - ref
        z = h["beta"] * (ratios[:, 0] - ratios[:, 1])
        ls = h["label_smoothing"]
        losses = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
        loss = losses.mean()
        rewards = h["beta"] * ratios.detach()
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in policy.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
        if norm > h["clip_norm"]:  # optax.clip_by_global_norm
            for g in grads:
                g.mul_(h["clip_norm"] / norm)
        opt.step()
        steps.append(
            {
                "loss": float(loss),
                "grad_norm": float(norm),
                "dpo/chosen_reward": float(rewards[:, 0].mean()),
                "dpo/rejected_reward": float(rewards[:, 1].mean()),
                "dpo/reward_margin": float((rewards[:, 0] - rewards[:, 1]).mean()),
                "dpo/accuracy": float((rewards[:, 0] > rewards[:, 1]).float().mean()),
            }
        )
        print(steps[-1])
    doc = {
        "model": str(MODEL.relative_to(HERE)),
        "hparams": h,
        "batches": [{k: v.tolist() for k, v in b.items()} for b in batches],
        "steps": steps,
    }
    OUT.mkdir(exist_ok=True)
    data = json.dumps(doc, sort_keys=True).encode()
    with (
        open(OUT / "expected.json.gz", "wb") as f,
        gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as z,
    ):
        z.write(data)


if __name__ == "__main__":
    main()
