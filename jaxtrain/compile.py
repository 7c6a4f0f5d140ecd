"""`jaxtrain compile`: AOT-compile the real train step for a TPU slice or GPU cluster.

Nothing runs and nothing is allocated: compile-only devices for the target
(`sharding.targets`), the mesh from the config (ICI x DCN), and
`program.step.lower(abstract state, abstract batch).compile()` -- the same
jitted, donated step `jaxtrain train` runs -- through the real TPU or
XLA:GPU compiler. From the compiled program we read:

- memory per device (`memory_analysis()`, of the real scanned program):
  argument + output - aliased + temp, against the device's HBM;
- the collectives in the optimized HLO (kind, static count, bytes);
- FLOPs and XLA's estimated step time (TPU only). `cost_analysis()` counts a
  loop body once, so the scanned program undercounts by the layer count. We
  compile 1- and 2-layer *unrolled* variants of the same config (same mesh,
  batch per microbatch), take the difference as the per-layer cost and
  extrapolate: cost(L) = c1 + (L - 1) * (c2 - c1), times the microbatch
  count. TPU collective-matmul loops (windowed einsums) would be counted once
  too, so the variants are compiled without them. The FLOPs are checked
  against the analytic count (jaxtrain.flops, plus remat recompute); where
  XLA still counts fewer, the time is scaled up by the shortfall, and the
  ratio is printed so this shows.

`--mode decode` (`compile_decode_report`) compiles generation instead: the prefill
and one decode step (models.generation) with the KV cache sharded by its logical
axes, and reports the cache and the memory per device (no time estimate).

What this proves: the program partitions, compiles and fits, and which
collectives it emits. It does not measure speed: step time and MFU are the
compiler's estimate.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jaxtrain.config import Config, ConfigError
from jaxtrain.sharding import hardware
from jaxtrain.sharding.collectives import COLLECTIVES

GiB = 1024**3

# `--target` generations: rows of the one hardware table (peak FLOP/s, HBM, chips per host).
_TPU = {name: c for name, c in hardware.CHIPS.items() if c.platform == "tpu" and c.torus_dims}
_GPU = {name: hardware.chip(name) for name in ("h100", "a100")}  # those sharding.targets can build


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: a TPU slice (x slices) or GPU hosts x GPUs per host."""

    platform: str  # "tpu" | "gpu"
    name: str  # "v5p-64", "h100"
    generation: str  # "v5p", "h100", ...
    chips: int  # devices per slice (TPU) or per host (GPU)
    groups: int  # TPU slices or GPU hosts (the DCN tier)
    topology: str  # libtpu topology name ("v5p:2x4x4") or GPU "Hx1xG"
    hbm_bytes: int
    peak_flops: float  # dense bf16 per device
    device_kind: str

    @property
    def num_devices(self) -> int:
        return self.chips * self.groups

    def describe(self) -> str:
        if self.platform == "tpu":
            s = f"tpu:{self.name} ({self.chips} chips, {self.topology})"
            return s + (f" x {self.groups} slices" if self.groups > 1 else "")
        return f"gpu:{self.name} {self.groups} host(s) x {self.chips} GPUs"


def _torus_shape(chips: int, dims: int) -> tuple[int, ...]:
    """Slice shape for a chip count: powers of two, smallest dims first (2x2x1, 2x2x2, 2x2x4, ...)."""
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(f"--target: {chips} chips is not a power of two")
    if dims == 3 and chips < 4:
        raise ConfigError(f"--target: a 3D TPU slice needs at least 4 chips, got {chips}")
    shape = [1] * dims
    if dims == 3:
        shape = [2, 2, 1]
        rest = chips // 4
    else:
        rest = chips
    while rest > 1:  # double the smallest dimension (the last one on ties)
        i = min(range(dims), key=lambda j: (shape[j], -j))
        shape[i] *= 2
        rest //= 2
    if dims == 3 and chips == 4:
        return (2, 2, 1)
    return tuple(sorted(shape))


