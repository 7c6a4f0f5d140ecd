"""The frontier presets on their targets: deviceless compiles, and the planner's estimates.

    JAX_PLATFORMS=cpu python benchmarks/presets.py compile configs/gpt-oss-20b.yaml \\
        --target gpu:h100 --hosts 1 --gpus-per-host 8
    JAX_PLATFORMS=cpu python benchmarks/presets.py estimate configs/deepseek-v3-671b.yaml \\
        --target tpu:v5p-1024 --compiled benchmarks/results/presets/FILE.json

`compile`: one `jaxtrain compile --json` run in its own process (the real TPU or XLA:GPU
compiler, no accelerator). The report is the result file's `figures`, its row the `compile`
table (per-device memory = args + output - aliased + temp, as `jaxtrain compile` prints).

`estimate`: the planner's analytic model for the same config on the same target, with every
`auto` resolved as the compile resolved it (the remat policy, mesh, loss chunks and head
sharding must come out as the compiled report says, or the script stops): the step time and
MFU by the roofline (`planner.analytic_step`: model FLOPs plus remat recompute plus the MoE
receive buffer's padding rows at the chip's peak, the fsdp, data, tensor and expert
collectives at its link bandwidth) and the memory per device (`footprint.estimate`) with the
attention the compile ran, against that compile's figure, read from its result file (`--compiled`:
the program is not compiled again), and with today's `auto` attention. The planner charges
the dropless grouped matmul its whole receive buffer (expert x the routed rows without
`model.moe.receive_factor`), as XLA's cost model does; megablox runs only the tiles holding
routed rows, so the MFU with the buffer at the balanced load (receive_factor 1) is given
beside it. A model, not a measurement: on a target without a machine here nothing is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
COMPILE_HEADER = ["preset", "target", "mesh, batch", "attention", "memory / device", "est. step, MFU"]
ESTIMATE_HEADER = [
    "preset", "target", "mesh, batch, remat", "compiled GiB (attention)", "planner GiB, same attention",
    "planner / compiled", "planner GiB, `auto` attention", "roofline step s (compute, fsdp, expert)",
    "roofline MFU",
    "roofline MFU, routed rows only",
]  # fmt: skip


def mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "one device"


def compile_row(preset: str, r: dict) -> list[str]:
    """The `compile` table's row of one `jaxtrain compile --json` report."""
    mem = r.get("memory") or {}
    if mem.get("argument") is not None:
        memory = (
            f"{mem['total'] / GIB:.1f} of {r['hbm_bytes'] / GIB:.1f} GiB "
            f"(args {mem['argument'] / GIB:.1f}, temp {mem['temp'] / GIB:.1f})"
        )
    else:
        memory = f"{mem['total'] / GIB:.1f} of {r['hbm_bytes'] / GIB:.1f} GiB" if mem.get("total") else "-"
    if not r["fits"]:
        memory += ": does not fit"
    est = "-"
    if r.get("step_seconds_est"):
        est = f"{r['step_seconds_est']:.2f} s, {100 * r['mfu_est']:.1f}%"
    batch = f"{r['global_batch_size']} x {r['seq_len']}"
    return [preset, r["target"], f"{mesh_text(r['mesh'])}, {batch}", r["attention_impl"], memory, est]


