"""Pod-scale presets on their targets, compiled deviceless: memory, FLOPs, est. step time and MFU.

    JAX_PLATFORMS=cpu python benchmarks/pod.py                  # every preset x target
    JAX_PLATFORMS=cpu python benchmarks/pod.py --only 7b --no-estimate

Each row is one `jaxtrain compile ... --json` run in its own process (the
real TPU / XLA:GPU compiler, no accelerator). Memory is per device from the
scanned program; step time and MFU are XLA's *estimate* (TPU only), from
1- and 2-layer compiles extrapolated to the full depth, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (preset, target args, overrides): per-device batch 4 at seq 4096 where it fits (as MaxText).
ROWS = [
    ("llama2-7b", ["--target", "tpu:v5p-64"], []),
    ("llama2-7b", ["--target", "gpu:h100", "--hosts", "2"], ["train.global_batch_size=64"]),
    ("llama3-8b", ["--target", "tpu:v5p-64"], []),
    ("llama3-8b", ["--target", "gpu:h100", "--hosts", "2"], ["train.global_batch_size=64"]),
    ("llama2-70b", ["--target", "gpu:h100", "--hosts", "8"], ["train.global_batch_size=64"]),
    ("llama2-70b", ["--target", "tpu:v5p-512"], []),
    ("mixtral-8x7b", ["--target", "tpu:v5p-128"], []),
    (
        "mixtral-8x7b",
        ["--target", "tpu:v5p-128"],
        ["mesh.data=1", "mesh.expert=8", "model.remat=full", "model.moe.receive_factor=1.25"],
    ),
    (
        "mixtral-8x7b",
        ["--target", "gpu:h100", "--hosts", "4"],
        ["train.global_batch_size=128", "mesh.data=1", "model.remat=full"],
    ),
]


def run_row(preset, target_args, overrides, estimate):
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "compile",
        os.path.join(REPO, "configs", f"{preset}.yaml"),
        *overrides,
        *target_args,
        "--json",
    ] + ([] if estimate else ["--no-estimate"])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    lines = p.stdout.strip().splitlines()
    if p.returncode not in (0, 1) or not lines:
        return None, wall, (p.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(lines[-1]), wall, None


def fmt_row(preset, r, wall):
    gib = 2**30
    mem = r.get("memory") or {}
    words = r["target"].split()
    target = (
        r["target"].split(" (")[0] + (f" x{words[-2]} slices" if "slices" in words else "")
        if r["platform"] == "tpu"
        else f"{words[0]} {words[1]}x{words[4]}"
    )
    cells = [
        preset,
        target,
        " x ".join(f"{a}={s}" for a, s in r["mesh"].items()),
        f"{r['per_device_batch']:g}x{r['seq_len']}",
        r["attention_impl"],
        r["remat"],
        f"{mem.get('argument', 0) / gib:.1f}" if "argument" in mem else "-",
        f"{mem.get('temp', 0) / gib:.1f}" if "temp" in mem else "-",
        f"{mem['total'] / gib:.1f} / {r['hbm_bytes'] / gib:.0f}" if mem.get("total") else "-",
        "yes" if r["fits"] else "NO",
        f"{r['model_flops_per_device'] / 1e12:.0f}" if r.get("model_flops_per_device") else "-",
        f"{r['xla_flops_over_model_flops']:.2f}" if r.get("xla_flops_over_model_flops") else "-",
        f"{r['step_seconds_est']:.2f}" if r.get("step_seconds_est") else "-",
        f"{100 * r['mfu_est']:.1f}%" if r.get("mfu_est") else "-",
        f"{100 * r['mfu_xla']:.1f}%" if r.get("mfu_xla") else "-",
        f"{wall:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| preset | target | mesh | batch/dev x seq | attn | remat | args GiB | temp GiB | "
    "total / HBM GiB | fits | model TFLOP/dev/step | XLA/model flops | est. step s | "
    "est. MFU | raw XLA MFU | compile wall s |\n" + "|---" * 16 + "|"
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="substring filter on 'preset target'")
    ap.add_argument("--no-estimate", dest="estimate", action="store_false")
    args = ap.parse_args()
    print(HEADER, flush=True)
    for preset, target_args, overrides in ROWS:
        if args.only and args.only not in f"{preset} {' '.join(target_args)}":
            continue
        r, wall, err = run_row(preset, target_args, overrides, args.estimate)
        if r is None:
            print(f"| {preset} | {' '.join(target_args)} | error: {err[:150]} |", flush=True)
        else:
            extra = [o for o in overrides if not o.startswith("train.global_batch_size")]
            print(fmt_row(" ".join([preset, *extra]), r, wall), flush=True)
    print(
        "\nest. step time / MFU: XLA's cost model (TPU only), extrapolated from 1- and 2-layer "
        "unrolled compiles and scaled up where XLA counted fewer FLOPs than model + remat "
        "recompute; raw XLA MFU is before that scaling. Compiler estimates, not measurements."
    )


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("pod", main))