def parse_target(text: str, *, slices: int = 1, hosts: int = 1, gpus_per_host: int | None = None) -> Target:
    """`tpu:v5p-256` (x `slices`) or `gpu:h100` / `gpu:a100` (`hosts` x `gpus_per_host`,
    by default the hardware table's GPUs per host: 8)."""
    platform, _, name = (text or "").partition(":")
    platform, name = platform.lower(), name.lower()
    if platform == "tpu":
        m = re.fullmatch(r"(" + "|".join(_TPU) + r")-(\d+)", name)
        if not m:
            raise ConfigError(
                f"--target={text!r}: expected tpu:GEN-N with GEN one of "
                f"{', '.join(_TPU)} (e.g. tpu:v5p-64, tpu:v5e-256)"
            )
        if slices < 1:
            raise ConfigError(f"--slices={slices}: expected a positive integer")
        gen, n = m.group(1), int(m.group(2))
        chip = _TPU[gen]
        if n % chip.cores_per_chip:
            raise ConfigError(
                f"--target={text!r}: {gen} slice names count TensorCores "
                f"({chip.cores_per_chip} per chip); expected an even number"
            )
        chips = n // chip.cores_per_chip
        shape = _torus_shape(chips, chip.torus_dims)
        return Target(
            "tpu",
            name,
            gen,
            chips,
            slices,
            f"{gen}:{'x'.join(map(str, shape))}",
            chip.hbm_bytes,
            chip.bf16_flops,
            chip.description,
        )
    if platform == "gpu":
        if name not in _GPU:
            raise ConfigError(f"--target={text!r}: expected gpu:h100 or gpu:a100")
        chip = _GPU[name]
        gpus_per_host = chip.chips_per_host if gpus_per_host is None else gpus_per_host
        if hosts < 1 or gpus_per_host < 1:
            raise ConfigError(f"--hosts={hosts} --gpus-per-host={gpus_per_host}: expected positive integers")
        if slices != 1:
            raise ConfigError("--slices applies to TPU targets; use --hosts for GPU clusters")
        return Target(
            "gpu",
            name,
            name,
            gpus_per_host,
            hosts,
            f"{hosts}x1x{gpus_per_host}",
            chip.hbm_bytes,
            chip.bf16_flops,
            chip.description,
        )
    raise ConfigError(f"--target={text!r}: expected tpu:GEN-N (e.g. tpu:v5p-64) or gpu:h100")


def tpu_wraparound(target: Target) -> tuple[bool, bool, bool]:
    """Whether the slice's ICI wraps around in each dim (a torus, not a mesh). A v5p slice
    is a full torus from 4x4x4 on (dims that are multiples of 4), as in MaxText's
    accelerator table; smaller v5p slices and v4/v5e/v6e are compiled without wraparound.
    Without it XLA:TPU lowers every all-gather of a v5p-128 as zeros + dynamic-update-slice
    + all-reduce (about 3x the bytes), and estimated Mixtral one layer 8% slower."""
    dims = [int(x) for x in target.topology.split(":")[1].split("x")]
    full = target.generation == "v5p" and len(dims) == 3 and all(d >= 4 and d % 4 == 0 for d in dims)
    return (full, full, full)


def target_devices(target: Target) -> list:
    """Compile-only devices for the target (raises targets.DevicelessUnavailableError)."""
    from jaxtrain.sharding import targets

    if target.platform == "tpu":
        chip = _TPU[target.generation]
        small = math.prod(int(x) for x in target.topology.split(":")[1].split("x")) < chip.chips_per_host
        per_host = (1, 1, 1) if small else (2, chip.chips_per_host // 2, 1)  # 4 chips per host: 2x2x1
        chip_config = "megacore" if chip.cores_per_chip == 2 else "default"
        return targets.tpu_topology_devices(
            target.topology, chip_config, per_host, num_slices=target.groups, wrap=tpu_wraparound(target)
        )
    if target.generation == "a100":
        return targets.a100_devices(target.groups, target.chips)
    return targets.h100_devices(target.groups, target.chips)


# --- config for a target ------------------------------------------------------


def config_for_target(cfg: Config, target: Target) -> tuple[Config, dict[str, int], dict[str, int]]:
    """Resolve `attention_impl=auto` for the target platform and the mesh (ICI, DCN).

    With several slices/hosts and no `mesh.dcn_*` set, TPU slices get data
    parallelism across the DCN (`mesh.dcn_data = slices`); GPU hosts keep one
    flat mesh over all GPUs (the mesh axes then span hosts in host-major order).

    A mesh with every ICI axis 1 (the tiny configs' default, meant for one device)
    on a multi-device target gets `mesh.fsdp` filled to the devices per slice/host,
    as `mesh.fsdp=-1` would, rather than failing on the device count; the returned
    config carries the filled degree (`compile_report` notes it).
    """
    from jaxtrain.models.attention import resolve_impl

    impl = resolve_impl(cfg.model.attention_impl, target.platform)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl))
    dcn = cfg.mesh.dcn_sizes()
    n_dcn = math.prod(dcn.values())
    if target.platform == "tpu":
        if n_dcn == 1 and target.groups > 1:
            dcn = {**dcn, "data": target.groups}
        elif n_dcn != target.groups:
            raise ConfigError(
                f"mesh.dcn_*: the DCN axes multiply to {n_dcn}, expected the slice "
                f"count --slices={target.groups}"
            )
        per_group = target.chips
    else:
        if n_dcn not in (1, target.groups):
            raise ConfigError(
                f"mesh.dcn_*: the DCN axes multiply to {n_dcn}, expected 1 or the "
                f"host count --hosts={target.groups}"
            )
        per_group = target.chips if n_dcn > 1 else target.num_devices
    from jaxtrain import sharding

    sizes = cfg.mesh.sizes()
    fill_fsdp = per_group > 1 and all(s == 1 for s in sizes.values())
    try:
        ici = sharding.mesh_shape_from_sizes({**sizes, "fsdp": -1} if fill_fsdp else sizes, per_group)
    except ValueError as e:
        raise ConfigError(f"mesh on {target.describe()}: {e}") from None
    if fill_fsdp:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=ici["fsdp"]))
    full = {a: ici[a] * dcn.get(a, 1) for a in ici}
    dp = full["data"] * full["fsdp"] * full["expert"]
    t = cfg.train
    if t.global_batch_size % (dp * t.microbatches):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size}: expected a multiple of "
            f"data*fsdp*expert ({dp}) x train.microbatches ({t.microbatches}) on "
            f"{target.describe()}"
        )
    return cfg, ici, {a: s for a, s in dcn.items() if s > 1}


