"""How far the planner's analytic memory (footprint.estimate) is from the compiler's.

    JAX_PLATFORMS=cpu python benchmarks/plan_gap.py [--rows 7b,8b,moe,mixtral,70b] [--remat full,minimal]

Per preset, on the target its config header names, deviceless compile (memory only,
`jaxtrain compile --no-estimate`'s program) against footprint.estimate for the same mesh,
remat and batch. Prints one markdown row per (preset, remat), and one JSON line per row to
stderr as it goes (the compiles take minutes each on a small host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PRESETS = {
    "7b": ("configs/llama2-7b.yaml", "tpu:v5p-64"),
    "8b": ("configs/llama3-8b.yaml", "tpu:v5p-64"),
    "moe": ("configs/deepseek-moe.yaml", "tpu:v5p-64"),
    "mixtral": ("configs/mixtral-8x7b.yaml", "tpu:v5p-128"),
    "70b": ("configs/llama2-70b.yaml", "tpu:v5p-512"),
}


def main() -> None:
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import compile_report, config_for_target, parse_target
    from jaxtrain.planning.footprint import estimate

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="7b,8b,moe,mixtral,70b")
    ap.add_argument("--remat", default="full,minimal")
    args = ap.parse_args()
    print("| preset | target | mesh | remat | analytic GiB | compiled GiB | analytic / compiled |")
    print("|---|---|---|---|---:|---:|---:|")
    for key in args.rows.split(","):
        path, target_text = PRESETS[key]
        target = parse_target(target_text)
        for remat in args.remat.split(","):
            cfg = load_config(REPO / path, [f"model.remat={remat}"])
            cfg, ici, dcn = config_for_target(cfg, target)
            mesh = {a: s for a, s in ici.items() if s > 1}
            est = estimate(cfg, ici, attention_impl=cfg.model.attention_impl, platform=target.platform).total
            r = compile_report(dataclasses.replace(cfg), target, estimate=False)
            got = (r.get("memory") or {}).get("total")
            ratio = f"{est / got:.2f}" if got else "-"
            row = dict(preset=path, target=target_text, mesh=mesh, remat=remat, analytic=est, compiled=got)
            print(json.dumps(row), file=sys.stderr, flush=True)
            print(
                f"| {Path(path).stem} | {target_text} | {mesh} | {remat} | {est / 2**30:.1f} | "
                f"{(got or 0) / 2**30:.1f}{'' if r['fits'] else ' (does not fit)'} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
