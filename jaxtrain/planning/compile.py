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
  count (an MoE model's dense first layers stay in both variants, and L counts
  the layers after them; an attention pattern or `moe.every` group is one unit).
  TPU collective-matmul loops (windowed einsums) would be counted once too, so
  the variants are compiled without them. The FLOPs are checked
  against the analytic count (planning/flops.py, plus remat recompute); where
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
import time
from typing import Any

import jax

from jaxtrain import sharding
from jaxtrain.config import Config, ConfigError
from jaxtrain.models.config import FLASH_ATTENTION_IMPLS
from jaxtrain.pallas_kernels.flash_attention import cost_estimates
from jaxtrain.planning.flops import flops_per_token
from jaxtrain.planning.report import collectives, suggestions

# the reports as text, beside them (jaxtrain.compile.format_report, as before the move)
from jaxtrain.planning.report import format_decode_report as format_decode_report
from jaxtrain.planning.report import format_report as format_report
from jaxtrain.planning.resolve import Placement, axis_rules, resolve
from jaxtrain.sharding import hardware, targets
from jaxtrain.sharding.mesh import mesh_shape_from_sizes
from jaxtrain.sharding.targets import compiled_cost, compiled_memory, custom_call_targets, kernel_names
from jaxtrain.trainer.batches import abstract_batch
from jaxtrain.trainer.program import build_program, pipeline_schedule, state_shapes

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
    """The config's mesh on the target: (config, ICI axis sizes, DCN axis sizes > 1).

    With several slices/hosts and no `mesh.dcn_*` set, TPU slices get data
    parallelism across the DCN (`mesh.dcn_data = slices`); GPU hosts keep one
    flat mesh over all GPUs (the mesh axes then span hosts in host-major order).

    A mesh with every ICI axis 1 (the tiny configs' default, meant for one device)
    on a multi-device target gets `mesh.fsdp` filled to the devices per slice/host,
    as `mesh.fsdp=-1` would, rather than failing on the device count; the returned
    config carries the filled degree (`compile_report` notes it).
    """
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
    sizes = cfg.mesh.sizes()
    fill_fsdp = per_group > 1 and all(s == 1 for s in sizes.values())
    try:
        ici = mesh_shape_from_sizes({**sizes, "fsdp": -1} if fill_fsdp else sizes, per_group)
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


def resolved_for_target(cfg: Config, target: Target, ici: dict, dcn: dict) -> tuple[Config, tuple[str, ...]]:
    """Every `auto` of `cfg` resolved for the target (planning/resolve.py): its platform, the
    mesh (ICI x DCN) and its HBM; (config, the resolution's log lines)."""
    mesh = {a: ici.get(a, 1) * dcn.get(a, 1) for a in ici}
    placement = Placement(
        target.platform, mesh, target.hbm_bytes, f"{target.generation} HBM", target.generation
    )
    resolution = resolve(cfg, placement)
    return resolution.config, resolution.notes


# --- compiling ----------------------------------------------------------------


def target_mesh(target: Target, ici: dict[str, int], dcn: dict[str, int]) -> jax.sharding.Mesh:
    """The config's mesh over the target's compile-only devices."""
    devices = target_devices(target)
    if len(devices) != target.num_devices:
        raise RuntimeError(
            f"expected {target.num_devices} devices for {target.describe()}, got {len(devices)}"
        )
    return sharding.make_mesh(ici, devices, dcn_axis_sizes=dcn or None)


def fill_note(cfg: Config, requested_fsdp: int, dcn: dict) -> list[str]:
    """The note saying config_for_target filled an all-1 mesh, if it did."""
    if cfg.mesh.fsdp == requested_fsdp:
        return []
    where = f"the {cfg.mesh.fsdp} devices of each slice/host" if dcn else f"all {cfg.mesh.fsdp} devices"
    return [
        f"the config's mesh is all 1 (one device): filled mesh.fsdp={cfg.mesh.fsdp} to shard over {where}"
    ]


# --- compiling ----------------------------------------------------------------


def lower_step(cfg: Config, mesh, rules=None) -> jax.stages.Lowered:
    """The train step of resolved `cfg` (what `jaxtrain train` runs) lowered for `mesh`, on
    abstract state and batch, under `rules` (default: the config's)."""
    rules = axis_rules(cfg) if rules is None else rules
    # build_program runs a few eager ops (optax state templates); they cannot run on
    # compile-only devices, so only the tracing happens under the target mesh.
    with sharding.axis_rules(rules):
        program = build_program(cfg, mesh, rules)
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        shapes = state_shapes(program)
        state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, program.state_shardings
        )
        return program.step.lower(state, abstract_batch(cfg, program.batch_sharding))


def _compile_step(cfg: Config, mesh, rules=None, compiler_options: dict | None = None):
    """lower_step, compiled by the mesh's device compiler."""
    return lower_step(cfg, mesh, rules).compile(compiler_options=compiler_options)