def resolve_remat_for_target(cfg: Config, target: Target, ici: dict, dcn: dict) -> tuple[Config, str | None]:
    """`model.remat: auto` against the target's HBM (jaxtrain/planner.py), with its note."""
    from jaxtrain.planner import resolve_remat

    mesh = {a: ici.get(a, 1) * dcn.get(a, 1) for a in ici}
    return resolve_remat(
        cfg,
        mesh,
        target.hbm_bytes,
        attention_impl=cfg.model.attention_impl,
        platform=target.platform,
        where=f"{target.generation} HBM",
    )


# --- compiling ----------------------------------------------------------------


def _compile_step(cfg: Config, mesh, rules, compiler_options: dict | None = None):
    import jax

    from jaxtrain import sharding
    from jaxtrain.train_step import abstract_batch, build_program

    # build_program runs a few eager ops (optax state templates); they cannot run on
    # compile-only devices, so only the tracing happens under the target mesh.
    with sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        shapes = jax.eval_shape(program.init)
        state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, program.state_shardings
        )
        batch = abstract_batch(cfg, program.batch_sharding)
        return program.step.lower(state, batch).compile(compiler_options=compiler_options)


class OutOfMemoryAtCompile(RuntimeError):
    """The device compiler itself refused the program for lack of memory."""


def _compile_or_oom(cfg, mesh, rules):
    try:
        return _compile_step(cfg, mesh, rules)
    except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED from the TPU compiler
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text.lower():
            raise OutOfMemoryAtCompile(text) from None
        raise


_SHAPE = re.compile(
    r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64)"
    r"\[([0-9,]*)\]"
)
_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
}
_COLL = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


_DCN = re.compile(r"=\s*(.*?)\ssend\(.*_xla_megascale_transfer_type=\"([A-Z_]+)\"")


def _shape_bytes(shape_text: str) -> int:
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
        m = _COLL.search(line)
        if not m:
            dcn = _DCN.search(line)
            if dcn:  # multi-slice TPU: DCN collectives are host-transfer sends
                entry = out.setdefault(
                    "dcn-" + dcn.group(2).lower().replace("_", "-"), {"count": 0, "bytes": 0}
                )
                entry["count"] += 1
                entry["bytes"] += _shape_bytes(dcn.group(1).split("token[]")[0])
            continue
        shape_text, kind, start = m.groups()
        nbytes = _shape_bytes(shape_text)
        if start and kind in ("all-gather", "collective-permute", "all-reduce"):
            nbytes //= 2
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


def _variant(cfg: Config, n_layers: int) -> Config:
    """The same config with `n_layers` unrolled layers and one microbatch's batch."""
    t = cfg.train
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, n_layers=n_layers, scan_layers=False),
        train=dataclasses.replace(t, global_batch_size=t.global_batch_size // t.microbatches, microbatches=1),
    )


