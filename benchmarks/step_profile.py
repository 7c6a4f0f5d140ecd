"""Where a train step spends its time: a jax.profiler trace of the compiled step, summed by
op kind, plus the heaviest ops with their HLO shapes.

    python benchmarks/step_profile.py [--steps 2] [--top 15] [overrides...]
    python benchmarks/step_profile.py model.compute_dtype=bfloat16 model.vocab_size=2048
    python benchmarks/step_profile.py --gpu [--steps 3] [overrides...]

--gpu: configs/gpu-peer.yaml on this process's first GPU (every `auto` resolved as `jaxtrain
train` resolves it). The GPU's kernels are summed by what they do (matmuls, attention,
elementwise and reduction fusions, copies, collectives; "moves: ..." for the instructions that
only move or fill memory, by the kinds benchmarks/data_movement.py counts without a GPU)
and by the part of the step their HLO op belongs to (the named scopes forward, loss,
optimizer; the backward pass is transpose(jvp(...))), from the HLO op each kernel event names
(CUDA graphs are turned off for this, `--xla_gpu_enable_command_buffer=`, as kernels launched
from a graph name none);
the share is of the GPU's busy time, and the step time against it says how long the GPU sat
idle.

Without --gpu (the CPU stand-in):
Runs configs/bench-peer.yaml (8 simulated CPU devices, fsdp=8, remat none unless
overridden) in this process: 6 warm-up steps, then `--steps` traced ones. The figures are
device-thread time: 8 device threads share the host's cores, so an op's time includes the
time its thread waited for a core, and "waits" is time threads spent blocked in a
collective's rendezvous for the slowest device. Shares, not seconds, are what compare
between runs. Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import os
import sys

if "--gpu" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.data import make_data_iterator  # noqa: E402
from jaxtrain.planning.data_movement import kernels, moves  # noqa: E402
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh  # noqa: E402
from jaxtrain.sharding import hardware  # noqa: E402
from jaxtrain.trainer.batches import batch_to_device  # noqa: E402
from jaxtrain.trainer.program import build_program  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bench-peer.yaml"
GPU_CONFIG = CONFIG.parent / "gpu-peer.yaml"
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


def profiled_steps(cfg, devices, steps: int):
    """(resolved cfg, compiled step, step times of 6 warm-up steps, the trace file of `steps`
    more): `cfg`'s train step on a mesh of `devices`, run as `jaxtrain train` builds it."""
    mesh = sharding.make_mesh(cfg.mesh.sizes(), devices)
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
    for _ in range(steps):
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
    jax.profiler.stop_trace()
    return cfg, compiled, times, sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]


def gpu_kind(op: str, kernel: str, hlo: dict[str, tuple[str, str]], moving: dict | None = None) -> str:
    """What a GPU kernel does, from its HLO instruction (opcode and text) where the trace
    names one, else from the kernel's own name. `moving`: instructions that only move or fill
    memory, by kind (jaxtrain/planning/data_movement.py), named as benchmarks/data_movement.py
    names them, so that the profile and the deviceless figures compare."""
    if moving and op in moving:
        return f"moves: {moving[op]}"
    opcode, text = hlo.get(op, ("", ""))
    probe = f"{op} {opcode} {text} {kernel}".lower()
    if "fmha" in probe or "flash" in probe or "attention" in probe:
        return "attention"
    if "pallas" in probe and any(k in probe for k in ("matmul", "ragged_dot", "gmm")):
        return "grouped matmuls (Pallas)"  # dropless MoE's experts (models/moe.py)
    if "triton" in probe and "gemm" not in probe:
        return "attention" if "pallas" in probe or "mha" in probe else "triton fusions"
    if any(k in probe for k in ("gemm", "cublas", "xmma", "cutlass", "nvjet", "dot(")) or opcode == "dot":
        return "matmuls"
    if any(k in probe for k in ("nccl", "all-gather", "all-reduce", "reduce-scatter", "collective")):
        return "collectives"
    if opcode in ("copy", "transpose") or kernel.startswith(("copy", "transpose")) or "memcpy" in probe:
        return "copies and transposes"
    if "reduce" in probe:
        return "reductions"
    return "elementwise fusions"


def phase(op_name: str) -> str:
    """The part of the step an op's metadata op_name puts it in (trainer/step.py's scopes)."""
    if "optimizer" in op_name:
        return "optimizer"
    backward = "transpose(" in op_name
    if "loss" in op_name:
        return "loss backward" if backward else "loss"
    if "forward" in op_name:
        return "backward" if backward else "forward"
    return "other"


