"""Where FP8 matmuls survive compilation: the train step of a config with and without
`model.fp8`, compiled deviceless for each target, and the optimized program read back.

    python benchmarks/fp8_targets.py configs/tiny.yaml --targets gpu:h100,tpu:v5p-8,tpu:v6e-8

Per target and precision: matmuls (dot / convolution instructions) with an f8 operand
among all of them (`jaxtrain.models.fp8.count_fp8_matmuls`), cuBLASLt fp8 custom calls,
the dtypes the matmuls produce, and on TPU XLA's estimated run time of the program
(`cost_analysis()` "optimal_seconds": an estimate, not a measurement; loop bodies once).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--targets", default="gpu:h100,tpu:v5p-8,tpu:v6e-8", help="comma-separated")
    args = p.parse_intermixed_args(argv)
    for target in args.targets.split(","):
        for fp8 in (False, True):
            print(json.dumps(inspect(args.config, args.overrides, target, fp8)), flush=True)
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("fp8_targets", main))