# For the 1- and 2-layer cost variants only: XLA's TPU collective matmuls
# (windowed einsums: an FSDP all-gather or reduce-scatter fused with its matmul
# as a while loop) are counted once by cost_analysis, which hid about 45% of a
# Llama-2-7B layer's FLOPs. Without them every matmul is counted, and the
# extrapolated FLOPs match the analytic model + remat count (ratio ~0.99); the
# time estimate is then that of the same layer with separate collectives.
# Memory always comes from the real program, compiled with default flags.
_COST_VARIANT_OPTIONS = {
    "tpu": {
        "xla_tpu_enable_windowed_einsum_for_all_gather": False,
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    }
}


def _extrapolated_cost(
    cfg: Config, mesh, rules, platform: str, *, charge_kernels: bool = True
) -> dict[str, float] | None:
    from jaxtrain.pallas_kernels.flash_attention import cost_estimates
    from jaxtrain.sharding.targets import compiled_cost

    opts = _COST_VARIANT_OPTIONS.get(platform)
    with cost_estimates(charge_kernels):
        c1 = compiled_cost(_compile_step(_variant(cfg, 1), mesh, rules, opts))
        c2 = compiled_cost(_compile_step(_variant(cfg, 2), mesh, rules, opts))
    if not c1 or not c2:
        return None
    L, n = cfg.model.n_layers, cfg.train.microbatches
    out = {}
    for key in ("flops", "optimal_seconds", "bytes accessed"):
        if key in c1 and key in c2:
            out[key] = n * (c1[key] + (L - 1) * (c2[key] - c1[key]))
            out[key + " per layer"] = c2[key] - c1[key]
    return out


