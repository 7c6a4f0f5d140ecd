"""GRPO on the CPU: the sampler's speed and where a step's time goes.

    python benchmarks/grpo.py [--steps 10] [--batch 64] [--seq-len 40] [--max-new-tokens 8]

Trains the GRPO example of docs/grpo.md (notebooks/rl_grpo.ipynb: configs/tiny.yaml with a
320-token vocab, the letters prompts of tests/assets/grpo, the `letter_share` reward, groups
of 8) for `--steps` steps with `grpo.beta=0.05`, so each step also scores the rows under the
frozen reference, and `logging.every=1`. Reports

- `speed`: the sampler's tokens/s (`grpo/sample_tokens_per_second`: generated tokens over
  the sampler's call, the old log-probs not included), its median over the rollouts after the
  first (the first compiles the sampler) and the first one's, the sampler's seconds per
  rollout (generated tokens over that rate) and the median step time (steps 2..N: the
  rollout and the update);
- `split`: the run's wall time by goodput bucket (output_dir/goodput.json,
  observe/goodput.py): `sample` is the rollouts (the sampler and the old log-probs, the first
  rollout's compiles included), `steps` the updates (the compiled train step: the rollout
  waits for the update it samples from under `steps`). The reference
  log-probs are computed inside that same compiled step (trainer/grpo.py
  `reference_logps`), so no bucket or metric separates them: the table says so instead of
  a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

try:  # imported as benchmarks.grpo (the tests)
    from benchmarks import result_file
except ImportError:  # run as a script: its folder is on the path
    import result_file

SPEED_HEADER = [
    "steps",
    "rows per rollout",
    "max new tokens",
    "sampler tokens/s, median of rollouts 2..N",
    "first rollout tokens/s",
    "sampler s per rollout, median of 2..N",
    "median step s (2..N)",
]
SPLIT_HEADER = ["part", "seconds", "per step s", "share of wall", "what it holds"]
# goodput buckets in the order the table shows them, and what each holds in a GRPO run
PARTS = (
    ("sample", "the rollouts: the sampler and the old log-probs (the first rollout's compiles included)"),
    ("steps", "the updates: the compiled train step (the reference log-probs inside it)"),
    ("reference", None),
    ("compile", "the train step's compile"),
    ("startup", "mesh, model, prompts, rewards and state built"),
    ("data_wait", "the loop waiting for a batch outside the rollouts"),
    ("checkpoint_save", "the loop blocked by saves (and the wait for the last)"),
)
REFERENCE_NOTE = "not separable: the reference forward runs inside the update's compiled step"


def speed_row(metrics: list[dict], rows_per_rollout: int, max_new_tokens: int) -> list[str]:
    """The `speed` table's row from the run's metrics records (one per step)."""
    rates = [r["grpo/sample_tokens_per_second"] for r in metrics if "grpo/sample_tokens_per_second" in r]
    later = rates[1:]
    # the sampler's seconds of a rollout: its generated tokens over its tokens/s
    seconds = [
        rows_per_rollout * r["grpo/completion_length"] / r["grpo/sample_tokens_per_second"]
        for r in metrics[1:]
        if "grpo/sample_tokens_per_second" in r
    ]
    times = [r["step_time_s"] for r in metrics[1:]]
    return [
        str(len(metrics)),
        str(rows_per_rollout),
        str(max_new_tokens),
        f"{statistics.median(later):.0f}" if later else "-",
        f"{rates[0]:.0f}" if rates else "-",
        f"{statistics.median(seconds):.4f}" if seconds else "-",
        f"{statistics.median(times):.3f}" if times else "-",
    ]


def split_rows(doc: dict, steps: int) -> list[list[str]]:
    """The `split` table from goodput.json's document: every part of PARTS, the reference as
    the note that it is not separable, and the wall time."""
    seconds, wall = doc["seconds"], doc["wall_s"]
    rows = []
    for name, holds in PARTS:
        if holds is None:
            rows.append([name, "-", "-", "-", REFERENCE_NOTE])
            continue
        s = seconds.get(name, 0.0)
        rows.append([name, f"{s:.2f}", f"{s / steps:.3f}", f"{100 * s / wall:.1f}%", holds])
    rows.append(["wall", f"{wall:.2f}", f"{wall / steps:.3f}", "100.0%", "all of train(), every bucket"])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="rows per rollout (train.global_batch_size)")
    p.add_argument("--seq-len", type=int, default=40, help="prompt + completion tokens (train.seq_len)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="grpo.max_new_tokens")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = p.parse_args()

    from jaxtrain.config import load_config
    from jaxtrain.host import configure_host

    with tempfile.TemporaryDirectory(prefix="jaxtrain-grpo-bench-") as out:
        cfg = load_config(
            os.path.join(REPO, "configs", "tiny.yaml"),
            [
                "model.vocab_size=320",  # chatml's 303 ids fit
                "model.d_model=64",
                "model.mlp_dim=128",
                "train.objective=grpo",
                f"train.global_batch_size={args.batch}",
                f"train.seq_len={args.seq_len}",
                f"train.steps={args.steps}",
                "optimizer.lr=0.01",
                "optimizer.warmup_steps=2",
                "data.source=prompts",
                f"data.paths=[{os.path.join(REPO, 'tests', 'assets', 'grpo', 'letters.jsonl')}]",
                f"data.tokenizer={os.path.join(REPO, 'tests', 'assets', 'chat', 'chatml')}",
                "grpo.rewards=[tests.assets.grpo.rewards:letter_share]",
                "grpo.group_size=8",
                f"grpo.max_new_tokens={args.max_new_tokens}",
                "grpo.beta=0.05",
                f"output_dir={out}",
                "logging.every=1",
                "logging.progress=false",
                "logging.tensorboard=false",
                *args.overrides,
            ],
        )
        configure_host(cfg.mesh_size or None)
        import jax

        from jaxtrain.trainer import train

        result = train(cfg)
        with open(os.path.join(out, "goodput.json")) as f:
            doc = json.load(f)

    metrics = result.metrics
    speed = [speed_row(metrics, args.batch, cfg.grpo.max_new_tokens)]
    split = split_rows(doc, len(metrics))
    print(
        f"GRPO on {jax.device_count()} {jax.devices()[0].platform} device(s): {cfg.model.param_count():,} "
        f"params, {args.steps} steps of {args.batch} rows (groups of {cfg.grpo.group_size}), seq "
        f"{args.seq_len}, up to {cfg.grpo.max_new_tokens} new tokens, beta {cfg.grpo.beta}"
    )
    print()
    print(markdown(SPEED_HEADER, speed))
    print()
    print(markdown(SPLIT_HEADER, split))
    print(
        f"host load average (1/5/15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores"
    )
    result_file.add_figures(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        max_new_tokens=cfg.grpo.max_new_tokens,
        metrics=metrics,
        goodput=doc,
        load_average=os.getloadavg(),
    )
    result_file.add_table("speed", SPEED_HEADER, speed)
    result_file.add_table("split", SPLIT_HEADER, split)


if __name__ == "__main__":
    sys.exit(result_file.run("grpo", main))