def compile_for_target(cfg: Config, target: Target):
    """`cfg`'s train step, every `auto` resolved for `target`, compiled by its device compiler
    over its compile-only devices (the program alone, for tools that read it; compile_report
    says what it means)."""
    cfg, ici, dcn = config_for_target(cfg, target)
    cfg, _ = resolved_for_target(cfg, target, ici, dcn)
    return _compile_step(cfg, target_mesh(target, ici, dcn))


class OutOfMemoryAtCompile(RuntimeError):
    """The device compiler itself refused the program for lack of memory."""


def is_out_of_memory(text: str) -> bool:
    """Whether a compiler error says the program does not fit (XlaRuntimeError: RESOURCE_EXHAUSTED)."""
    return (
        "RESOURCE_EXHAUSTED" in text or "ran out of memory" in text.lower() or "out of memory" in text.lower()
    )


def _compile_or_oom(cfg, mesh, rules):
    try:
        return _compile_step(cfg, mesh, rules)
    except Exception as e:  # the device compiler's own errors: out of memory is a verdict
        if is_out_of_memory(str(e)):
            raise OutOfMemoryAtCompile(str(e)) from None
        raise


def cost_layers(m) -> tuple[int, int, int]:
    """(prefix, unit, units) of the cost variants: they keep an MoE model's dense prefix
    (model.moe.first_dense_layers) whole and repeat one unit after it, a layer, an attention
    pattern or a group of model.moe.every layers; the model is prefix + units x unit layers.
    (A variant of fewer layers than the prefix is no valid MoE model.)"""
    prefix = m.moe.first_dense_layers if m.moe is not None else 0
    unit = m.layers_per_group * (m.moe.every if m.moe is not None else 1)
    return prefix, unit, (m.n_layers - prefix) // unit


def _variant(cfg: Config, n_layers: int) -> Config:
    """The same config with `n_layers` unrolled layers and one microbatch's batch (with an
    attention pattern, a multiple of its length)."""
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
    opts = _COST_VARIANT_OPTIONS.get(platform)
    prefix, unit, groups = cost_layers(cfg.model)
    with cost_estimates(charge_kernels):
        c1 = compiled_cost(_compile_step(_variant(cfg, prefix + unit), mesh, rules, opts))
        c2 = compiled_cost(_compile_step(_variant(cfg, prefix + 2 * unit), mesh, rules, opts))
    if not c1 or not c2:
        return None
    if any(c.get("optimal_seconds", 0) < 0 for c in (c1, c2)):
        # XLA's cost analysis can answer a negative time (seen with gated DeltaNet's chunked
        # rule on TPU: -3 s for a tiny model): no estimate rather than a negative one
        return None
    n = cfg.train.microbatches
    out = {}
    for key in ("flops", "optimal_seconds", "bytes accessed"):
        if key in c1 and key in c2:
            out[key] = n * (c1[key] + (groups - 1) * (c2[key] - c1[key]))
            out[key + " per layer"] = (c2[key] - c1[key]) / unit
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
    requested_fsdp = cfg.mesh.fsdp
    cfg, ici, dcn = config_for_target(cfg, target)
    cfg, notes = resolved_for_target(cfg, target, ici, dcn)
    mesh = target_mesh(target, ici, dcn)
    rules = axis_rules(cfg)
    report = _train_report(cfg, target, mesh, dcn, [*notes, *fill_note(cfg, requested_fsdp, dcn)])
    report["kernels_charged"] = charge_kernels
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
    except Exception as e:  # the flash kernel refused these shapes: say so and compile with XLA's
        if cfg.model.attention_impl not in FLASH_ATTENTION_IMPLS:
            raise
        report["notes"].append(
            f"pallas attention failed to compile ({_first_line(str(e))[:200]}); "
            "fell back to model.attention_impl=xla"
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="xla"))
        report["attention_impl"] = "xla"
        compiled = _compile_or_oom(cfg, mesh, rules)
    report["compile_s"] = time.perf_counter() - t0
    _program_figures(report, compiled, cfg, target)
    if estimate:
        _step_estimate(report, cfg, mesh, rules, target, charge_kernels, compiled)
    if not report["fits"]:
        report["suggestions"] = suggestions(cfg, report)
    return report


def target_fields(cfg: Config, target: Target, mesh, dcn: dict) -> dict[str, Any]:
    """The fields every compile report starts with (train and decode): target, mesh, rules."""
    return {
        "target": target.describe(),
        "platform": target.platform,
        "device_kind": mesh.devices.flat[0].device_kind,
        "num_devices": mesh.size,
        "mesh": {a: s for a, s in mesh.shape.items() if s > 1},
        "mesh_dcn": dcn,
        "rules": cfg.mesh.rules,
        "attention_impl": cfg.model.attention_impl,
    }