def compile_report(
    cfg: Config, target: Target, *, estimate: bool = True, charge_kernels: bool = True
) -> dict[str, Any]:
    """Compile the train step for `target` and return the report dict (see module docstring).

    charge_kernels=False leaves the Pallas kernels out of XLA's cost model (no
    pl.CostEstimate: they count as free), the terms on which stacks whose
    kernels carry no estimate (MaxText's splash attention) report; the step
    time then omits attention and the MFU is an upper bound.
    Raises ConfigError for configs that do not fit the target's device count.
    """
    import time

    from jaxtrain import head_sharding, loss_chunk, sharding
    from jaxtrain.sharding.targets import compiled_cost, compiled_memory, custom_call_targets, kernel_names

    requested_fsdp = cfg.mesh.fsdp
    cfg, ici, dcn = config_for_target(cfg, target)
    cfg, remat_note = resolve_remat_for_target(cfg, target, ici, dcn)
    devices = target_devices(target)
    if len(devices) != target.num_devices:
        raise RuntimeError(
            f"expected {target.num_devices} devices for {target.describe()}, got {len(devices)}"
        )
    mesh = sharding.make_mesh(ici, devices, dcn_axis_sizes=dcn or None)
    rules = head_sharding.axis_rules(cfg, mesh.shape)
    mesh_shape = {a: s for a, s in mesh.shape.items() if s > 1}
    t = cfg.train
    report: dict[str, Any] = {
        "target": target.describe(),
        "platform": target.platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "mesh": mesh_shape,
        "mesh_dcn": dcn,
        "rules": cfg.mesh.rules,
        "attention_impl": cfg.model.attention_impl,
        "remat": cfg.model.remat,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
        "microbatches": t.microbatches,
        "per_device_batch": t.global_batch_size / len(devices),
        "params": cfg.model.param_count(),
        "hbm_bytes": target.hbm_bytes,
        "kernels_charged": charge_kernels,
        "head_sharding": head_sharding.resolve(cfg, mesh.shape)[0],
        "loss_chunk": loss_chunk.resolve(cfg, mesh.shape)[0],
        "notes": [
            *([remat_note] if remat_note else []),
            head_sharding.note(cfg, mesh.shape),
            loss_chunk.note(cfg, mesh.shape),
        ],
    }
    if cfg.mesh.stage > 1:
        from jaxtrain.train_step import pipeline_schedule

        pp = pipeline_schedule(cfg)
        report["pipeline"] = f"{cfg.pipeline.schedule} S={pp.stages} M={pp.microbatches} R={pp.repeats}"
        report["pipeline_bubble"] = pp.bubble
    if cfg.mesh.fsdp != requested_fsdp:  # config_for_target filled an all-1 mesh
        where = f"the {cfg.mesh.fsdp} devices of each slice/host" if dcn else f"all {cfg.mesh.fsdp} devices"
        report["notes"].append(
            f"the config's mesh is all 1 (one device): filled mesh.fsdp={cfg.mesh.fsdp} to shard over {where}"
        )
    t0 = time.perf_counter()
    try:
        compiled = _compile_or_oom(cfg, mesh, rules)
    except OutOfMemoryAtCompile as e:
        report.update(fits=False, compile_error=_first_line(str(e)), compile_s=time.perf_counter() - t0)
        used = _oom_used_bytes(str(e))
        report["memory"] = {"total": used} if used else None
        report["margin_bytes"] = (target.hbm_bytes - used) if used else None
        report["suggestions"] = suggestions(cfg, report)
        return report
    except Exception as e:
        if cfg.model.attention_impl != "pallas":
            raise
        report["notes"].append(
            f"pallas attention failed to compile ({_first_line(str(e))[:200]}); "
            "fell back to model.attention_impl=xla"
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="xla"))
        report["attention_impl"] = "xla"
        compiled = _compile_or_oom(cfg, mesh, rules)
    report["compile_s"] = time.perf_counter() - t0
    text = compiled.as_text()
    mem = compiled_memory(compiled)
    report["memory"] = mem
    report["margin_bytes"] = target.hbm_bytes - mem["total"]
    report["fits"] = report["margin_bytes"] >= 0
    if target.platform == "gpu" and report["fits"] and mem["total"] > 0.75 * target.hbm_bytes:
        report["notes"].append(
            "over 75% of HBM: JAX's GPU allocator takes only 75% by default; run with "
            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (see the README launch recipes)"
        )
    report["collectives"] = collectives(text)
    report["custom_calls"] = sorted(custom_call_targets(text))
    report["pallas_in_program"] = any("tpu_custom_call" in c or "triton" in c for c in report["custom_calls"])
    report["kernels"] = sorted(kernel_names(text))
    tokens = t.global_batch_size * t.seq_len
    analytic = model_flops_per_token(cfg) * tokens / len(devices)
    report["model_flops_per_device"] = analytic
    raw = compiled_cost(compiled)
    report["xla_cost_scanned"] = {k: raw[k] for k in ("flops", "optimal_seconds") if raw and k in raw}
    report["step_seconds_est"] = None
    report["mfu_est"] = None
    if estimate and raw and cfg.mesh.stage > 1:
        report["notes"].append(
            "mesh.stage > 1: no XLA step-time estimate (the pipeline's schedule loop is a while "
            "loop that cost analysis counts once); its bubble is "
            f"{report['pipeline_bubble']:.3f} of every device's time"
        )
    elif estimate and raw:
        cost = _extrapolated_cost(cfg, mesh, rules, target.platform, charge_kernels=charge_kernels)
        report["xla_cost"] = cost
        if cost and cost.get("flops"):
            report["xla_flops_over_model_flops"] = cost["flops"] / analytic
        if cost and cost.get("optimal_seconds"):
            # Honesty check: the FLOPs the hardware must do (model + remat recompute)
            # vs what XLA counted. Short (the unrolled variants can CSE the recompute
            # away: jax.checkpoint(prevent_cse=False); custom calls such as the flash
            # kernel may count zero) -> scale the time up by the shortfall.
            hardware = analytic + recompute_flops(cfg) * tokens / len(devices)
            report["hardware_flops_per_device"] = hardware
            raw_s = cost["optimal_seconds"]
            scale = max(1.0, hardware / cost["flops"]) if cost.get("flops") and charge_kernels else 1.0
            if not charge_kernels:
                report["notes"].append(
                    "Pallas kernels uncharged: their FLOPs and time are left out of the estimate "
                    "(as for kernels without a cost estimate, e.g. MaxText's splash attention), "
                    "so the step time is a lower bound and the MFU an upper bound"
                )
            report["step_seconds_xla"] = raw_s
            report["step_seconds_est"] = raw_s * scale
            report["mfu_xla"] = analytic / (raw_s * target.peak_flops)
            report["mfu_est"] = analytic / (raw_s * scale * target.peak_flops)
            report["tokens_per_second_per_device_est"] = tokens / len(devices) / (raw_s * scale)
            if scale > 1.01:
                report["notes"].append(
                    f"XLA counted {cost['flops'] / 1e12:.1f} TFLOP/device where model + remat recompute "
                    f"needs {hardware / 1e12:.1f}: step time scaled up {scale:.2f}x "
                    f"(raw XLA estimate {raw_s:.3f} s, MFU {100 * report['mfu_xla']:.1f}%)"
                )
    elif not raw:
        report["notes"].append(f"no cost analysis on {target.platform}: step time and MFU not estimated")
    if not report["fits"]:
        report["suggestions"] = suggestions(cfg, report)
    return report


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token (jaxtrain.flops: 6 x active params + attention)."""
    from jaxtrain.flops import flops_per_token

    return flops_per_token(cfg.model, cfg.train.seq_len)


def _layer_params(cfg: Config) -> int:
    m = cfg.model
    count = m.active_param_count if hasattr(m, "active_param_count") else m.param_count
    return count(include_embedding=False) - m.vocab_size * m.d_model * (not m.tie_embeddings) - m.d_model


def recompute_flops(cfg: Config) -> float:
    """Extra forward FLOPs per token that `model.remat` recomputes in the backward pass."""
    m = cfg.model
    if m.remat != "full":
        return 0.0  # save_matmuls keeps the matmul outputs: only cheap elementwise work is redone
    layer_params = _layer_params(cfg)
    attn_fwd = 2 * m.n_layers * cfg.train.seq_len * m.n_heads * m.resolved_head_dim  # causal half of 4*L*S*d
    return 2 * layer_params + attn_fwd


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return text


def _oom_used_bytes(text: str) -> int | None:
    """Parse 'Used 120.5G of 95.74G hbm' (TPU compiler) into bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, None: 1}
    for pattern in (
        r"Used ([0-9.]+)([KMGT])? of [0-9.]+[KMGT]? hbm",
        r"memory required for [^(]*\(([0-9.]+)([KMGT])?\) exceeds available HBM",
    ):
        m = re.search(pattern, text)
        if m:
            return int(float(m.group(1)) * scale[m.group(2)])
    return None


