"""Where FP8 matmuls survive compilation: the train step of a config with and without
`model.fp8`, compiled deviceless for each target, and the optimized program read back.

    python benchmarks/fp8_targets.py configs/tiny.yaml --targets gpu:h100,tpu:v5p-8,tpu:v6e-8

Per target and precision: matmuls (dot / convolution instructions) with an f8 operand
among all of them (`jaxtrain.models.fp8.count_fp8_matmuls`), cuBLASLt fp8 custom calls,
the dtypes the matmuls produce, and on TPU XLA's estimated run time of the program
(`cost_analysis()` "optimal_seconds": an estimate, not a measurement; loop bodies once).
Prints each as a JSON row, then the table docs/benchmarks.md quotes (result file table `targets`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: the TPU / CUDA compilers run on the host

from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.models.fp8 import count_fp8_matmuls  # noqa: E402
from jaxtrain.planning.compile import _compile_step, config_for_target, parse_target, target_devices  # noqa: E402
from jaxtrain.planning.resolve import resolve_for_mesh  # noqa: E402
from jaxtrain.sharding.targets import compiled_cost, compiled_memory  # noqa: E402

MATMUL = re.compile(r"= (\w+)\[[^=]*\b(?:dot|convolution)\(")


def inspect(config: str, overrides: list[str], target_text: str, fp8: bool) -> dict:
    target = parse_target(target_text, gpus_per_host=1 if target_text.startswith("gpu") else None)
    cfg = load_config(config, [*overrides, "model.compute_dtype=bfloat16", f"model.fp8={str(fp8).lower()}"])
    cfg, ici, dcn = config_for_target(cfg, target)
    mesh = sharding.make_mesh(ici, target_devices(target), dcn_axis_sizes=dcn or None)
    compiled = _compile_step(resolve_for_mesh(cfg, mesh), mesh)
    text = compiled.as_text()
    cost = compiled_cost(compiled) or {}
    return {
        "target": target_text,
        "fp8": fp8,
        "fp8_matmuls": count_fp8_matmuls(text),
        "matmuls": len(MATMUL.findall(text)),
        "cublaslt_fp8_calls": text.count('custom_call_target="__cublas$lt$matmul$f8"'),
        "matmul_output_dtypes": dict(collections.Counter(MATMUL.findall(text))),
        "est_seconds": cost.get("optimal_seconds"),
        "hbm_bytes": compiled_memory(compiled)["total"],
    }


TABLE_HEADER = [
    "target",
    "precision",
    "matmuls with an f8 operand / all",
    "matmul outputs",
    "est. program time (XLA, TPU)",
    "HBM/device",
]


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The docs' cells of each row; fp8's time also relative to the same target's bf16."""
    bf16 = {r["target"]: r["est_seconds"] for r in rows if not r["fp8"]}
    cells = []
    for r in rows:
        est = r["est_seconds"]
        time = "-" if est is None else f"{est * 1e6:.1f} µs"
        if est is not None and r["fp8"] and bf16.get(r["target"]):
            time += f" ({100 * (est / bf16[r['target']] - 1):+.1f}%)"
        cells.append(
            [
                r["target"],
                "fp8" if r["fp8"] else "bf16",
                f"{r['fp8_matmuls']} / {r['matmuls']}",
                ", ".join(sorted(r["matmul_output_dtypes"])),
                time,
                f"{r['hbm_bytes'] / 2**20:.1f} MiB",
            ]
        )
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--targets", default="gpu:h100,tpu:v5p-8,tpu:v6e-8", help="comma-separated")
    args = p.parse_intermixed_args(argv)
    rows = []
    for target in args.targets.split(","):
        for fp8 in (False, True):
            rows.append(inspect(args.config, args.overrides, target, fp8))
            print(json.dumps(rows[-1]), flush=True)
    header = " | ".join(TABLE_HEADER)
    print(f"\n| {header} |\n|" + "---|" * len(TABLE_HEADER))
    for cells in table_rows(rows):
        print("| " + " | ".join(cells) + " |")
    try:  # run as a script: benchmarks/ is on the path, as for the recording in __main__
        import result_file
    except ImportError:  # imported as benchmarks.fp8_targets: nothing records
        from benchmarks import result_file
    result_file.add_table("targets", TABLE_HEADER, table_rows(rows))
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("fp8_targets", main))