def _train_report(cfg: Config, target: Target, mesh, dcn: dict, notes: list[str]) -> dict[str, Any]:
    """What the train report says before anything compiles: target, mesh, resolved settings."""
    t = cfg.train
    report: dict[str, Any] = {
        **target_fields(cfg, target, mesh, dcn),
        "remat": cfg.model.remat,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
        "microbatches": t.microbatches,
        "per_device_batch": t.global_batch_size / mesh.size,
        "params": cfg.model.param_count(),
        "hbm_bytes": target.hbm_bytes,
        "head_sharding": cfg.mesh.head_sharding,
        "loss_chunk": t.loss_chunk,
        "notes": list(notes),
    }
    pp = pipeline_schedule(cfg)
    if pp is not None:
        report["pipeline"] = f"{cfg.pipeline.schedule} S={pp.stages} M={pp.microbatches} R={pp.repeats}"
        report["pipeline_bubble"] = pp.bubble
    return report


def _program_figures(report: dict, compiled, cfg: Config, target: Target) -> None:
    """The compiled program's memory against HBM, its collectives, custom calls and kernels."""
    text = compiled.as_text()
    mem = compiled_memory(compiled)
    report["memory"] = mem
    report["margin_bytes"] = target.hbm_bytes - mem["total"]
    report["fits"] = report["margin_bytes"] >= 0
    if target.platform == "gpu" and report["fits"] and mem["total"] > 0.75 * target.hbm_bytes:
        report["notes"].append(
            "over 75% of HBM: JAX's GPU allocator takes only 75% by default; run with "
            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (docs: Running on TPU pods and GPU clusters)"
        )
    report["collectives"] = collectives(text)
    report["custom_calls"] = sorted(custom_call_targets(text))
    report["pallas_in_program"] = any(
        "tpu_custom_call" in c or "triton" in c or "mosaic_gpu" in c for c in report["custom_calls"]
    )
    report["cudnn_in_program"] = any("cudnn$fmha" in c for c in report["custom_calls"])
    report["kernels"] = sorted(kernel_names(text))
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    report["model_flops_per_device"] = model_flops_per_token(cfg) * tokens / report["num_devices"]
    raw = compiled_cost(compiled)
    report["xla_cost_scanned"] = {k: raw[k] for k in ("flops", "optimal_seconds") if raw and k in raw}
    report["step_seconds_est"] = None
    report["mfu_est"] = None
    if not raw:
        report["notes"].append(f"no cost analysis on {target.platform}: step time and MFU not estimated")


def _step_estimate(
    report: dict, cfg: Config, mesh, rules, target: Target, charge_kernels: bool, compiled
) -> None:
    """XLA's estimated step time and MFU (TPU), extrapolated from 1- and 2-layer compiles
    (module docstring), scaled up where XLA counted fewer FLOPs than model + recompute."""
    if not report["xla_cost_scanned"]:
        return
    if cfg.mesh.stage > 1:
        report["notes"].append(
            "mesh.stage > 1: no XLA step-time estimate (the pipeline's schedule loop is a while "
            "loop that cost analysis counts once); its bubble is "
            f"{report['pipeline_bubble']:.3f} of every device's time"
        )
        return
    cost = _extrapolated_cost(cfg, mesh, rules, target.platform, charge_kernels=charge_kernels)
    report["xla_cost"] = cost
    analytic = report["model_flops_per_device"]
    if cost and cost.get("flops"):
        report["xla_flops_over_model_flops"] = cost["flops"] / analytic
    if not (cost and cost.get("optimal_seconds")):
        if cost is None and cfg.model.has_linear_attention:
            report["notes"].append(
                "no XLA step-time estimate: XLA's cost analysis gave the cost variants a negative "
                "time (gated DeltaNet's chunked rule: a blockwise triangular solve among its ops); "
                "the memory figures are the compiled program's"
            )
        return
    # Honesty check: the FLOPs the hardware must do (model + remat recompute) vs what XLA
    # counted. Short (the unrolled variants can CSE the recompute away:
    # jax.checkpoint(prevent_cse=False); custom calls such as the flash kernel may count
    # zero) -> scale the time up by the shortfall.
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    hardware_flops = analytic + recompute_flops(cfg) * tokens / report["num_devices"]
    report["hardware_flops_per_device"] = hardware_flops
    raw_s = cost["optimal_seconds"]
    scale = max(1.0, hardware_flops / cost["flops"]) if cost.get("flops") and charge_kernels else 1.0
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
    report["tokens_per_second_per_device_est"] = tokens / report["num_devices"] / (raw_s * scale)
    if scale > 1.01:
        report["notes"].append(
            f"XLA counted {cost['flops'] / 1e12:.1f} TFLOP/device where model + remat recompute "
            f"needs {hardware_flops / 1e12:.1f}: step time scaled up {scale:.2f}x "
            f"(raw XLA estimate {raw_s:.3f} s, MFU {100 * report['mfu_xla']:.1f}%)"
        )


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token (planning/flops.py: 6 x active params + attention)."""
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
    layer_params = _layer_params(cfg)  # the prediction modules' (model.mtp) included
    # the causal half of 2 x L x S x heads x (qk + v width): 4*L*S*d with equal widths; each
    # prediction module's block attends as a layer does
    layers = m.n_layers + (m.mtp.depth if m.mtp is not None else 0)
    attn_fwd = layers * cfg.train.seq_len * m.n_heads * sum(m.attention_widths)
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
