"""Where the bench-peer train step spends its time on CPU: a jax.profiler trace of the
compiled step, summed by op kind, plus the heaviest ops with their HLO shapes.

    python benchmarks/step_profile.py [--steps 2] [--top 15] [overrides...]
    python benchmarks/step_profile.py model.compute_dtype=bfloat16 model.vocab_size=2048

Runs configs/bench-peer.yaml (8 simulated CPU devices, fsdp=8, remat none unless
overridden) in this process: 6 warm-up steps, then `--steps` traced ones. The figures are
device-thread time: 8 device threads share the host's cores, so an op's time includes the
time its thread waited for a core, and "waits" is time threads spent blocked in a
collective's rendezvous for the slowest device. Shares, not seconds, are what compare
between runs. Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.data import make_data_iterator  # noqa: E402
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh  # noqa: E402
from jaxtrain.trainer.batches import batch_to_device  # noqa: E402
from jaxtrain.trainer.program import build_program  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bench-peer.yaml"
# host-side and runtime events that are not one op of the program
_SKIP = ("ThunkExecutor", "$", "SlinkyThreadPool", "PjitFunction", "CommonPjRt", "Allocate", "Handle")
_SKIP += ("XlaModule", "while", "conditional", "call")


def kind(name: str) -> str:
    if name.startswith(("ynn_fusion", "dot", "xnn")):
        return "matmuls"
    if name.startswith(("copy", "transpose", "wrapped_copy", "wrapped_transpose")):
        return "copies and transposes"
    if name.startswith(("all-", "reduce-scatter", "collective")):
        return "collectives"
    if name.startswith(("Rendezvous", "Wait")):
        return "rendezvous waits"
    return "elementwise and other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(CONFIG, ["logging.progress=false", "model.remat=none", *args.overrides])
    mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:8])
    cfg = resolve_for_mesh(cfg, mesh)
    rules = axis_rules(cfg)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
        state = program.init()
        data = make_data_iterator(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            seq_len=cfg.train.seq_len,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.seed,
        )
        batch = batch_to_device(next(data), program.batch_sharding)
        compiled = program.step.lower(state, batch).compile()
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    trace_dir = tempfile.mkdtemp(prefix="step-profile-")
    jax.profiler.start_trace(trace_dir)
    for _ in range(args.steps):
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
    jax.profiler.stop_trace()
    trace = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    per_op: collections.Counter = collections.Counter()
    for e in json.load(gzip.open(trace))["traceEvents"]:
        if e.get("ph") == "X" and not e["name"].startswith(_SKIP):
            per_op[e["name"]] += e["dur"] / 1e3 / args.steps
    per_kind: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        per_kind[kind(name)] += ms
    total = sum(per_kind.values())
    print(f"step {statistics.median(times[2:]):.3f} s (median of steps 3..6), {' '.join(args.overrides)}")
    print("| op kind | device-thread ms/step | share |")
    print("|---|---:|---:|")
    for k, ms in per_kind.most_common():
        print(f"| {k} | {ms:.0f} | {100 * ms / total:.0f}% |")
    shapes = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ", compiled.as_text(), re.M))
    print("\n| op | device-thread ms/step | shape |\n|---|---:|---|")
    for name, ms in per_op.most_common(args.top):
        print(f"| {name} | {ms:.0f} | `{shapes.get(name, '')[:48]}` |")


if __name__ == "__main__":
    main()
