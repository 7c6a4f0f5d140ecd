"""How far the planner's analytic memory (footprint.estimate) and the door's lower bound
(footprint.lower_bound) are from the compiler's figure.

    JAX_PLATFORMS=cpu python benchmarks/plan_gap.py [--rows 7b,8b,moe,mixtral,70b]
        [--remat full,minimal] [--variants preset,plain_loss,offload,offload_params,bf16_params]

Per preset, on the target its config header names: a deviceless compile (memory only,
`jaxtrain compile --no-estimate`'s program) against footprint.estimate of the config resolved
for the same mesh (remat, loss chunk), and footprint.lower_bound of the unresolved one (what
`jaxtrain train` checks at the door). Variants: the preset as written, the plain loss
(train.loss_chunk=0), the optimizer moments offloaded (optimizer.offload), the master
weights too (offload_params), bf16 parameters. Prints one markdown row per (preset, remat,
variant), and one JSON line per row to stderr as it goes (the compiles take a minute or more
each on a small host).
"""

from __future__ import annotations

import argparse
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

VARIANTS = {
    "preset": [],
    "plain_loss": ["train.loss_chunk=0"],
    "offload": ["optimizer.offload=true"],
    "offload_params": ["optimizer.offload=true", "optimizer.offload_params=true"],
    "bf16_params": ["model.param_dtype=bfloat16"],
}


def main() -> None:
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import compile_report, config_for_target, parse_target, resolved_for_target
    from jaxtrain.planning.footprint import estimate, lower_bound

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="7b,8b,moe,mixtral,70b")
    ap.add_argument("--remat", default="full,minimal", help="policies; `preset` keeps the config's")
    ap.add_argument("--variants", default="preset")
    args = ap.parse_args()
    gib = lambda b: f"{b / 2**30:.1f}"
    print(
        "| preset | target | mesh | remat | variant | loss chunk | lower bound GiB | analytic GiB "
        "| compiled GiB | analytic / compiled |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
    for key in args.rows.split(","):
        path, target_text = PRESETS[key]
        target = parse_target(target_text)
        for remat in args.remat.split(","):
            for variant in args.variants.split(","):
                overrides = [*([] if remat == "preset" else [f"model.remat={remat}"]), *VARIANTS[variant]]
                cfg, ici, dcn = config_for_target(load_config(REPO / path, overrides), target)
                resolved = resolved_for_target(cfg, target, ici, dcn)[0]
                est, bound = estimate(resolved, ici, target.platform).total, lower_bound(cfg, ici).total
                r = compile_report(cfg, target, estimate=False)
                got = (r.get("memory") or {}).get("total")
                ratio = f"{est / got:.2f}" if got else "-"
                mesh = {a: s for a, s in ici.items() if s > 1}
                row = dict(
                    preset=path, target=target_text, mesh=mesh, remat=resolved.model.remat, variant=variant,
                    loss_chunk=resolved.train.loss_chunk, lower_bound=bound, analytic=est, compiled=got,
                    host=(r.get("memory") or {}).get("host_total"), compile_s=r.get("compile_s"),
                )  # fmt: skip
                print(json.dumps(row), file=sys.stderr, flush=True)
                mesh_text = " ".join(f"{a}={s}" for a, s in mesh.items())
                print(
                    f"| {Path(path).stem} | {target_text} | {mesh_text} | {resolved.model.remat} | {variant} "
                    f"| {resolved.train.loss_chunk} | {gib(bound)} | {gib(est)} "
                    f"| {gib(got or 0)}{'' if r['fits'] else ' (does not fit)'} | {ratio} |",
                    flush=True,
                )


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("plan_gap", main))