def run_compile(args: argparse.Namespace, extra: list[str]) -> int:
    import result_file  # benchmarks/: on the path when run as a script

    cmd = [sys.executable, "-m", "jaxtrain", "compile", args.config, *extra, *target_args(args), "--json"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = p.stdout.strip().splitlines()
    if p.returncode not in (0, 1) or not lines:
        print(p.stderr[-3000:], file=sys.stderr)
        return 1
    report = json.loads(lines[-1])
    preset = Path(args.config).stem
    result_file.add_figures(report=report, compile_command=" ".join(["jaxtrain", *cmd[3:]]))
    row = compile_row(preset, report)
    result_file.add_table("compile", COMPILE_HEADER, [row])
    print(json.dumps({k: report[k] for k in ("target", "mesh", "attention_impl", "remat", "fits")}))
    print("| " + " | ".join(row) + " |")
    return 0


def target_args(args: argparse.Namespace) -> list[str]:
    out = ["--target", args.target, "--hosts", str(args.hosts)]
    return out + (["--gpus-per-host", str(args.gpus_per_host)] if args.gpus_per_host else [])


def run_estimate(args: argparse.Namespace, extra: list[str]) -> int:
    import result_file  # benchmarks/: on the path when run as a script

    from jaxtrain.config import load_config
    from jaxtrain.planning.compile import config_for_target, parse_target, resolved_for_target
    from jaxtrain.planning.footprint import estimate, moe_row_factor
    from jaxtrain.planning.planner import analytic_step, recompute_flops_per_token
    from jaxtrain.sharding import hardware

    compiled_path = Path(args.compiled)
    compiled = json.loads(compiled_path.read_text())["figures"]
    compiled = compiled.get("report", compiled)  # this script's compile files nest the report
    target = parse_target(args.target, hosts=args.hosts, gpus_per_host=args.gpus_per_host)

    def resolved(*overrides: str):
        cfg, ici, dcn = config_for_target(load_config(args.config, [*extra, *overrides]), target)
        cfg, _ = resolved_for_target(cfg, target, ici, dcn)
        return cfg, {a: ici.get(a, 1) * dcn.get(a, 1) for a in ici}

    as_compiled, mesh = resolved(f"model.attention_impl={compiled['attention_impl']}")
    default, _ = resolved()
    same = {
        "mesh": ({a: s for a, s in mesh.items() if s > 1}, compiled["mesh"]),
        "remat": (as_compiled.model.remat, compiled["remat"]),
        "train.loss_chunk": (as_compiled.train.loss_chunk, compiled["loss_chunk"]),
        "mesh.head_sharding": (as_compiled.mesh.head_sharding, compiled["head_sharding"]),
        "train.global_batch_size": (as_compiled.train.global_batch_size, compiled["global_batch_size"]),
    }
    for key, (mine, theirs) in same.items():
        if mine != theirs:
            print(f"{key}: resolved {mine!r} here, {theirs!r} in {compiled_path.name}", file=sys.stderr)
            return 1
    chip = hardware.chip(target.generation)
    timing = analytic_step(as_compiled, mesh, chip, target.chips)
    memory = estimate(as_compiled, mesh, target.platform)
    memory_auto = estimate(default, mesh, target.platform)
    t, m = as_compiled.train, as_compiled.model
    tokens = t.global_batch_size * t.seq_len / target.num_devices
    peak = chip.peak_flops("bfloat16")
    padding = 0.0
    if m.moe is not None:  # planner._extra_flops_per_token's MoE term
        rows = moe_row_factor(as_compiled, mesh)
        padding = (rows - 1) * 18 * m.moe.top_k * m.d_model * m.moe.mlp_dim(m) * m.moe.num_moe_layers(m)
    # The planner charges the grouped matmul its whole receive buffer, as XLA's cost model does
    # (megablox declares 2 m k n over all m rows); megablox itself runs only the tiles that hold
    # routed rows (its grid's `num_active_tiles`): the same step with the buffer at the balanced
    # load (receive_factor 1, no padding rows) says what that convention costs.
    routed = timing
    if m.moe is not None and m.moe.dispatch == "dropless":
        balanced = dataclasses.replace(m, moe=dataclasses.replace(m.moe, receive_factor=1.0))
        routed = analytic_step(dataclasses.replace(as_compiled, model=balanced), mesh, chip, target.chips)
    model_s = timing["mfu"] * timing["step_s"]
    breakdown = {
        "model_flops_s": model_s,
        "recompute_s": recompute_flops_per_token(as_compiled) * tokens / peak,
        "moe_buffer_padding_s": padding * tokens / peak,
    }
    result_file.add_figures(
        compiled_file=compiled_path.name,
        compiled_total_bytes=compiled["memory"]["total"],
        compiled_attention_impl=compiled["attention_impl"],
        auto_attention_impl=default.model.attention_impl,
        analytic=dataclasses.asdict(memory) | {"total": memory.total},
        analytic_auto_attention=dataclasses.asdict(memory_auto) | {"total": memory_auto.total},
        analytic_over_compiled=memory.total / compiled["memory"]["total"],
        timing=timing,
        timing_routed_rows_only=routed,
        compute_breakdown=breakdown,
        peak_flops=peak,
        chip=target.generation,
    )
    compute, fsdp, expert = timing["compute_s"], timing["fsdp_s"], timing["expert_s"]
    row = [
        Path(args.config).stem,
        compiled["target"],
        f"{mesh_text(mesh)}, {t.global_batch_size} x {t.seq_len}, {m.remat}",
        f"{compiled['memory']['total'] / GIB:.1f} ({compiled['attention_impl']})",
        f"{memory.total / GIB:.1f}",
        f"{memory.total / compiled['memory']['total']:.2f}",
        f"{memory_auto.total / GIB:.1f} ({default.model.attention_impl})",
        f"{timing['step_s']:.2f} ({compute:.2f}, {fsdp:.2f}, {expert:.2f})",
        f"{100 * timing['mfu']:.1f}%",
        f"{100 * routed['mfu']:.1f}% ({routed['step_s']:.2f} s)",
    ]
    result_file.add_table("estimate", ESTIMATE_HEADER, [row])
    print(json.dumps({"timing": timing, "compute_breakdown": breakdown}))
    print("| " + " | ".join(row) + " |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("compile", "estimate"))
    ap.add_argument("config")
    ap.add_argument("--target", required=True)
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--gpus-per-host", type=int, default=None)
    ap.add_argument("--compiled", help="estimate: the result file of this config's compile")
    args, extra = ap.parse_known_args(argv)
    if args.mode == "estimate" and not args.compiled:
        ap.error("estimate needs --compiled RESULT_FILE")
    return run_compile(args, extra) if args.mode == "compile" else run_estimate(args, extra)


if __name__ == "__main__":
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("presets", main))
