"""What `jaxtrain compile` reports, read and written: the collectives in a compiled
program's HLO, the knobs that would help a program that does not fit, and the reports as
text (planning/compile.py and planning/decode.py build the report dicts)."""

from __future__ import annotations

import math
import re

from jaxtrain.config import Config
from jaxtrain.models.config import DTYPE_BYTES
from jaxtrain.planning.footprint import moment_bytes
from jaxtrain.sharding.collectives import match_op

GiB = 1024**3

# bits per element of each HLO element type (the f8 formats XLA names, complex included)
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32}
_BITS |= {"s64": 64, "u64": 64, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
_BITS |= dict.fromkeys(
    ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e8m0fnu"), 8
)
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_BITS, key=len, reverse=True)) + r")\[([0-9,]*)\]")


_DCN_ATTR = "_xla_megascale_transfer_type"
_DCN = re.compile(r"=\s*(.*?)\ssend\(.*" + _DCN_ATTR + r"=\"([A-Z_]+)\"")


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape: an array, or every array of a tuple (layouts are ignored)."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _BITS[dtype] // 8
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count": static occurrences, "bytes": summed result bytes per device}}.

    Static: a collective inside a loop body (the scanned layers) counts once.
    Async pairs count once (the `-start`; `-done` is skipped). For `-start`
    ops the result tuple also holds the operand, so bytes are halved there.
    Multi-slice TPU programs carry their DCN collectives as host-transfer
    sends tagged `_xla_megascale_transfer_type`; they appear as `dcn-all-reduce`
    etc. (bytes sent per device).
    """
    out: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        m = match_op(line)
        if not m:
            dcn = _DCN.search(line) if _DCN_ATTR in line else None
            if dcn:  # multi-slice TPU: DCN collectives are host-transfer sends
                entry = out.setdefault(
                    "dcn-" + dcn.group(2).lower().replace("_", "-"), {"count": 0, "bytes": 0}
                )
                entry["count"] += 1
                entry["bytes"] += shape_bytes(dcn.group(1).split("token[]")[0])
            continue
        _, shape_text, kind, start = m.groups()
        nbytes = shape_bytes(shape_text)
        if start and kind in ("all-gather", "collective-permute", "all-reduce"):
            nbytes //= 2
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


# --- what would help -----------------------------------------------------------------


def state_bytes_per_device(cfg: Config, num_devices: int) -> float:
    """Parameters + optimizer state per device when fully sharded (the floor no mesh beats)."""
    param_bytes = DTYPE_BYTES[cfg.model.param_dtype]
    return cfg.model.param_count() * (param_bytes + moment_bytes(cfg)) / num_devices


def suggestions(cfg: Config, report: dict) -> list[str]:
    """Which knobs would help, from what dominates the per-device memory."""
    mem = report.get("memory") or {}
    mesh = report.get("mesh", {})
    out = []
    state = mem.get("argument")
    temp = mem.get("temp")
    fsdp = mesh.get("fsdp", 1)
    n = report["num_devices"]
    floor = state_bytes_per_device(cfg, n)
    if floor > 0.8 * report["hbm_bytes"]:
        need = math.ceil(cfg.model.param_count() * 12 / (0.5 * report["hbm_bytes"]))
        out.append(
            f"parameters + AdamW state alone take {floor / GiB:.1f} GiB per device even fully "
            f"sharded over {n} devices: use at least ~{need} devices of this kind "
            "(a bigger slice, --slices, --hosts)"
        )
        state = float("inf")
    if state is None or state > (temp or 0):
        if fsdp < n:
            out.append(
                f"shard parameters and optimizer state wider: mesh.fsdp=-1 (now {fsdp} of {n} "
                "devices) or more devices (a bigger slice / more hosts)"
            )
        else:
            if floor <= 0.8 * report["hbm_bytes"]:
                out.append(
                    "parameters + optimizer state are already fully sharded: use more devices "
                    "(a bigger slice, --slices, --hosts)"
                )
    if cfg.model.remat != "full":
        out.append(f"model.remat=full (now {cfg.model.remat}): recompute activations in the backward pass")
    per_dev = report.get("per_device_batch", 0)
    out.append(
        f"smaller microbatches: train.microbatches={cfg.train.microbatches * 2} "
        f"(activations scale with the per-device microbatch, now "
        f"{per_dev / cfg.train.microbatches:g} sequences)"
    )
    if cfg.model.param_dtype == "float32" and state and state > (temp or 0):
        out.append("model.param_dtype=bfloat16 halves parameter + optimizer bytes (at a precision cost)")
    return out


# --- as text --------------------------------------------------------------------------


def _gib(x) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if abs(x) >= GiB / 10 else f"{x / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _target_and_mesh_lines(r: dict) -> list[str]:
    """The first two lines of both reports (training and decode)."""
    return [
        f"target      {r['target']}  [{r['device_kind']}, {r['num_devices']} devices]",
        f"mesh        {r['mesh'] or 'one device'}"
        + (f"  dcn {r['mesh_dcn']}" if r["mesh_dcn"] else "")
        + f"  rules={r['rules']}",
    ]


def format_report(r: dict) -> str:
    """`jaxtrain compile` (train mode) as text."""
    lines = [
        *_target_and_mesh_lines(r),
        f"model       {_count(r['params'])} params, attention={r['attention_impl']}, "
        f"remat={r['remat']}, batch {r['global_batch_size']} x {r['seq_len']} "
        f"({r['per_device_batch']:g}/device, {r['microbatches']} microbatch(es))",
    ]
    if r.get("pipeline"):
        bubble = r["pipeline_bubble"]
        lines.append(f"pipeline    {r['pipeline']}, bubble (idle share of its tick table) = {bubble:.3f}")
    if r.get("compile_s") is not None:
        lines.append(f"compile     {r['compile_s']:.1f} s")
    if r.get("compile_error"):
        lines.append(f"compiler    {r['compile_error'][:300]}")
    lines += _memory_lines(r) + _speed_lines(r)
    if r.get("collectives"):
        parts = [
            f"{k} x{v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in sorted(r["collectives"].items())
        ]
        lines.append("collectives " + ", ".join(parts) + "  [static count: loop bodies once]")
    if r.get("custom_calls") is not None:
        yes = lambda key: "yes" if r.get(key) else "no"
        lines.append(
            f"kernels     pallas {yes('pallas_in_program')}, cudnn {yes('cudnn_in_program')} "
            f"(custom calls: {', '.join(r['custom_calls']) or 'none'})"
        )
    lines += [f"note        {note}" for note in r.get("notes", [])]
    if not r["fits"]:
        lines += [f"try         {s}" for s in r.get("suggestions", [])]
    return "\n".join(lines)


def _memory_lines(r: dict) -> list[str]:
    """Memory per device against HBM, and the verdict."""
    mem, hbm, lines = r.get("memory"), r["hbm_bytes"], []
    if mem and "argument" in mem:
        lines.append(
            f"memory/dev  args {_gib(mem['argument'])}  output {_gib(mem['output'])}  aliased "
            f"{_gib(mem['alias'])}  temp {_gib(mem['temp'])}  code {_gib(mem['generated_code'])}"
        )
    if mem and mem.get("host_total"):
        lines.append(
            f"host/dev    {_gib(mem['host_total'])} pinned host (args {_gib(mem['host_argument'])}, temp "
            f"{_gib(mem['host_temp'])}): offloaded state / activations"
        )
    total = mem.get("total") if mem else None
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    if total is None:
        return [*lines, f"total/dev   unknown of {_gib(hbm)} HBM: {verdict}"]
    margin = r["margin_bytes"]
    line = (
        f"total/dev   {_gib(total)} of {_gib(hbm)} HBM ({100 * total / hbm:.1f}%): "
        f"{verdict}, {_gib(abs(margin))} {'free' if margin >= 0 else 'over'}"
    )
    if not r["fits"] and r.get("compile_error"):
        line += " (the compiler's figure; it stops at the first allocation that does not fit)"
    return [*lines, line]


def _speed_lines(r: dict) -> list[str]:
    """FLOPs per device, and the compiler's step-time estimate where there is one."""
    lines = []
    if r.get("model_flops_per_device") is not None:
        s = f"flops/step  {r['model_flops_per_device'] / 1e12:.1f} TFLOP per device (model, 6N + attention)"
        if r.get("xla_flops_over_model_flops"):
            s += (
                f"; XLA counts {r['xla_cost']['flops'] / 1e12:.1f} "
                f"({r['xla_flops_over_model_flops']:.2f}x, includes remat recompute)"
            )
        lines.append(s)
    if r.get("step_seconds_est"):
        lines.append(
            f"step time   {r['step_seconds_est']:.3f} s (XLA estimate, extrapolated from 1- and "
            f"2-layer compiles) -> MFU {100 * r['mfu_est']:.1f}% (compiler estimate, not measured)"
        )
    elif r.get("platform") == "gpu":
        lines.append("step time   n/a (XLA:GPU gives no cost analysis; measure on the cluster)")
    return lines


