"""Pipeline schedules compiled deviceless: per-device memory, the schedule's bubble and the
collectives over `stage`, one config under each schedule.

    python benchmarks/pipeline_schedules.py
    python benchmarks/pipeline_schedules.py --config configs/tiny.yaml --target gpu:h100 --hosts 1 \\
        --schedules gpipe,1f1b model.n_layers=4 mesh.stage=2 mesh.fsdp=4 pipeline.microbatches=4

Default: Llama-2-70B (configs/llama2-70b.yaml, `model.remat=full`) on 8 hosts of 8 H100,
stage 8 x tensor 8, 32 pipeline microbatches of 4 sequences of 4096 tokens
(`train.global_batch_size=128`), under gpipe, 1f1b, zero_bubble, and circular and
interleaved_1f1b with 2 repeats. Per schedule the train step is compiled for the target's
compile-only devices (the program `jaxtrain compile` builds) and read back:

- memory per device, total (arguments + outputs - aliased + temporaries) and temporaries
  (`compiled_memory`);
- the bubble, the idle share of the schedule's tick table (sharding/pipeline_tables.py), and
  the stage inputs the table keeps at once on one device (microbatch-blocks with repeats);
- the collectives whose replica groups span `stage` (sharding/collectives.py, static counts:
  an op in a loop body counts once), and whether any of them is an all-gather (a schedule
  that gathered weights or activations over `stage` would lose what pipelining saves).

Each schedule prints a JSON row as it compiles; the table `schedules` is what
docs/benchmarks.md quotes. Compiles of the 70B program take minutes each on a CPU host.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: the CUDA / TPU compilers run on the host
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB = 2**30
LLAMA2_70B = [
    "mesh.stage=8",
    "mesh.tensor=8",
    "mesh.fsdp=1",
    "mesh.data=1",
    "train.global_batch_size=128",
    "pipeline.microbatches=32",
]
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "circular", "interleaved_1f1b")
REPEATS = {"circular": 2, "interleaved_1f1b": 2}


def compile_schedule(config: str, overrides: list[str], target_text: str, hosts: int, schedule: str) -> dict:
    """One schedule's row: its compiled program's memory, bubble and collectives over stage."""
    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import (
        _compile_step,
        config_for_target,
        parse_target,
        resolved_for_target,
        target_mesh,
    )
    from jaxtrain.sharding.collectives import collectives_by_axes
    from jaxtrain.sharding.targets import compiled_memory
    from jaxtrain.trainer.program import pipeline_schedule

    repeats = REPEATS.get(schedule, 1)
    target = parse_target(target_text, hosts=hosts)
    cfg = load_config(config, [*overrides, f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"])
    cfg, ici, dcn = config_for_target(cfg, target)
    cfg, _ = resolved_for_target(cfg, target, ici, dcn)
    mesh = target_mesh(target, ici, dcn)
    pp = pipeline_schedule(cfg)
    t0 = time.perf_counter()
    compiled = _compile_step(cfg, mesh)
    compile_s = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    over_stage = [c for c in collectives_by_axes(compiled.as_text(), mesh) if "stage" in c.axes]
    return {
        "schedule": schedule,
        "stages": pp.stages,
        "microbatches": pp.microbatches,
        "repeats": pp.repeats,
        "target": target.describe(),
        "mesh": {a: s for a, s in mesh.shape.items() if s > 1},
        "total_bytes": mem["total"],
        "temp_bytes": mem["temp"],
        "hbm_bytes": target.hbm_bytes,
        "bubble": pp.bubble,
        "inputs_held": int(max(pp.table.live_inputs())),
        "collectives_over_stage": dict(sorted(collections.Counter(c.kind for c in over_stage).items())),
        "all_gather_over_stage": any(c.kind == "all-gather" for c in over_stage),
        "compile_s": compile_s,
    }


TABLE_HEADER = [
    "schedule",
    "S, M, R",
    "total / device",
    "temporaries",
    "bubble (its table)",
    "inputs held (table)",
    "collectives over stage (static)",
    "all-gather over stage",
]


def table_rows(rows: list[dict]) -> list[list[str]]:
    cells = []
    for r in rows:
        kinds = ", ".join(f"{k} x{n}" for k, n in r["collectives_over_stage"].items()) or "none"
        cells.append(
            [
                r["schedule"],
                f"{r['stages']}, {r['microbatches']}, {r['repeats']}",
                f"{r['total_bytes'] / GiB:.2f} of {r['hbm_bytes'] / GiB:.1f} GiB",
                f"{r['temp_bytes'] / GiB:.2f} GiB",
                f"{r['bubble']:.3f}",
                str(r["inputs_held"]),
                kinds,
                "yes" if r["all_gather_over_stage"] else "no",
            ]
        )
    return cells


def main(argv=None) -> int:
    try:
        import result_file  # benchmarks/: on the path when run as a script
    except ImportError:
        from benchmarks import result_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="dotted overrides of --config (default: the 70B layout)")
    ap.add_argument("--config", default="configs/llama2-70b.yaml")
    ap.add_argument("--target", default="gpu:h100")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="pipeline.schedule values")
    args = ap.parse_args(argv)
    overrides = args.overrides or LLAMA2_70B
    rows = []
    for schedule in args.schedules.split(","):
        rows.append(compile_schedule(args.config, overrides, args.target, args.hosts, schedule))
        print(json.dumps(rows[-1]), flush=True)
    cells = table_rows(rows)
    result_file.add_figures(config=args.config, overrides=overrides, rows=rows)
    result_file.add_table("schedules", TABLE_HEADER, cells)
    print("| " + " | ".join(TABLE_HEADER) + " |")
    print("|" + "---|" * len(TABLE_HEADER))
    for row in cells:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("pipeline_schedules", main))