def hlo_table(text: str) -> tuple[dict[str, tuple[str, str]], dict[str, str], dict[str, str]]:
    """From compiled HLO text: name -> (opcode, the instruction's text), name -> shape, name ->
    metadata op_name."""
    ops, shapes, names = {}, {}, {}
    # a multi-output op's shape is a tuple, with spaces: "(f32[8]{0}, f32[8]{0})"
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) (\w[\w-]*)\((.*)$", text, re.M):
        name, shape, opcode, rest = m.groups()
        found = re.search(r'op_name="([^"]*)"', rest)
        # the text gpu_kind reads: the start (target, operands) and the op_name, which a
        # custom call's long operand list can push past the start
        ops[name], shapes[name] = (opcode, rest[:400] + (f" {found.group(0)}" if found else "")), shape
        if found:
            names[name] = found.group(1)
    return ops, shapes, names


def gpu_main(args) -> None:
    from jaxtrain import host

    # CUDA graphs off: a kernel launched from a command buffer names no HLO op in the trace
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
    host.configure_host()  # the GPU launch flags jaxtrain train would start with
    cfg = load_config(GPU_CONFIG, ["logging.progress=false", *args.overrides])
    cfg, compiled, times, trace = profiled_steps(cfg, jax.devices()[:1], args.steps)
    program = compiled.as_text()
    if args.save:  # the raw trace and the program, to read again offline
        os.makedirs(args.save, exist_ok=True)
        shutil.copy(trace, os.path.join(args.save, "step.trace.json.gz"))
        with open(os.path.join(args.save, "step.hlo.txt"), "w") as f:
            f.write(program)
    events = json.load(gzip.open(trace))["traceEvents"]
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "GPU" in str(e.get("args", {}).get("name"))
    }
    dry_run = not gpu_pids  # on CPU: its threads' events that name an HLO op of the step
    if dry_run:
        gpu_pids = {e.get("pid") for e in events}
    # the GPU's kernels are on its "Stream #..." lines; the derived lines (XLA Ops, XLA Modules,
    # name scopes) repeat the same time
    streams = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and "Stream" in str(e.get("args", {}).get("name"))
    }
    ops, shapes, op_names = hlo_table(program)
    moving = {name: kind for name, kind, _, _ in moves(program)}
    # bytes each op reads and writes a step (data_movement.kernels): how near memory speed it ran
    traffic = {name: (read + written) * runs for name, _, read, written, runs, _ in kernels(program)}
    chip = hardware.chip_for_device_kind(jax.devices()[0].device_kind)
    bandwidth = chip.hbm_bytes_per_s if chip and chip.hbm_bytes_per_s else None  # None: not a known GPU

    def hbm_speed(nbytes: float, ms: float) -> str:
        return f"{nbytes / (ms / 1e3) / bandwidth:.0%}" if bandwidth and ms > 0 else "n/a"

    # a fusion's kernel is named after it with "." as "_" (gemm_fusion_dot.25: gemm_fusion_dot_25)
    by_kernel_name = {name.replace(".", "_"): name for name in ops}
    by_kind, by_phase, by_both, per_op = (collections.Counter() for _ in range(4))
    kind_bytes, kind_ops, op_ms = collections.Counter(), set(), collections.Counter()
    unnamed = 0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        a = e.get("args") or {}
        op = a.get("hlo_op") or a.get("long_name") or e["name"]
        op = op if op in ops else by_kernel_name.get(op, op)
        if dry_run and op not in ops:
            continue
        unnamed += op not in ops
        ms = e["dur"] / 1e3 / args.steps
        k, ph = gpu_kind(op, e["name"], ops, moving), phase(op_names.get(op, ""))
        by_kind[k] += ms
        by_phase[ph] += ms
        by_both[(ph, k)] += ms
        per_op[(op, e["name"][:60])] += ms
        op_ms[op] += ms  # all of an op's kernels: what its bytes took
        if op in traffic and op not in kind_ops:  # an op's bytes once, however many kernels it ran
            kind_ops.add(op)
            kind_bytes[k] += traffic[op]
    busy = sum(by_kind.values()) or float("nan")
    step_ms = 1e3 * statistics.median(times[2:])
    m = cfg.model
    print(
        f"## Step profile on {jax.devices()[0].device_kind} (jax {jax.__version__}): configs/gpu-peer.yaml "
        f"{' '.join(args.overrides)}; attention={m.attention_impl}, remat={m.remat}, "
        f"loss_chunk={cfg.train.loss_chunk}"
    )
    print(
        f"step {step_ms:.1f} ms (median of steps 3..6); GPU busy {busy:.1f} ms/step "
        f"({100 * busy / step_ms:.0f}%); {unnamed} kernel events named no HLO op of the step"
    )
    print(
        "\nGB: what the kind's kernels read and write a step, from the compiled program "
        "(jaxtrain/planning/data_movement.py); HBM speed: those bytes over the kind's time, "
        + (f"against the chip's {bandwidth / 1e9:.0f} GB/s" if bandwidth else "n/a on this device")
    )
    print("\n| kind | GPU ms/step | share of busy | GB | HBM speed |\n|---|---:|---:|---:|---:|")
    for key, ms in by_kind.most_common():
        gb = kind_bytes[key] / 1e9
        print(f"| {key} | {ms:.1f} | {100 * ms / busy:.1f}% | {gb:.1f} | {hbm_speed(kind_bytes[key], ms)} |")
    print("\n| part of the step | GPU ms/step | share of busy |\n|---|---:|---:|")
    for key, ms in by_phase.most_common():
        print(f"| {key} | {ms:.1f} | {100 * ms / busy:.1f}% |")
    print("\n| part | kind | GPU ms/step |\n|---|---|---:|")
    for (ph, k), ms in by_both.most_common(12):
        print(f"| {ph} | {k} | {ms:.1f} |")
    print("\n| HLO op | kernel | GPU ms/step | HBM speed | shape | op_name |\n|---|---|---:|---:|---|---|")
    for (op, kernel), ms in per_op.most_common(args.top):
        speed = hbm_speed(traffic[op], op_ms[op]) if op in traffic else ""
        print(
            f"| {op} | `{kernel}` | {ms:.2f} | {speed} | `{shapes.get(op, '')[:40]}` | "
            f"`{op_names.get(op, '')[-70:]}` |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gpu", action="store_true", help="configs/gpu-peer.yaml on this GPU")
    ap.add_argument("--save", default=None, help="--gpu: write the trace and the HLO text here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.gpu:
        return gpu_main(args)
    cfg = load_config(CONFIG, ["logging.progress=false", "model.remat=none", *args.overrides])
    cfg, compiled, times, trace = profiled_steps(cfg, jax.devices()[:8], args.steps)
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
    import result_file  # benchmarks/: on the path when run as a script

    sys.exit(result_file.run("step_profile", main))
