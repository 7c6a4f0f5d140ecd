"""Training throughput of configs/bench-peer.yaml, optionally side by side with MaxText.

    python benchmarks/throughput.py [--steps 30] [--peer] [--peer-host-malloc]
                                    [--dtypes float32,bfloat16] [--remat auto,full]

Runs the peer model (see the config) on 8 simulated CPU devices (fsdp=8) in each
compute dtype and each `--remat` policy (auto: jaxtrain's default, which resolves
against this host's memory; full: the config's, like MaxText's default), one run at
a time, and prints the median step time over steps 3..N-1, tokens/s and MFU
(against the matmul peak measured in the same process). With --peer it runs
../shared/bench/maxtext_peer.sh (remat full, its default) once per dtype with the
same model and prints the ratio MaxText time / ours (>1 means jaxtrain is faster).
With --peer-host-malloc it runs MaxText once more with the host allocator that jaxtrain's
CLI gives its own CPU runs (jaxtrain/host_malloc.py: tcmalloc preloaded where it is
found, else the glibc malloc settings as environment variables), and prints that ratio too.
The run's MFU is against the peak its process measured at start-up, which read 3.75-3.90e11
FLOP/s in bf16 in some runs where fresh processes read 4.11-4.18e11 minutes apart; so the
peak is measured again in a fresh process right after each run, and the table also gives
the MFU against the highest peak any process of the run measured in that dtype (the
readings are bimodal on the AMD EPYC machine, 3.75-3.82e11 or 4.13-4.20e11, so the run's
highest is the conservative denominator).
Nothing else may run on the machine meanwhile: this is a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxtrain import host_malloc

REPO = Path(__file__).resolve().parent.parent
PEER = REPO.parent / "shared" / "bench" / "maxtext_peer.sh"


def run_ours(dtype: str, steps: int, extra: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-{dtype}-")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [
        sys.executable,
        "-m",
        "jaxtrain",
        "train",
        str(REPO / "configs" / "bench-peer.yaml"),
        f"output_dir={out}",
        f"train.steps={steps}",
        f"model.compute_dtype={dtype}",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        sys.exit(f"jaxtrain run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if 3 <= r["step"] <= steps - 1]
    step_time = statistics.median(r["step_time_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    peak = re.search(r"peak=(\S+) FLOP/s", proc.stderr)
    return {
        "step_time_s": step_time,
        "tokens_per_second": 4096 / step_time,
        "mfu": mfu,
        "final_loss": records[-1]["loss"],
        "peak": peak.group(1) if peak else "?",
    }


def peak_after(dtype: str) -> float:
    """The matmul peak measured again in a fresh process, as the trainer measures it."""
    code = f"from jaxtrain.flops import measure_matmul_flops as m; print(m(dtype={dtype!r}))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        sys.exit(f"peak measurement failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def run_peer(dtype: str, steps: int, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        ["bash", str(PEER), "8", dtype, str(steps)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode:
        sys.exit(f"peer run failed:\n{proc.stderr[-3000:]}")
    last = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    return {
        "step_time_s": float(fields["step_time_s"]),
        "tokens_per_second": float(fields["tokens_per_second"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--peer", action="store_true", help="also run MaxText (../shared/bench/maxtext_peer.sh)")
    ap.add_argument(
        "--peer-host-malloc",
        action="store_true",
        help="also run MaxText with the host allocator jaxtrain's CLI gives CPU runs "
        "(jaxtrain/host_malloc.py: tcmalloc, else glibc settings), for a like-for-like ratio",
    )
    ap.add_argument("--remat", default="full", help="comma-separated model.remat values, e.g. auto,full")
    ap.add_argument("overrides", nargs="*", help="extra jaxtrain overrides, e.g. model.remat=none")
    args = ap.parse_args()
    rows = []
    same_malloc = host_malloc.environment()
    for dtype in args.dtypes.split(","):
        peer = run_peer(dtype, args.steps) if args.peer else None
        peer_malloc = run_peer(dtype, args.steps, same_malloc) if args.peer_host_malloc else None
        for remat in args.remat.split(","):
            ours = run_ours(dtype, args.steps, [f"model.remat={remat}", *args.overrides])
            after = peak_after(dtype)
            in_run = float(ours["peak"]) if ours["peak"] != "?" else after
            row = {"dtype": dtype, "remat": remat, **ours, "peak_after": f"{after:.3g}"}
            row["peaks"] = (in_run, after)
            if peer:
                row.update(
                    peer_step_time_s=peer["step_time_s"],
                    peer_tokens_per_second=peer["tokens_per_second"],
                    ratio=peer["step_time_s"] / ours["step_time_s"],
                )
            if peer_malloc:
                row.update(
                    peer_malloc_step_time_s=peer_malloc["step_time_s"],
                    ratio_malloc=peer_malloc["step_time_s"] / ours["step_time_s"],
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    for r in rows:  # the MFU against the highest peak any process of this run measured
        highest = max(p for other in rows if other["dtype"] == r["dtype"] for p in other["peaks"])
        r["mfu_highest_peak"] = r["mfu"] * r["peaks"][0] / highest
        r["highest_peak"] = f"{highest:.3g}"
    print(
        "\n| compute dtype | jaxtrain remat | jaxtrain s/step | jaxtrain tokens/s "
        "| MFU (vs measured matmul peak, compute dtype) | peak again after the run "
        "| MFU vs the run's highest peak |"
        + (
            " MaxText s/step (remat full) | MaxText tokens/s | ratio (MaxText time / ours) |"
            if args.peer
            else ""
        )
        + (" MaxText s/step, same malloc | ratio, same malloc |" if args.peer_host_malloc else "")
    )
    print(
        "|---|---|---|---|---|---|---|"
        + ("---|---|---|" if args.peer else "")
        + ("---|---|" if args.peer_host_malloc else "")
    )
    for r in rows:
        line = (
            f"| {r['dtype']} | {r['remat']} | {r['step_time_s']:.2f} | {r['tokens_per_second']:.0f} | "
            f"{100 * r['mfu']:.1f}% (peak {r['peak']} FLOP/s) | {r['peak_after']} | "
            f"{100 * r['mfu_highest_peak']:.1f}% ({r['highest_peak']}) |"
        )
        if args.peer:
            line += f" {r['peer_step_time_s']:.2f} | {r['peer_tokens_per_second']:.0f} | {r['ratio']:.2f} |"
        if args.peer_host_malloc:
            line += f" {r['peer_malloc_step_time_s']:.2f} | {r['ratio_malloc']:.2f} |"
        print(line)


if __name__ == "__main__":
    main()