def state_bytes_per_device(cfg: Config, num_devices: int) -> float:
    """Parameters + AdamW moments per device when fully sharded (the floor no mesh beats)."""
    param_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.param_dtype]
    return cfg.model.param_count() * (param_bytes + 2 * param_bytes) / num_devices


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


# --- decode -------------------------------------------------------------------

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes(model_cfg, batch: int, cache_len: int) -> int:
    """Bytes of the whole KV cache (models.generation.KVCache k and v, every layer) in the
    compute dtype: 2 x layers x batch x kv_heads x cache_len x head_dim x itemsize."""
    m = model_cfg
    return (
        2 * m.n_layers * batch * m.n_kv_heads * cache_len * m.resolved_head_dim * _ITEMSIZE[m.compute_dtype]
    )


def _per_device_bytes(shape, dtype, sharding) -> int:
    import numpy as np

    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def compile_decode_report(
    cfg: Config, target: Target, *, batch: int, max_len: int, prompt_len: int | None = None
) -> dict[str, Any]:
    """Compile generation for `target` (deviceless, like `compile_report`): the prefill of
    `batch` prompts of `prompt_len` tokens (default max_len: the longest prompt the cache
    holds, the worst case for the prefill's activations) into a KV cache of `max_len`
    positions (the sliding window when shorter), and one decode step (a token per row
    against that cache, the cache donated and updated in place) -- models.generation's
    `prefill` and `decode_step`, the functions `jaxtrain generate` runs, on the config's
    mesh with parameters, tokens and the cache sharded by their logical axes.

    Reports per device: the KV cache (computed from the shapes and the cache's sharding, and
    read back from the compiled decode step's argument shardings), the parameters, and each
    program's argument / output / temp / total memory against HBM; fits when both do.
    The train batch does not apply; the mesh rules, dtypes and attention are the config's.
    Raises ConfigError for a bad batch / length or a mesh the target cannot hold.
    """
    import time

    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxtrain import head_sharding, models, sharding
    from jaxtrain.models.generation import CACHE_AXES, CACHE_POSITION_AXES, KVCache, cache_length
    from jaxtrain.models.generation import decode_step as decode_fn
    from jaxtrain.models.generation import prefill as prefill_fn
    from jaxtrain.sharding.targets import compiled_memory

    prompt_len = max_len if prompt_len is None else prompt_len
    for name, value in (("--batch", batch), ("--max-len", max_len), ("--prompt-len", prompt_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if prompt_len > max_len:
        raise ConfigError(f"--prompt-len={prompt_len}: expected at most --max-len={max_len}")
    if cfg.mesh.context != 1:
        raise ConfigError(f"mesh.context={cfg.mesh.context}: generation needs mesh.context=1")
    requested_fsdp = cfg.mesh.fsdp
    # config_for_target checks the *train* batch against the mesh; decode has its own batch
    # (rules drop a mesh axis that does not divide it), so give it one every mesh divides.
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, global_batch_size=target.num_devices, microbatches=1)
    )
    cfg, ici, dcn = config_for_target(cfg, target)
    devices = target_devices(target)
    mesh = sharding.make_mesh(ici, devices, dcn_axis_sizes=dcn or None)
    rules = head_sharding.axis_rules(cfg, mesh.shape)
    m = cfg.model
    cache_len = cache_length(m, max_len)
    report: dict[str, Any] = {
        "mode": "decode",
        "target": target.describe(),
        "platform": target.platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "mesh": {a: n for a, n in mesh.shape.items() if n > 1},
        "mesh_dcn": dcn,
        "rules": cfg.mesh.rules,
        "attention_impl": m.attention_impl,
        "params": m.param_count(),
        "param_dtype": m.param_dtype,
        "compute_dtype": m.compute_dtype,
        "batch": batch,
        "max_len": max_len,
        "prompt_len": prompt_len,
        "cache_len": cache_len,
        "hbm_bytes": target.hbm_bytes,
        "notes": [],
    }
    if cfg.mesh.fsdp != requested_fsdp:
        report["notes"].append(
            f"the config's mesh is all 1 (one device): filled mesh.fsdp={cfg.mesh.fsdp} to shard over "
            "the target's devices"
        )
    if cache_len < max_len:
        report["notes"].append(f"sliding window: the cache is a ring of {cache_len} positions")

    graphdef, abstract = models.abstract_model(lambda: models.Transformer(m, rngs=nnx.Rngs(0)))
    shapes = nnx.to_pure_dict(abstract)
    param_shardings = sharding.tree_shardings(models.logical_axes(abstract), rules, mesh, shapes=shapes)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, param_shardings
    )
    named = lambda axes, shape: NamedSharding(mesh, sharding.logical_to_spec(axes, rules, mesh, shape))
    arg = lambda shape, dtype, axes: jax.ShapeDtypeStruct(shape, dtype, sharding=named(axes, shape))
    kv_shape = (m.n_layers, batch, m.n_kv_heads, cache_len, m.resolved_head_dim)
    cache = KVCache(
        arg(kv_shape, m.compute_dtype, CACHE_AXES),
        arg(kv_shape, m.compute_dtype, CACHE_AXES),
        arg((batch, cache_len), "int32", CACHE_POSITION_AXES),
    )
    cache_shardings = jax.tree.map(lambda a: a.sharding, cache)
    logits_sharding = named(("batch", "act_vocab"), (batch, m.vocab_size))

    def prefill(params, tokens, lengths):
        return prefill_fn(models.merge(graphdef, abstract, params), tokens, lengths, cache_len)

    def decode(params, tokens, positions, cache):
        return decode_fn(models.merge(graphdef, abstract, params), tokens, positions, cache)

    programs = {
        "prefill": (
            jax.jit(prefill, out_shardings=(logits_sharding, cache_shardings)),
            (params, arg((batch, prompt_len), "int32", ("batch", None)), arg((batch,), "int32", ("batch",))),
        ),
        "decode": (
            jax.jit(decode, out_shardings=(logits_sharding, cache_shardings), donate_argnums=3),
            (params, arg((batch,), "int32", ("batch",)), arg((batch,), "int32", ("batch",)), cache),
        ),
    }
    shards = math.prod(mesh.shape[a] for entry in cache.k.sharding.spec for a in sharding.axes_tuple(entry))
    report["kv_cache_bytes"] = kv_cache_bytes(m, batch, cache_len)
    report["kv_cache_spec"] = str(cache.k.sharding.spec)
    report["kv_cache_shards"] = shards
    report["kv_cache_bytes_per_device"] = report["kv_cache_bytes"] // shards
    report["param_bytes_per_device"] = sum(
        _per_device_bytes(p.shape, p.dtype, p.sharding) for p in jax.tree.leaves(params)
    )
    fits = True
    for name, (jitted, args) in programs.items():
        entry: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            with jax.set_mesh(mesh), sharding.axis_rules(rules):
                compiled = jitted.lower(*args).compile()
        except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED from the device compiler
            text = str(e)
            if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
                if m.attention_impl != "pallas":
                    raise
                # As compile_report: the prefill's flash kernel refused these shapes; XLA attention.
                xla = dataclasses.replace(cfg, model=dataclasses.replace(m, attention_impl="xla"))
                again = compile_decode_report(
                    xla, target, batch=batch, max_len=max_len, prompt_len=prompt_len
                )
                again["notes"] = report["notes"] + [
                    f"pallas attention failed to compile the {name} ({_first_line(text)[:200]}); "
                    "fell back to model.attention_impl=xla",
                    *again["notes"],
                ]
                return again
            used = _oom_used_bytes(text)
            entry.update(compile_error=_first_line(text), memory={"total": used} if used else None)
            entry["fits"] = False
        else:
            mem = compiled_memory(compiled)
            entry.update(memory=mem, fits=mem["total"] <= target.hbm_bytes)
            entry["collectives"] = collectives(compiled.as_text())
            if name == "decode":
                k_sharding = compiled.input_shardings[0][3].k
                report["kv_cache_bytes_per_device_compiled"] = 2 * _per_device_bytes(
                    kv_shape, m.compute_dtype, k_sharding
                )
        entry["compile_s"] = time.perf_counter() - t0
        report[name] = entry
        fits &= entry["fits"]
    report["fits"] = fits
    totals = [(report[n]["memory"] or {}).get("total") for n in programs]
    report["margin_bytes"] = (
        target.hbm_bytes - max(t for t in totals if t is not None) if any(totals) else None
    )
    if not fits:
        report["suggestions"] = [
            "shard the cache wider: mesh.tensor (kv heads) or mesh.data / mesh.fsdp (batch)",
            f"a smaller --batch (now {batch}) or --max-len (now {max_len})",
            "model.param_dtype=bfloat16 halves the weights (float32 master weights are for training)",
        ]
    return report


