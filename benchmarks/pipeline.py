"""Pipeline parallelism: step time and compiled memory against microbatches and schedule.

    python benchmarks/pipeline.py [--stages 4] [--micro 4,8,16] [--steps 5]
    python benchmarks/pipeline.py --config configs/llama2-7b.yaml --target tpu:v5p-64 \\
        mesh.stage=4 mesh.fsdp=-1 train.global_batch_size=64 [--micro 4,8,16] [--out rows.json]

Without --target (CPU): the tiny dense model (8 layers, d_model 64) on 8 simulated CPU devices,
mesh stage x data; per row the train step's compiled per-device temp memory
(`memory_analysis`) and its measured step time (mean of --steps after one warm
step). CPU times on simulated devices share the host's cores: compare rows with
each other only, and say how loaded the machine was.

With --config and --target (deviceless): the real train step compiled for a TPU or GPU target
(`jaxtrain.compile.compile_report`, no estimate): per row the per-device HBM
(total and temp), whether it fits, and the collectives over `stage`.

Rows: a baseline without pipeline (stage folded into data, or fsdp for
deviceless), then per M in --micro: gpipe, and circular with 2 repeats (where
the layers split). Each row also gives the bubble (S-1)/(M*R+S-1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MiB = 2**20


def _rows(stages: int, micro: list[int], n_layers: int):
    yield "no pipeline", None
    for m in micro:
        yield f"gpipe M={m}", dict(microbatches=m, schedule="gpipe", repeats=1)
        if n_layers % (2 * stages) == 0 and m >= stages:
            yield f"circular R=2 M={m}", dict(microbatches=m, schedule="circular", repeats=2)


def _bubble(stages, p):
    from jaxtrain.sharding import bubble_fraction

    return 0.0 if p is None else bubble_fraction(stages, p["microbatches"], p["repeats"])


def run_cpu(args) -> list[dict]:
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    from jaxtrain import sharding
    from jaxtrain.data import make_data_iterator
    from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.trainer.batches import batch_to_device
    from jaxtrain.trainer.program import build_program
    from tests.conftest import replace, tiny_config

    S = args.stages
    base = tiny_config(
        None,
        "model.d_model=64",
        "model.mlp_dim=256",
        "model.vocab_size=256",
        "model.n_layers=8",
        "train.seq_len=64",
        f"train.global_batch_size={args.batch}",
    )
    rows = []
    for name, p in _rows(S, args.micro, base.model.n_layers):
        if p is None:
            cfg = replace(base, mesh=dict(data=8))
        else:
            cfg = replace(base, mesh=dict(stage=S, data=8 // S), pipeline=p)
        mesh = sharding.make_mesh(cfg.mesh.sizes(), jax.devices()[:8])
        cfg = resolve_for_mesh(cfg, mesh)
        rules = axis_rules(cfg)
        data = make_data_iterator(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            seq_len=cfg.train.seq_len,
            global_batch_size=cfg.train.global_batch_size,
            seed=0,
        )
        with jax.set_mesh(mesh), sharding.axis_rules(rules):
            program = build_program(cfg, mesh, rules)
            state = program.init()
            batch = batch_to_device(next(data), program.batch_sharding)
            t0 = time.perf_counter()
            compiled = program.step.lower(state, batch).compile()
            compile_s = time.perf_counter() - t0
            mem = compiled_memory(compiled)
            state, m = compiled(state, batch)  # warm
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = compiled(state, batch)
            jax.block_until_ready(m)
            step_s = (time.perf_counter() - t0) / args.steps
        rows.append(
            dict(
                row=name,
                bubble=_bubble(S, p),
                temp_mib=mem["temp"] / MiB,
                step_ms=1e3 * step_s,
                compile_s=compile_s,
                loss=float(m["loss"]),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_deviceless(args) -> list[dict]:
    import dataclasses

    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import compile_report, parse_target

    target = parse_target(args.target, slices=args.slices, hosts=args.hosts)
    base = load_config(args.config, args.overrides)
    S = base.mesh.stage
    rows = []
    for name, p in _rows(S, args.micro, base.model.n_layers):
        if p is None:
            mesh = dataclasses.replace(
                base.mesh, stage=1, fsdp=base.mesh.fsdp * S if base.mesh.fsdp > 0 else -1
            )
            cfg = dataclasses.replace(base, mesh=mesh)
        else:
            cfg = dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, **p))
        t0 = time.perf_counter()
        r = compile_report(cfg, target, estimate=False)
        mem = r.get("memory") or {}
        coll = r.get("collectives") or {}
        rows.append(
            dict(
                row=name,
                target=r["target"],
                mesh=r["mesh"],
                bubble=_bubble(S, p),
                fits=r["fits"],
                hbm_gib=(mem.get("total") or 0) / 2**30,
                temp_gib=(mem.get("temp") or 0) / 2**30,
                collective_permutes=(coll.get("collective-permute") or {}).get("count", 0),
                compile_s=time.perf_counter() - t0,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k not in ("target",)]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="deviceless: dotted overrides of --config")
    ap.add_argument("--micro", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--stages", type=int, default=4, help="cpu: pipeline stages")
    ap.add_argument("--batch", type=int, default=32, help="cpu: global batch")
    ap.add_argument("--steps", type=int, default=5, help="cpu: timed steps")
    ap.add_argument("--config", help="deviceless: the run config (its mesh.stage > 1)")
    ap.add_argument("--target", help="deviceless: tpu:v5p-64, gpu:h100, ... (none: CPU)")
    ap.add_argument("--slices", type=int, default=1)
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--out", help="deviceless: write the rows here (JSON) as they compile")
    args = ap.parse_args(argv)
    if bool(args.config) != bool(args.target):
        ap.error("--config and --target go together (deviceless); neither: the CPU run")
    rows = run_deviceless(args) if args.target else run_cpu(args)
    print(markdown(rows))


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("pipeline", main))
