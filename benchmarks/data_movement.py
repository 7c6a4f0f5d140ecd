"""Bytes a train step writes only to move or fill memory, from a deviceless compile: no GPU.

    JAX_PLATFORMS=cpu python benchmarks/data_movement.py [--target gpu:h100] [--gpus 1]
        [--config configs/gpu-peer.yaml] [--variants "unrolled:model.scan_layers=false;..."]
        [overrides...]

The config (with the overrides), then each `--variants` entry (`label:token token`,
`;`-separated, tokens as benchmarks/gpu_peer.py's `--jaxtrain-variants`: `key=value`
overrides, or `NAME=value` environment variables such as `XLA_FLAGS=--xla_...`), each compiled
in its own process for the target as `jaxtrain compile` does, with jaxtrain's GPU launch flags
(jaxtrain/gpu_flags.py) as `jaxtrain train` starts a GPU process. Per variant: the compiled
temporaries, and per kind of data movement (jaxtrain/planning/data_movement.py: zero fills,
in-place updates of stacked buffers, slices, concatenations, copies) the operations and GiB
written per step, with the time those writes alone take at the chip's HBM bandwidth
(sharding/hardware.py): a floor, since most of them read as much again. Then what every kernel
of the step reads and writes, by the kinds `benchmarks/step_profile.py --gpu` sums a GPU trace
by, and the time that traffic takes at HBM speed: set beside a profile's time per kind, it
says how near memory speed each kind runs. These are compiler figures; only a GPU says what
they cost in a step (`benchmarks/step_profile.py --gpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))

GIB = 2**30


def measure(config: str, overrides: list[str], target_text: str, gpus: int) -> dict:
    """This process: compile `config` + `overrides` for the target, return the figures."""
    from jaxtrain.config import load_config
    from jaxtrain.planning import compile as deviceless
    from jaxtrain.planning.data_movement import data_movement, traffic

    target = deviceless.parse_target(target_text, gpus_per_host=gpus)
    compiled = deviceless.compile_for_target(load_config(config, overrides), target)
    text = compiled.as_text()
    return {
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "moves": {kind: {"ops": n, "bytes": b} for kind, (n, b) in data_movement(text).items()},
        "traffic": {c: {"kernels": n, "read": r, "written": w} for c, (n, r, w) in traffic(text).items()},
    }


def child_env(env: dict[str, str]) -> dict[str, str]:
    """The variant's environment with jaxtrain's GPU launch flags merged into XLA_FLAGS."""
    from jaxtrain import gpu_flags

    out = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    if out.get(gpu_flags.OPT_OUT, "").lower() != "off":
        out["XLA_FLAGS"] = gpu_flags.merged(out.get("XLA_FLAGS", ""))[0]
    return out


def table(label: str, row: dict, bandwidth: float) -> str:
    lines = [f"## {label}: temporaries {row['temp_bytes'] / GIB:.2f} GiB"]
    lines.append(f"{'kind':24s} {'ops/step':>9s} {'GiB written':>12s} {'ms at HBM speed':>16s}")
    total = 0
    for kind, m in row["moves"].items():
        total += m["bytes"]
        ms = 1e3 * m["bytes"] / bandwidth
        lines.append(f"{kind:24s} {m['ops']:9d} {m['bytes'] / GIB:12.2f} {ms:16.2f}")
    lines.append(f"{'all':24s} {'':9s} {total / GIB:12.2f} {1e3 * total / bandwidth:16.2f}")
    lines.append("")
    head = ("every kernel, by kind", "kernels", "GiB read", "GiB written", "ms at HBM speed")
    lines.append("{:24s} {:>9s} {:>9s} {:>12s} {:>16s}".format(*head))
    total = 0
    for kind, t in row["traffic"].items():
        moved = t["read"] + t["written"]
        total += moved
        lines.append(
            f"{kind:24s} {t['kernels']:9d} {t['read'] / GIB:9.2f} {t['written'] / GIB:12.2f} "
            f"{1e3 * moved / bandwidth:16.2f}"
        )
    lines.append(f"{'all':24s} {'':9s} {'':9s} {'':12s} {1e3 * total / bandwidth:16.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="gpu:h100")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per host (one host)")
    ap.add_argument("--config", default=str(HERE.parent.parent / "configs" / "gpu-peer.yaml"))
    ap.add_argument("--variants", default="", help='"label:token token;label:..."')
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON: overrides of one run
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.config, json.loads(args.child), args.target, args.gpus)))
        return

    from gpu_peer import parse_variants

    from jaxtrain.planning.compile import parse_target
    from jaxtrain.sharding import hardware

    bandwidth = hardware.chip(parse_target(args.target).generation).hbm_bytes_per_s
    results = {}
    for label, overrides, env in parse_variants(args.variants):
        label = "as given" if label == "auto" else label
        cmd = [sys.executable, str(HERE), "--target", args.target, "--gpus", str(args.gpus)]
        cmd += ["--config", args.config, "--child", json.dumps([*args.overrides, *overrides])]
        done = subprocess.run(cmd, env=child_env(env), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{label}: the compile failed:\n{done.stderr[-3000:]}")
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
        print(table(label, results[label], bandwidth) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("data_movement", main))