# --- printing -----------------------------------------------------------------


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
    lines = [
        *_target_and_mesh_lines(r),
        f"model       {_count(r['params'])} params, attention={r['attention_impl']}, "
        f"remat={r['remat']}, batch {r['global_batch_size']} x {r['seq_len']} "
        f"({r['per_device_batch']:g}/device, {r['microbatches']} microbatch(es))",
    ]
    if r.get("pipeline"):
        lines.append(f"pipeline    {r['pipeline']}, bubble (S-1)/(M*R+S-1) = {r['pipeline_bubble']:.3f}")
    if r.get("compile_s") is not None:
        lines.append(f"compile     {r['compile_s']:.1f} s")
    mem = r.get("memory")
    hbm = r["hbm_bytes"]
    if r.get("compile_error"):
        lines.append(f"compiler    {r['compile_error'][:300]}")
    if mem and "argument" in mem:
        lines.append(
            "memory/dev  args {}  output {}  aliased {}  temp {}  code {}".format(
                _gib(mem["argument"]),
                _gib(mem["output"]),
                _gib(mem["alias"]),
                _gib(mem["temp"]),
                _gib(mem["generated_code"]),
            )
        )
    if mem and mem.get("host_total"):
        lines.append(
            "host/dev    {} pinned host (args {}, temp {}): offloaded state / activations".format(
                _gib(mem["host_total"]), _gib(mem["host_argument"]), _gib(mem["host_temp"])
            )
        )
    total = mem.get("total") if mem else None
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    if total is not None:
        margin = r["margin_bytes"]
        word = "free" if margin >= 0 else "over"
        lines.append(
            f"total/dev   {_gib(total)} of {_gib(hbm)} HBM ({100 * total / hbm:.1f}%): "
            f"{verdict}, {_gib(abs(margin))} {word}"
        )
    else:
        lines.append(f"total/dev   unknown of {_gib(hbm)} HBM: {verdict}")
    if total is not None and not r["fits"] and r.get("compile_error"):
        lines[-1] += " (the compiler's figure; it stops at the first allocation that does not fit)"
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
    if r.get("collectives"):
        parts = [
            f"{k} x{v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in sorted(r["collectives"].items())
        ]
        lines.append("collectives " + ", ".join(parts) + "  [static count: loop bodies once]")
    if r.get("custom_calls") is not None:
        lines.append(
            f"pallas      {'yes' if r['pallas_in_program'] else 'no'} "
            f"(custom calls: {', '.join(r['custom_calls']) or 'none'})"
        )
    for note in r.get("notes", []):
        lines.append(f"note        {note}")
    if not r["fits"]:
        for s in r.get("suggestions", []):
            lines.append(f"try         {s}")
    return "\n".join(lines)


def format_decode_report(r: dict) -> str:
    """`jaxtrain compile --mode decode` as text."""
    hbm = r["hbm_bytes"]
    lines = [
        *_target_and_mesh_lines(r),
        f"model       {_count(r['params'])} params ({r['param_dtype']}; compute {r['compute_dtype']}), "
        f"attention={r['attention_impl']}",
        f"decode      batch {r['batch']}, cache {r['cache_len']} positions (--max-len {r['max_len']}); "
        f"prefill of {r['prompt_len']}-token prompts, then one token per row per step",
        f"kv cache    {_gib(r['kv_cache_bytes'])} in all, {_gib(r['kv_cache_bytes_per_device'])}/device "
        f"({r['kv_cache_shards']} shards, spec {r['kv_cache_spec']}; compiled args: "
        f"{_gib(r.get('kv_cache_bytes_per_device_compiled'))})",
        f"params/dev  {_gib(r['param_bytes_per_device'])}",
    ]
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
