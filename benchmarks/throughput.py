"""Training throughput of configs/bench-peer.yaml, side by side with MaxText, in one run.

    python benchmarks/throughput.py [--steps 30] [--peer] [--peer-host-malloc]
                                    [--dtypes float32,bfloat16] [--remat auto,full]
                                    [--baseline DIR] [overrides ...]

Runs the peer model (see the config) through `jaxtrain train` on 8 simulated CPU devices
(fsdp=8) in each compute dtype and each `--remat` policy (auto: jaxtrain's default, which
resolves against this host's memory; full: the config's, like MaxText's default), one run at
a time, and prints the median step time over steps 3..N-1, tokens/s and MFU (against the
matmul peak measured in the same process, and again in a fresh process right after the run:
the readings move between processes, so the table also gives the MFU against the highest
peak any process of the run measured in that dtype).

--peer runs benchmarks/peers/maxtext_peer.sh (MaxText 0.2.5 from PyPI, remat full, its
default) once per dtype with the same model and prints the ratio MaxText time / ours (>1:
jaxtrain is faster). --peer-host-malloc runs MaxText once more with the heap settings a CPU
run of jaxtrain gives itself (jaxtrain/host.py, as environment variables), for a
like-for-like ratio. --baseline DIR also runs another jaxtrain installed in DIR (`pip install
--target DIR <checkout>`), e.g. the commit before a change, so before and after are timed in
the same run. Nothing else may run on the machine meanwhile: this is a timing.
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

from jaxtrain import host

REPO = Path(__file__).resolve().parent.parent
PEER = REPO / "benchmarks" / "peers" / "maxtext_peer.sh"


def run_ours(dtype: str, steps: int, extra: list[str], baseline: str | None = None) -> dict:
    """One `jaxtrain train` of bench-peer; `baseline`: the jaxtrain installed in that directory
    (run from outside the checkout, so that the checkout's own folders stay off the path)."""
    out = tempfile.mkdtemp(prefix=f"bench-{dtype}-")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if baseline:
        env["PYTHONPATH"] = baseline
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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out if baseline else REPO)
    if proc.returncode:
        sys.exit(f"jaxtrain run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "loss" in r and 3 <= r["step"] <= steps - 1]
    step_time = statistics.median(r["step_time_s"] for r in timed)
    peak = re.search(r"peak=(\S+) FLOP/s", proc.stderr)
    return {
        "step_time_s": step_time,
        "tokens_per_second": 4096 / step_time,
        "mfu": statistics.median(r["mfu"] for r in timed),
        "final_loss": records[-1]["loss"],
        "peak": float(peak.group(1)) if peak else None,
    }


def peak_after(dtype: str) -> float:
    """The matmul peak measured again in a fresh process, as the trainer measures it."""
    code = f"from jaxtrain.planning.flops import measure_matmul_flops as m; print(m(dtype={dtype!r}))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        sys.exit(f"peak measurement failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def run_peer(dtype: str, steps: int, env: dict[str, str] | None = None) -> float:
    """MaxText's median step time (s) on the same model."""
    proc = subprocess.run(
        ["bash", str(PEER), "8", dtype, str(steps)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode:
        sys.exit(f"peer run failed:\n{proc.stderr[-3000:]}")
    fields = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split()[1:])
    return float(fields["step_time_s"])


def measure(args) -> list[dict]:
    """Every row of the table, timed one run at a time."""
    rows = []
    for dtype in args.dtypes.split(","):
        peer = run_peer(dtype, args.steps) if args.peer else None
        peer_malloc = run_peer(dtype, args.steps, host.ENVIRONMENT) if args.peer_host_malloc else None
        for remat in args.remat.split(","):
            extra = [f"model.remat={remat}", *args.overrides]
            row = {"dtype": dtype, "remat": remat, **run_ours(dtype, args.steps, extra)}
            row["peaks"] = [p for p in (row.pop("peak"), peak_after(dtype)) if p]
            if args.baseline:
                row["baseline_step_time_s"] = run_ours(dtype, args.steps, extra, args.baseline)["step_time_s"]
            if peer:
                row.update(peer_step_time_s=peer, ratio=peer / row["step_time_s"])
            if peer_malloc:
                row.update(peer_malloc_step_time_s=peer_malloc, ratio_malloc=peer_malloc / row["step_time_s"])
            if args.peer and args.baseline:
                row["baseline_ratio"] = peer / row["baseline_step_time_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    """The rows as a Markdown table; MFU also against the highest peak of the run per dtype."""
    cols = [
        "compute dtype",
        "remat",
        "jaxtrain s/step",
        "tokens/s",
        "MFU (in-run peak)",
        "MFU (highest peak)",
    ]
    cols += ["baseline s/step"] if args.baseline else []
    cols += ["MaxText s/step", "ratio (MaxText / ours)"] if args.peer else []
    cols += ["baseline ratio"] if args.peer and args.baseline else []
    cols += ["MaxText s/step, same heap", "ratio, same heap"] if args.peer_host_malloc else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        highest = max(p for other in rows if other["dtype"] == r["dtype"] for p in other["peaks"])
        in_run = r["peaks"][0]
        cells = [r["dtype"], r["remat"], f"{r['step_time_s']:.3f}", f"{r['tokens_per_second']:.0f}"]
        cells += [
            f"{100 * r['mfu']:.1f}% ({in_run:.3g})",
            f"{100 * r['mfu'] * in_run / highest:.1f}% ({highest:.3g})",
        ]
        cells += [f"{r['baseline_step_time_s']:.3f}"] if args.baseline else []
        cells += [f"{r['peer_step_time_s']:.3f}", f"{r['ratio']:.2f}"] if args.peer else []
        cells += [f"{r['baseline_ratio']:.2f}"] if args.peer and args.baseline else []
        cells += (
            [f"{r['peer_malloc_step_time_s']:.3f}", f"{r['ratio_malloc']:.2f}"]
            if args.peer_host_malloc
            else []
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--peer", action="store_true", help="also run MaxText (benchmarks/peers/maxtext_peer.sh)")
    ap.add_argument(
        "--peer-host-malloc",
        action="store_true",
        help="also run MaxText with the heap settings jaxtrain gives its CPU runs (jaxtrain/host.py)",
    )
    ap.add_argument("--remat", default="full", help="comma-separated model.remat values, e.g. auto,full")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also time the jaxtrain installed in DIR (pip install --target DIR ...)",
    )
    ap.add_argument("overrides", nargs="*", help="extra jaxtrain overrides, e.g. model.cpu_tuning=false")
    args = ap.parse_args()
    print(table(measure(args), args))


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("throughput", main))
