"""Chunked cross-entropy (train.loss_chunk) on configs/bench-peer.yaml: compiled temp memory
per device and, with --steps, step time, for several chunk sizes in one process.

    python benchmarks/loss_chunk.py [--chunks 0,128,256] [--dtypes float32,bfloat16] [--steps 6]

Runs on 8 simulated CPU devices (fsdp=8, as the config). Memory is XLA's
`memory_analysis()` of the compiled train step (temp = activations and scratch, the part
the chunking changes). Timings alternate the settings step by step (round-robin) so a
loaded machine slows all of them alike: compare the ratios, not the absolute times.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="0,128,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per setting (0: memory only)")
    ap.add_argument("overrides", nargs="*", help="extra overrides, e.g. model.remat=none")
    args = ap.parse_args()
    settings = [(d, int(c)) for d in args.dtypes.split(",") for c in args.chunks.split(",")]
    runs = {}
    print("| compute dtype | train.loss_chunk | temp MiB/device | args MiB/device |")
    print("|---|---|---|---|")
    for dtype, chunk in settings:
        cfg = load_config(
            CONFIG,
            [
                f"model.compute_dtype={dtype}",
                f"train.loss_chunk={chunk}",
                "logging.progress=false",
                *args.overrides,
            ],
        )
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
        mem = compiled.memory_analysis()
        print(
            f"| {dtype} | {chunk} | {mem.temp_size_in_bytes / 2**20:.1f} | "
            f"{mem.argument_size_in_bytes / 2**20:.1f} |",
            flush=True,
        )
        runs[dtype, chunk] = [compiled, state, batch, []]
    if not args.steps:
        return
    for run in runs.values():  # warm up
        compiled, state, batch, _ = run
        run[1], m = compiled(state, batch)
        jax.block_until_ready(m)
    for _ in range(args.steps):
        for run in runs.values():
            compiled, state, batch, times = run
            t0 = time.perf_counter()
            run[1], m = compiled(state, batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
    print("\n| compute dtype | train.loss_chunk | median s/step (loaded machine) | vs loss_chunk=0 |")
    print("|---|---|---|---|")
    for (dtype, chunk), run in runs.items():
        med = statistics.median(run[3])
        base = statistics.median(runs[dtype, 0][3]) if (dtype, 0) in runs else float("nan")
        print(f"| {dtype} | {chunk} | {med:.3f} | {base / med:.2f}x |")


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("loss_chunk", main))
