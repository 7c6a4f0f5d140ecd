"""Build the GRPO oracle in tests/assets/grpo/ (run once, commit the output).

A plain torch GRPO loop written from TRL's formulas (GRPOTrainer, TRL 1.16, without its
ratio correction of the KL) trains the tiny Hugging Face Llama of
tests/assets/hf/llama_gqa_rope_llama3 on a fixed rollout set: two rollouts of 2 prompts x 4
completions (random token ids, random rewards), each reused for two steps
(num_iterations = 2). Per completion token, with logp = log_softmax(logits / T):

    A     = (r - mean(group)) / (std(group, n - 1) + 1e-4)
    ratio = exp(logp - old)          old: the policy's logp when the rollout is first used
    loss  = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)

aggregated with loss_type=grpo (the mean over completions of each one's token mean). The
reference is a deep copy of the initial model under no_grad. tests/test_grpo.py runs
jaxtrain's GRPO step from the same weights on the same rollouts on a data x fsdp mesh and
compares each step's loss and gradient norm, and the final weights.

Needs torch + transformers, which the project does not depend on; on this machine:
    /tmp/hf311/bin/python tests/assets/make_grpo_assets.py

Float32 throughout. The optimizer is AdamW as jaxtrain sets it up (constant learning rate,
decay on matrices only, optax's global-norm clipping), as tests/assets/make_dpo_assets.py.
Output: expected.json.gz (rollouts, hyperparameters, per-step values) and final.safetensors
(the weights after the last step, HF names), gzip mtime 0 so a rerun writes the same bytes.
"""

import copy
import gzip
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

HERE = Path(__file__).parent
MODEL = HERE / "hf" / "llama_gqa_rope_llama3"
OUT = HERE / "grpo"

ROLLOUTS, PROMPTS, GROUP, SEQ, MU = 2, 2, 4, 16, 2
HPARAMS = dict(
    temperature=0.8,
    epsilon=0.03,
    epsilon_high=0.05,
    beta=0.1,
    loss_type="grpo",
    scale_rewards="group",
    lr=1e-3,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_norm=1.0,
)


def make_row(prompt, completion):
    """One completion as jaxtrain's rollout lays it out (batch_from_windows): inputs the
    tokens, targets the next ones, segment 1 and positions 0.. on the tokens, loss_mask 1
    where the target is a completion token."""
    ids = np.concatenate([prompt, completion])
    n = ids.size
    row = {k: np.zeros(SEQ, np.int64) for k in ("inputs", "targets", "positions", "segment_ids")}
    row["loss_mask"] = np.zeros(SEQ, np.float32)
    row["inputs"][:n] = ids
    row["targets"][: n - 1] = ids[1:]
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["loss_mask"][prompt.size - 1 : n - 1] = 1
    return row


def make_rollouts(rng):
    rollouts = []
    for _ in range(ROLLOUTS):
        rows = []
        for _ in range(PROMPTS):
            prompt = rng.integers(3, 128, size=rng.integers(3, 7))
            for _ in range(GROUP):
                rows.append(
                    make_row(prompt, rng.integers(3, 128, size=rng.integers(2, SEQ + 1 - prompt.size)))
                )
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        batch["rewards"] = rng.normal(size=PROMPTS * GROUP).astype(np.float32).round(3)
        rollouts.append(batch)
    return rollouts


def token_logps(model, batch, temperature):
    t = {k: torch.as_tensor(batch[k]) for k in ("inputs", "targets", "positions")}
    logits = model(input_ids=t["inputs"], position_ids=t["positions"]).logits.float() / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, t["targets"][..., None])[..., 0]


def main():
    torch.manual_seed(0)
    rollouts = make_rollouts(np.random.default_rng(54))
    policy = LlamaForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32, attn_implementation="eager")
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
    for batch in rollouts:
        mask = torch.as_tensor(batch["loss_mask"])
        r = torch.as_tensor(batch["rewards"]).view(-1, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        with torch.no_grad():
            old = token_logps(policy, batch, h["temperature"])
            ref = token_logps(reference, batch, h["temperature"])
        for _ in range(MU):
            logp = token_logps(policy, batch, h["temperature"])
            ratio = torch.exp(logp - old)
            clipped = torch.clamp(ratio, 1 - h["epsilon"], 1 + h["epsilon_high"])
            per_token = -torch.min(ratio * adv, clipped * adv)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_token = per_token + h["beta"] * kl
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
            low = (ratio < 1 - h["epsilon"]) & (adv < 0)
            high = (ratio > 1 + h["epsilon_high"]) & (adv > 0)
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
                    "grpo/kl": float((kl.detach() * mask).sum() / mask.sum()),
                    "grpo/clip_ratio": float(((low | high).float() * mask).sum() / mask.sum()),
                }
            )
            print(steps[-1])
    doc = {
        "model": str(MODEL.relative_to(HERE)),
        "hparams": h,
        "group_size": GROUP,
        "updates_per_rollout": MU,
        "rollouts": [{k: v.tolist() for k, v in b.items()} for b in rollouts],
        "steps": steps,
    }
    OUT.mkdir(exist_ok=True)
    data = json.dumps(doc, sort_keys=True).encode()
    with (
        open(OUT / "expected.json.gz", "wb") as f,
        gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as z,
    ):
        z.write(data)
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, OUT / "final.safetensors")


if __name__ == "__main__":
    main()