def format_decode_report(r: dict) -> str:
    """`jaxtrain compile --mode decode` as text."""
    hbm = r["hbm_bytes"]
    lines = [
        *_target_and_mesh_lines(r),
        f"model       {_count(r['params'])} params ({r['param_dtype']}; compute {r['compute_dtype']}), "
        f"attention={r['attention_impl']}",
        f"decode      batch {r['batch']}, cache {r['cache_len']} positions (--max-len {r['max_len']}); "
        f"prefill of {r['prompt_len']}-token prompts, then one token per row per step",
        f"kv cache    {_gib(r['kv_cache_bytes'])} in all, {_gib(r['kv_cache_bytes_per_device'])}/device, "
        f"{r['kv_cache_bytes_per_token']:,} B/token "
        f"({r['kv_cache_shards']} shards, spec {r['kv_cache_spec']}; compiled args: "
        f"{_gib(r.get('kv_cache_bytes_per_device_compiled'))})",
        f"params/dev  {_gib(r['param_bytes_per_device'])}",
    ]
    if "linear_state_bytes" in r:  # gated DeltaNet layers: their state, the same at any length
        lines.insert(
            -1,
            f"deltanet    {_gib(r['linear_state_bytes'])} of conv windows and states in all, "
            f"{_gib(r['linear_state_bytes_per_device'])}/device, at any length",
        )
    for name in ("prefill", "decode"):
        e = r[name]
        mem = e.get("memory") or {}
        if "argument" in mem:
            lines.append(
                f"{name:<11} args {_gib(mem['argument'])}  output {_gib(mem['output'])}  "
                f"aliased {_gib(mem['alias'])}  temp {_gib(mem['temp'])}  -> total {_gib(mem['total'])} "
                f"of {_gib(hbm)} ({100 * mem['total'] / hbm:.1f}%): {'fits' if e['fits'] else 'DOES NOT FIT'}"
                f"  [compile {e['compile_s']:.1f} s]"
            )
        else:
            lines.append(f"{name:<11} DOES NOT FIT: {e.get('compile_error', '')[:300]}")
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    if r.get("margin_bytes") is not None:
        word = "free" if r["margin_bytes"] >= 0 else "over"
        lines.append(f"verdict     {verdict}, {_gib(abs(r['margin_bytes']))} {word} at the peak")
    else:
        lines.append(f"verdict     {verdict}")
    for note in r.get("notes", []):
        lines.append(f"note        {note}")
    for s in r.get("suggestions", []):
        lines.append(f"try         {s}")
    return "\n".join(lines)
