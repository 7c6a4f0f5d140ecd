"""Build the GRPO + MoE oracle in tests/assets/grpo_moe/ (run once, commit the output).

The loop of make_grpo_assets.py (TRL 1.16's GRPO formulas, loss_type=grpo) on a tiny Hugging
Face Qwen3-MoE, with the router's load-balancing loss added as TRL 1.16's GRPOTrainer adds it
(`compute_loss`): the model runs with ``output_router_logits=True`` and each microbatch's
loss is ``policy loss / GA + router_aux_loss_coef x aux_loss / GA`` (GA: the gradient
accumulation steps), ``aux_loss`` being the model's own (`load_balancing_loss_func` with the
attention mask), not scaled by any token count.

The model: tests/assets/hf/qwen3_moe cut to its first layer (`one_layer_model`, which
tests/test_grpo.py repeats), with router_aux_loss_coef 0.05. One layer because HF pools the
router statistics of all layers before it multiplies them while jaxtrain averages the
layers' losses (the two agree for one MoE layer), and rows without padding because HF leaves
padding out of the statistics while jaxtrain's router counts every position. Two rollouts of
2 prompts x 4 completions, each reused for two steps, each step in GA = 2 microbatches of
rows m, m + 2, ... (train.microbatches=2 splits a batch so).

Needs torch + transformers; on this machine:
    /tmp/hf311/bin/python tests/assets/make_grpo_moe_assets.py

Output: expected.json.gz (rollouts, hyperparameters, per-step values) and final.safetensors
(the weights after the last step, as save_pretrained writes them).
"""

import copy
import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from make_grpo_assets import make_row
from safetensors.numpy import load_file, save_file
from transformers import Qwen3MoeForCausalLM

HERE = Path(__file__).parent
SOURCE = HERE / "hf" / "qwen3_moe"
OUT = HERE / "grpo_moe"

ROLLOUTS, PROMPTS, GROUP, SEQ, MU, GA = 2, 2, 4, 16, 2, 2
COEF = 0.05  # router_aux_loss_coef
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
    router_aux_loss_coef=COEF,
    microbatches=GA,
)


def one_layer_model(source: Path, dest: Path, coef: float) -> None:
    """`source` (an HF Qwen3-MoE directory) cut to its first layer, with router_aux_loss_coef
    `coef`, written to `dest` (config.json + model.safetensors)."""
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=1, router_aux_loss_coef=coef)
    weights = load_file(source / "model.safetensors")
    kept = {k: v for k, v in weights.items() if ".layers." not in k or ".layers.0." in k}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, dest / "model.safetensors")


def make_rollouts(rng):
    """Rows filled to SEQ tokens (no padding): prompt of 3..6 tokens, completion the rest."""
    rollouts = []
    for _ in range(ROLLOUTS):
        rows = []
        for _ in range(PROMPTS):
            prompt = rng.integers(3, 128, size=rng.integers(3, 7))
            for _ in range(GROUP):
                rows.append(make_row(prompt, rng.integers(3, 128, size=SEQ - prompt.size)))
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        batch["rewards"] = rng.normal(size=PROMPTS * GROUP).astype(np.float32).round(3)
        rollouts.append(batch)
    return rollouts


def forward(model, batch, rows, temperature):
    """(token log-probs at `temperature`, the model's aux_loss) of `rows` of `batch`."""
    t = {k: torch.as_tensor(batch[k][rows]) for k in ("inputs", "targets", "positions")}
    out = model(
        input_ids=t["inputs"],
        position_ids=t["positions"],
        attention_mask=torch.ones_like(t["inputs"]),
        output_router_logits=True,
    )
    logp = F.log_softmax(out.logits.float() / temperature, dim=-1)
    return torch.gather(logp, 2, t["targets"][..., None])[..., 0], out.aux_loss


def main():
    torch.manual_seed(0)
    rollouts = make_rollouts(np.random.default_rng(62))
    h = HPARAMS
    with tempfile.TemporaryDirectory() as tmp:
        one_layer_model(SOURCE, Path(tmp) / "model", COEF)
        policy = Qwen3MoeForCausalLM.from_pretrained(
            Path(tmp) / "model", dtype=torch.float32, attn_implementation="eager"
        )
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    decay = [p for p in policy.parameters() if p.ndim >= 2]
    no_decay = [p for p in policy.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": h["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=h["lr"],
        betas=(h["b1"], h["b2"]),
        eps=h["eps"],
    )
    micro = [np.arange(m, PROMPTS * GROUP, GA) for m in range(GA)]  # train.microbatches' split
    steps = []
    for batch in rollouts:
        r = torch.as_tensor(batch["rewards"]).view(-1, GROUP)
        adv_all = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        with torch.no_grad():
            old_all = forward(policy, batch, slice(None), h["temperature"])[0]
            ref_all = forward(reference, batch, slice(None), h["temperature"])[0]
        for _ in range(MU):
            opt.zero_grad()
            policy_loss, aux_losses = 0.0, []
            for rows in micro:
                mask = torch.as_tensor(batch["loss_mask"][rows])
                adv, old, ref = adv_all[rows], old_all[rows], ref_all[rows]
                logp, aux = forward(policy, batch, rows, h["temperature"])
                ratio = torch.exp(logp - old)
                clipped = torch.clamp(ratio, 1 - h["epsilon"], 1 + h["epsilon_high"])
                per_token = -torch.min(ratio * adv, clipped * adv)
                per_token = per_token + h["beta"] * (torch.exp(ref - logp) - (ref - logp) - 1)
                loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() / GA
                loss = loss + COEF * aux / GA  # TRL 1.16 compute_loss, aux_loss_enabled
                loss.backward()
                policy_loss += float(loss.detach() - COEF * aux.detach() / GA)
                aux_losses.append(float(aux.detach()))
            grads = [p.grad for p in policy.parameters()]
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
            if norm > h["clip_norm"]:  # optax.clip_by_global_norm
                for g in grads:
                    g.mul_(h["clip_norm"] / norm)
            opt.step()
            steps.append(
                {"loss": policy_loss, "grad_norm": float(norm), "aux_loss": float(np.mean(aux_losses))}
            )
            print(steps[-1])
    doc = {
        "source": str(SOURCE.relative_to(HERE)),
        "hparams": h,
        "group_size": GROUP,
        "updates_per_rollout": MU,
        "rollouts": [{k: v.tolist() for k, v in b.items()} for b in rollouts],
        "steps": steps,
    }
    OUT.mkdir(exist_ok=True)
    with (
        open(OUT / "expected.json.gz", "wb") as f,
        gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as z,
    ):
        z.write(json.dumps(doc, sort_keys=True).encode())
    with tempfile.TemporaryDirectory() as tmp:
        policy.save_pretrained(tmp)
        final = load_file(Path(tmp) / "model.safetensors")
    save_file(final, OUT / "final.safetensors")


if __name__ == "__main__":
    main()
