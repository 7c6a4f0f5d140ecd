"""Muon against AdamW on real text on this CPU: the loss over steps, each at its best lr, and
Muon's bfloat16 optimizer state against float32 at that lr.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/muon_vs_adamw.py [--steps 100] [--lrs 1e-3,3e-3,1e-2]

configs/tiny-text.yaml (the byte-level tiny model on this repository's docs and sources), the
same tokens in the same order for every run (seed 0). For each optimizer every lr in --lrs is
trained; the best is the one with the lowest mean loss over the last 10 steps. Writes
benchmarks/results/muon_vs_adamw/<UTC time>-<sha>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


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
    tail = lambda xs: sum(xs[-10:]) / len(xs[-10:])
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
    print("| optimizer | best lr | loss at step 1 | mean loss, last 10 steps |")
    print("|---|---:|---:|---:|")
    for name in ("adamw", "muon"):
        c = runs[f"{name} lr={best[name]:g}"]
        print(f"| {name} | {best[name]:g} | {c[0]:.3f} | {tail(c):.3f} |")
    print(f"| muon, bfloat16 state | {best['muon']:g} | {bf16[0]:.3f} | {tail(bf16):.3f} |")
    print(
        f"muon bfloat16 state: at most {figures['muon_bf16_state_max_abs_loss_difference']:.2e} from float32"
    )
    write_result(figures, argv)
    return 0


def write_result(figures: dict, argv: list[str]) -> Path:
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout
    sha, clean = git("rev-parse", "HEAD").strip(), not git("status", "--porcelain")
    now = dt.datetime.now(dt.UTC)
    record = {
        "git": {"commit": sha, "clean": clean},
        "date": now.isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "command": " ".join(["python", "benchmarks/muon_vs_adamw.py", *argv]),
        "devices": "CPU",
        "figures": figures,
    }
    out = REPO / "benchmarks" / "results" / "muon_vs_adamw" / f"{now:%Y%m%dT%H%M%SZ}-{sha[:8]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
