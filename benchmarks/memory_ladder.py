"""Memory ladder: the per-device HBM, host (pinned_host) bytes and estimated step time of
one config under every `model.remat` policy, optimizer offload and fp8, from deviceless
compiles of the real train step (`jaxtrain.compile.compile_report`).

    python benchmarks/memory_ladder.py configs/llama2-7b.yaml --target tpu:v5p-64 --out ladder-tpu.json
    python benchmarks/memory_ladder.py configs/llama2-7b.yaml train.global_batch_size=64 \\
        --target gpu:h100 --hosts 2 --out ladder-h100.json

Each row is written to --out as soon as it is compiled (a rerun skips the rows already
there), then the table is printed as Markdown. `--rows a,b` compiles only those rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: the TPU / CUDA compilers run on the host

from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.models.fp8 import count_fp8_matmuls  # noqa: E402
from jaxtrain.planning.compile import compile_report, parse_target  # noqa: E402

CUSTOM = (
    "model.remat=custom",
    "model.remat_custom.qkv_proj=offload",
    "model.remat_custom.out_proj=offload",
    "model.remat_custom.context=device",
    "model.remat_custom.mlp_out=device",
)
ROWS = {
    "remat none": ("model.remat=none",),
    "remat full": ("model.remat=full",),
    "remat minimal": ("model.remat=minimal",),
    "remat save_dot_except_mlp": ("model.remat=save_dot_except_mlp",),
    "remat save_qkv_proj": ("model.remat=save_qkv_proj",),
    "remat save_out_proj": ("model.remat=save_out_proj",),
    "remat save_attention": ("model.remat=save_attention",),
    "remat offload_matmuls": ("model.remat=offload_matmuls",),
    "remat custom": CUSTOM,
    "full + optimizer.offload": ("model.remat=full", "optimizer.offload=true"),
    "full + offload moments and params": (
        "model.remat=full",
        "optimizer.offload=true",
        "optimizer.offload_params=true",
    ),
    "full + fp8": ("model.remat=full", "model.fp8=true"),
}
GiB = 1024**3


def row_of(name: str, report: dict) -> dict:
    mem = report.get("memory") or {}
    return {
        "row": name,
        "fits": report.get("fits"),
        "hbm_gib": (mem.get("total") or 0) / GiB,
        "args_gib": mem.get("argument", 0) / GiB,
        "temp_gib": mem.get("temp", 0) / GiB,
        "host_gib": mem.get("host_total", 0) / GiB,
        "host_args_gib": mem.get("host_argument", 0) / GiB,
        "host_temp_gib": mem.get("host_temp", 0) / GiB,
        "step_s": report.get("step_seconds_est"),
        "mfu": report.get("mfu_est"),
        "fp8_gemms": report.get("fp8_gemms"),
        "compile_s": report.get("compile_s"),
        "error": report.get("compile_error"),
    }


def markdown(rows: list[dict], target: str) -> str:
    lines = [
        f"| {target} | fits | HBM/device GiB (args, temp) | host GiB (args, temp) | est. step s | est. MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = f"{r['step_s']:.2f}" if r.get("step_s") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        if r["fits"] is None:
            lines.append(f"| {r['row']} | n/a: {r['error']} | | | | |")
            continue
        name = r["row"] if r.get("fp8_gemms") is None else f"{r['row']} ({r['fp8_gemms']} fp8 GEMMs)"
        fits = "yes" if r["fits"] else "**no**"
        host = (
            f"{r['host_gib']:.2f} ({r['host_args_gib']:.2f}, {r['host_temp_gib']:.2f})"
            if r["host_gib"]
            else "0"
        )
        lines.append(
            f"| {name} | {fits} | {r['hbm_gib']:.2f} ({r['args_gib']:.2f}, {r['temp_gib']:.2f}) | "
            f"{host} | {step} | {mfu} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--target", required=True)
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--slices", type=int, default=1)
    p.add_argument("--out", required=True, help="JSON file of rows (appended to, resumable)")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument("--no-estimate", action="store_true", help="skip the 1-/2-layer cost compiles")
    args = p.parse_intermixed_args(argv)  # overrides before or after the options
    target = parse_target(args.target, hosts=args.hosts, slices=args.slices)
    done = json.load(open(args.out)) if os.path.exists(args.out) else []
    names = args.rows.split(",") if args.rows else list(ROWS)
    for name in names:
        if any(r["row"] == name for r in done):
            continue
        cfg = load_config(args.config, [*args.overrides, *ROWS[name]])
        t0 = time.perf_counter()
        try:
            report = compile_report(cfg, target, estimate=not args.no_estimate and target.platform == "tpu")
        except ConfigError as e:  # e.g. no pinned_host memory on this deviceless target
            report = {"fits": None, "compile_error": str(e)}
        if cfg.model.fp8 and report.get("fits") is not None:
            report["fp8_gemms"] = _fp8_gemms(cfg, target)
        row = row_of(name, report)
        print(f"{name}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        done.append(row)
        json.dump(done, open(args.out, "w"), indent=1)
    print(markdown([r for r in done if r["row"] in names], target.describe()))
    return 0


def _fp8_gemms(cfg, target) -> int:
    """Compile once more to read the optimized HLO (compile_report keeps only a summary)."""
    from jaxtrain import sharding
    from jaxtrain.planning.compile import _compile_step, config_for_target, target_devices
    from jaxtrain.planning.resolve import resolve_for_mesh

    cfg, ici, dcn = config_for_target(cfg, target)
    mesh = sharding.make_mesh(ici, target_devices(target), dcn_axis_sizes=dcn or None)
    return count_fp8_matmuls(_compile_step(resolve_for_mesh(cfg, mesh), mesh).as_text())


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("memory_ladder", main))
