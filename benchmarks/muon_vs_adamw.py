"""Muon against AdamW on real text on this CPU: the loss over steps, each at its best lr, and
Muon's bfloat16 optimizer state against float32 at that lr.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/muon_vs_adamw.py [--steps 100] [--lrs 1e-3,3e-3,1e-2]

configs/tiny-text.yaml (the byte-level tiny model on this repository's docs and sources), the
same tokens in the same order for every run (seed 0). For each optimizer every lr in --lrs is
trained; the best is the one with the lowest mean loss over the last 10 steps. Prints a
Markdown table; the run is recorded as benchmarks/results/muon_vs_adamw/<UTC time>-<sha>.json
(benchmarks/result_file.py), with the table as `loss`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOSS_HEADER = ["optimizer", "best lr", "loss at step 1", "mean loss, last 10 steps"]


def losses(steps: int, *overrides: str) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            REPO / "configs" / "tiny-text.yaml",
            [
                f"output_dir={out}",
                f"train.steps={steps}",
                "logging.progress=false",
                "logging.tensorboard=false",
                *overrides,
            ],
        )
        cwd = os.getcwd()
        os.chdir(REPO)  # the config's data paths are relative to the repository
        try:
            result = train(cfg)
        finally:
            os.chdir(cwd)
    return [r["loss"] for r in sorted(result.metrics, key=lambda r: r["step"]) if "loss" in r]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Muon against AdamW on real text (CPU)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    args = parser.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")]
    runs = {}
    for name in ("adamw", "muon"):
        for lr in lrs:
            curve = losses(args.steps, f"optimizer.name={name}", f"optimizer.lr={lr}")
            runs[f"{name} lr={lr:g}"] = curve
            print(json.dumps({"optimizer": name, "lr": lr, "last10": tail(curve)}), flush=True)
    best = {
        name: min(lrs, key=lambda lr, name=name: tail(runs[f"{name} lr={lr:g}"]))
        for name in ("adamw", "muon")
    }
    bf16 = losses(
        args.steps, "optimizer.name=muon", f"optimizer.lr={best['muon']}", "optimizer.state_dtype=bfloat16"
    )
    f32 = runs[f"muon lr={best['muon']:g}"]
    figures = {
        "steps": args.steps,
        "lrs": lrs,
        "curves": runs,
        "best_lr": best,
        "muon_bf16_state_curve": bf16,
        "muon_bf16_state_max_abs_loss_difference": max(abs(a - b) for a, b in zip(bf16, f32)),
    }
    rows = loss_rows(figures)
    print(f"| {' | '.join(LOSS_HEADER)} |\n|---|---:|---:|---:|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    print(
        f"muon bfloat16 state: at most {figures['muon_bf16_state_max_abs_loss_difference']:.2e} from float32"
    )
    try:  # run as a script: benchmarks/ is on the path, as for the recording in __main__
        import result_file
    except ImportError:  # imported as benchmarks.muon_vs_adamw: nothing records
        from benchmarks import result_file
    result_file.add_figures(**figures)
    result_file.add_table("loss", LOSS_HEADER, rows)
    return 0


def tail(losses: list[float]) -> float:
    """The mean loss of the last 10 steps (what picks the best lr)."""
    return sum(losses[-10:]) / len(losses[-10:])


def loss_rows(figures: dict) -> list[list[str]]:
    """The `loss` table (LOSS_HEADER) from the run's figures: each optimizer at its best lr,
    then Muon with bfloat16 state at Muon's."""
    best = figures["best_lr"]
    rows = []
    for name in ("adamw", "muon"):
        c = figures["curves"][f"{name} lr={best[name]:g}"]
        rows.append([name, f"{best[name]:g}", f"{c[0]:.3f}", f"{tail(c):.3f}"])
    bf16 = figures["muon_bf16_state_curve"]
    rows.append(["muon, bfloat16 state", f"{best['muon']:g}", f"{bf16[0]:.3f}", f"{tail(bf16):.3f}"])
    return rows


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("muon_vs_adamw", lambda: main(sys.argv[1:])))
