"""`jaxtrain plan`: search mesh, remat and microbatches for a target.

Users of every stack spend days choosing the mesh factorisation, the remat policy and
the gradient-accumulation count by trial and error. The planner does it in three steps:

1. enumerate candidates: every factorisation of a slice's devices over the mesh axes
   (data, fsdp, tensor; context for long sequences, expert for MoE; stage for stacks
   of 4 or more layers, in degrees that divide the layers), x the remat policies
   (footprint.REMAT_BY_COST) x microbatch counts (global batch fixed): gradient
   accumulation without stages, pipeline microbatches and schedules with them;
2. prune with the analytic model: invalid shapes (the reason names the numbers), and
   memory estimates (footprint.estimate) over `headroom` x HBM; rank the rest by the
   analytic step time (roofline FLOPs + communication, `analytic_step`);
3. confirm the best `top` by deviceless compile (planning/compile.py `compile_report`): the
   compiler's memory verdict, and on TPU its cost-model step time, which then ranks them.
   GPU compiles carry no cost estimate, so GPU candidates stay ranked by the analytic model.

Each candidate's other `auto` settings (head sharding, loss chunks, attention, MoE exchange)
are resolved for its mesh by planning/resolve.py, as `jaxtrain train` would resolve them;
`model.remat: auto` uses the same memory model (footprint.estimate).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from jaxtrain.config import Config, ConfigError, to_dict, validate
from jaxtrain.models.config import DTYPE_BYTES
from jaxtrain.models.moe import dispatch_per_shard, shards_per_token
from jaxtrain.planning.attention_shape import attention_shape
from jaxtrain.planning.compile import Target, compile_report, config_for_target
from jaxtrain.planning.flops import flops_per_token
from jaxtrain.planning.footprint import (
    REMAT_BY_COST,
    SAVED_NAMES,
    estimate,
    expert_params,
    layer_stack_params,
    moe_row_factor,
    reference_copies,
    remat_policies,
    sequences_per_row,
)
from jaxtrain.planning.resolve import REMAT_HEADROOM, Placement, head_rows_per_device, resolve
from jaxtrain.sharding import hardware
from jaxtrain.sharding.pipeline_tables import table as schedule_table

GiB = 2**30
HEADROOM = REMAT_HEADROOM  # the analytic estimate must fit in this fraction of HBM
SEARCH_REMAT = tuple(p for p in REMAT_BY_COST if p != "save_matmuls")  # same memory as minimal
MICROBATCHES = (1, 2, 4, 8, 16)
PIPELINE_MICROBATCHES = (1, 2, 4)  # x mesh.stage
PIPELINE_SCHEDULES = (  # (schedule, repeats)
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zero_bubble", 1),
)
MESH_ORDER = ("data", "fsdp", "tensor", "context", "expert", "stage")
LONG_SEQUENCE = 8192  # context parallelism is searched from this seq_len on


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: mesh degrees per slice, remat policy, microbatch count,
    and with stage > 1 the pipeline (microbatches, schedule, repeats)."""

    mesh: tuple[tuple[str, int], ...]  # (axis, size) in MESH_ORDER
    remat: str
    microbatches: int
    pipeline: tuple[int, str, int] | None = None  # (microbatches, schedule, repeats)

    def overrides(self) -> dict[str, Any]:
        """The dotted overrides that turn the base config into this candidate."""
        out: dict[str, Any] = {f"mesh.{a}": s for a, s in self.mesh}
        out["model.remat"] = self.remat
        out["train.microbatches"] = self.microbatches
        if self.pipeline is not None:
            m, schedule, repeats = self.pipeline
            out.update(
                {"pipeline.microbatches": m, "pipeline.schedule": schedule, "pipeline.repeats": repeats}
            )
        return out

    def mesh_text(self) -> str:
        return " ".join(f"{a}={s}" for a, s in self.mesh if s > 1) or "one device"

    def batching_text(self) -> str:
        """mb=N, or the pipeline's microbatches and schedule (pp=M gpipe, pp=M circular x R)."""
        if self.pipeline is None:
            return f"mb={self.microbatches}"
        m, schedule, repeats = self.pipeline
        return f"pp={m} {schedule}" + (f" x{repeats}" if repeats > 1 else "")


@dataclasses.dataclass
class Row:
    """A candidate and what the planner found out about it."""

    candidate: Candidate
    analytic_bytes: int | None = None
    analytic_step_s: float | None = None
    analytic_mfu: float | None = None
    compiled_bytes: int | None = None
    compiled_step_s: float | None = None
    compiled_mfu: float | None = None
    reason: str | None = None  # why it was rejected; None: accepted
    comm_s: float = 0.0  # analytic communication seconds (ties on the roofline go to less traffic,
    compute_s: float = 0.0  # then less recompute, fewer microbatches, less memory)

    @property
    def step_s(self) -> float | None:
        return self.compiled_step_s if self.compiled_step_s is not None else self.analytic_step_s


@dataclasses.dataclass
class Plan:
    target: str
    platform: str
    hbm_bytes: int
    headroom: float
    ranked_by: str  # "compiled" | "analytic"
    ranked: list[Row]  # confirmed (or, uncompiled, analytic-feasible) candidates, best first
    rejected: list[Row]
    searched: int
    notes: list[str]

    @property
    def best(self) -> Row | None:
        return self.ranked[0] if self.ranked else None


# --- the search space -----------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(n: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every assignment of sizes to `axes` whose product is `n`."""
    out = []
    for sizes in itertools.product(_divisors(n), repeat=len(axes) - 1):
        rest = math.prod(sizes)
        if n % rest == 0:
            out.append(dict(zip(axes, (*sizes, n // rest))))
    return out


def search_axes(cfg: Config) -> tuple[str, ...]:
    """The mesh axes searched for this config: context from LONG_SEQUENCE on, expert for
    MoE, stage for stacks of 4+ layers without fp8 (which pipelines do not support)."""
    axes = ["data", "tensor"]
    if cfg.train.seq_len >= LONG_SEQUENCE or cfg.mesh.context > 1:
        axes.append("context")
    if cfg.model.moe is not None:
        axes.append("expert")
    if cfg.model.n_layers >= 4 and not cfg.model.fp8:
        axes.append("stage")
    return (*axes, "fsdp")


def candidates(cfg: Config, devices_per_slice: int) -> list[Candidate]:
    """Mesh x remat x batching. Stage degrees that do not divide the layers are left out
    of the space (every stage holds equal blocks); with stages, gradient accumulation is
    off and the pipeline's microbatches (stage x 1, 2, 4) and schedules are searched."""
    axes = search_axes(cfg)
    layers = cfg.model.n_layers
    policies = [r for r in SEARCH_REMAT if r in remat_policies(cfg.model)]
    out = []
    for sizes in factorisations(devices_per_slice, axes):
        stages = sizes.get("stage", 1)
        if layers % stages:
            continue
        mesh = tuple((a, sizes.get(a, 1)) for a in MESH_ORDER)
        if stages == 1:
            batching = [(mb, None) for mb in MICROBATCHES]
        else:
            batching = [
                (1, (k * stages, schedule, repeats))
                for schedule, repeats in PIPELINE_SCHEDULES
                if layers % (stages * repeats) == 0
                for k in PIPELINE_MICROBATCHES
            ]
        for remat in policies:
            for mb, pipe in batching:
                out.append(Candidate(mesh, remat, mb, pipe))
    return out


def apply(cfg: Config, cand: Candidate) -> Config:
    """The base config with the candidate's mesh, remat, microbatches and pipeline (rules:
    fsdp_tensor when the candidate uses tensor parallelism and the config's rules do not)."""
    sizes = {"stage": 1, **dict(cand.mesh)}
    mesh = dataclasses.replace(cfg.mesh, **sizes)
    if sizes["tensor"] > 1 and cfg.mesh.rules != "fsdp_tensor":
        mesh = dataclasses.replace(mesh, rules="fsdp_tensor")
    pipeline = cfg.pipeline
    if cand.pipeline is not None:
        m, schedule, repeats = cand.pipeline
        pipeline = dataclasses.replace(pipeline, microbatches=m, schedule=schedule, repeats=repeats)
    return dataclasses.replace(
        cfg,
        mesh=mesh,
        model=dataclasses.replace(cfg.model, remat=cand.remat, remat_custom=()),
        train=dataclasses.replace(cfg.train, microbatches=cand.microbatches),
        pipeline=pipeline,
    )


def invalid_reason(cfg: Config, cand: Candidate, num_devices: int) -> str | None:
    """Why the candidate cannot run at all (shapes), in numbers; None when it can."""
    m, t, s = cfg.model, cfg.train, {"stage": 1, **dict(cand.mesh)}
    if s["tensor"] > m.n_kv_heads:
        return f"tensor={s['tensor']} > kv_heads={m.n_kv_heads}"
    if m.n_kv_heads % s["tensor"] or m.n_heads % s["tensor"]:
        return f"tensor={s['tensor']} does not divide heads={m.n_heads} / kv_heads={m.n_kv_heads}"
    dp = s["data"] * s["fsdp"] * s["expert"]
    if t.global_batch_size % (dp * cand.microbatches):
        return (
            f"global batch {t.global_batch_size} is not a multiple of data*fsdp*expert={dp} "
            f"x microbatches={cand.microbatches}"
        )
    if cand.pipeline is not None and t.global_batch_size % (dp * cand.pipeline[0]):
        return (
            f"global batch {t.global_batch_size} is not a multiple of data*fsdp*expert={dp} "
            f"x pipeline microbatches={cand.pipeline[0]}"
        )
    if s["context"] > 1 and t.seq_len % (2 * s["context"]):
        return f"seq_len={t.seq_len} is not a multiple of 2 x context={s['context']}"
    if s["expert"] > 1 and (m.moe is None or m.moe.num_experts % s["expert"]):
        return f"expert={s['expert']} does not divide num_experts={m.moe.num_experts if m.moe else 0}"
    try:
        validate(apply(cfg, cand), num_devices=num_devices)
    except ConfigError as e:
        return str(e)
    return None


# --- the analytic step time -------------------------------------------------------


def recompute_flops_per_token(cfg: Config, remat: str | None = None) -> float:
    """Forward FLOPs per token the backward pass redoes under `remat`.

    Per layer, the forward pieces are qkv (the projections up to q, k, v: 2 D (H + 2K) hd;
    latent attention's four, planning/attention_shape.py), attention (S H (qk + v), causal),
    out (2 H v D), mlp_in (2/3 of the MLP's 2 x active MLP params), mlp_out (1/3). A piece is
    recomputed when its output is not kept (a dense mlp_out's output is only needed by the next
    layer, whose input is kept; MoE expert outputs are needed by the router weights' gradient,
    so their w_down, 2 x D x F x top_k per MoE layer, is redone unless mlp_out is kept);
    `full` redoes the whole layer, as XLA counts it. The prediction modules (model.mtp) run
    under the layers' policy: each is one more layer of the model's kind, and `full` also
    redoes its input projection (eh_proj, 2 x 2D x D)."""
    m = cfg.model
    remat = remat or m.remat
    if remat in ("none",):
        return 0.0
    d, seq, att = m.d_model, cfg.train.seq_len, attention_shape(m)
    depth = m.mtp.depth if m.mtp is not None else 0
    layers = m.n_layers + depth  # the prediction modules' blocks are layers of the model's kind
    qkv, out, attn = att.qkv_flops, att.out_flops, att.attention_flops(seq / 2)
    head = 0 if m.tie_embeddings else m.vocab_size * d
    # the modules' parameters besides their blocks: three norms and eh_proj [2D, D]
    mtp_inputs = depth * (3 * d + 2 * d * d)
    layer_params = (m.active_param_count(include_embedding=False) - head - d - mtp_inputs) / layers
    mlp = 2 * layer_params - qkv - out  # 2 x params = forward FLOPs; the rest is the MLP
    pieces = {"qkv_proj": qkv, "context": attn, "out_proj": out, "mlp_in": 2 * mlp / 3}
    if remat == "full":
        return layers * (qkv + attn + out + mlp) + depth * 2 * 2 * d * d
    # MoE: the router weights' gradient needs the expert outputs, so the experts' w_down
    # matmul is redone unless mlp_out is kept (a dense MLP's output is never needed).
    moe_out = 0.0
    if m.moe is not None:
        moe_out = (m.moe.num_moe_layers(m) + depth) * 2 * d * m.moe.mlp_dim(m) * m.moe.top_k
    if remat == "custom":
        kept = {n for n, mode in m.remat_custom if mode in ("device", "offload")}
    else:  # offload_matmuls keeps the minimal names, on the host
        kept = set(SAVED_NAMES["minimal" if remat == "offload_matmuls" else remat])
    return layers * sum(f for name, f in pieces.items() if name not in kept) + (
        moe_out if "mlp_out" not in kept else 0.0
    )


def _axis_bandwidth(chip, mesh: dict[str, int], axis: str, per_host: int) -> float:
    """Bytes/s for a collective over `axis`: ICI / NVLink, or the host NIC when the axis
    (with the axes inside it) spans more devices than one host holds (GPU)."""
    order = ("data", "stage", "fsdp", "context", "expert", "tensor")  # outer -> inner (sharding.MESH_AXES)
    inner = math.prod(mesh.get(a, 1) for a in order[order.index(axis) :])
    if chip.platform == "gpu" and inner > per_host and chip.dcn_bytes_per_s:
        return chip.dcn_bytes_per_s
    return chip.ici_bytes_per_s


def analytic_step(cfg: Config, mesh: dict[str, int], chip, per_host: int) -> dict[str, float]:
    """Seconds per step by the roofline (scaling-book style), per device:

    compute   = (model FLOPs + recompute FLOPs) x tokens / devices / peak
    fsdp      = microbatches x 3 x (P / (tensor x expert)) x p x (fsdp-1)/fsdp / W
                (MoE: only the routed experts split over expert, the rest of P over tensor alone)
                (weights all-gathered forward and backward, gradients reduce-scattered)
    data      = 2 x (P / (fsdp x tensor x expert)) x 4 x (data-1)/data / W   (gradient all-reduce;
                context likewise: parameters are replicated over it)
    tensor    = microbatches x 4 L x 2 x T x D x a x (tensor-1)/tensor / W (2 all-reduces forward,
                2 backward per layer; T = tokens of one device's microbatch)
    context   = microbatches x 3 L x (context-1) x T x 2 K hd x a / W  (ring K/V passes, fwd + bwd;
                latent attention passes its expanded K and V, H (qk + v))
    expert    = microbatches x 4 L_moe x T x k_sent x D x a x (expert-1)/expert / W (all-to-alls;
                k_sent = top_k rows a token, or with per-shard dispatch the shards it reaches, at most
                models/moe.py shards_per_token: top_k_groups where the groups lie on shards)
    head      = microbatches x 2 x R x D x a x (fsdp-1)/fsdp / W, when the head is vocab-parallel
                (mesh.head_sharding, planning/resolve.py; R = its rows per device): the
                final activations gathered and their gradient summed; fsdp then leaves out the
                head's vocab x D, which is no longer gathered
    step      = max(compute, fsdp + data + context) + tensor + expert + stage + head
    L counts the prediction modules' blocks (model.mtp) in tensor, context and expert.
    MoE: compute adds (r - 1) x 18 x top_k x D x F x MoE layers per token, r = rows per routed
    assignment (footprint.moe_row_factor): XLA costs the expert matmuls over their whole buffer.
    (weight and gradient collectives overlap the matmuls; activation collectives are on the
    critical path). W: the axis bandwidth, hardware.Chip.ici_bytes_per_s (or the NIC across
    GPU hosts).

    Pipeline stages (S > 1, M pipeline microbatches, R repeats, I = M R / (1 - bubble)
    iterations, the bubble the schedule's table's: M R + S - 1 but for zero_bubble): every
    device runs L/S layers for I/(M R) of the time it would without a bubble, and redoes each
    iteration's stage forward in the backward (zero_bubble twice: its B and its W each do):
    compute   = (model FLOPs + full-layer forward + recompute FLOPs) x tokens / devices / peak
                x I / (M R)
    L         -> L/S x I/(M R) in tensor, context and expert (per-layer traffic per device)
    fsdp      = I x 3 x (P_layers / (S R) / (tensor x expert)) x p x (fsdp-1)/fsdp / W
                + 3 x (P - P_layers) / (tensor x expert) x p x (fsdp-1)/fsdp / W
                (each iteration gathers its stage's weights; embedding and head once)
    stage     = 2 x I x T/M x D x a / W       (the shift between stages, forward and backward)
    data      = as above, with P / S of the layers' parameters per device
    `cfg` is resolved for this mesh (planning/resolve.py: the head's sharding in particular).
    """
    m, t = cfg.model, cfg.train
    peak = chip.peak_flops("bfloat16" if m.compute_dtype != "float32" else "float32") or chip.bf16_flops
    bw = lambda ax: _axis_bandwidth(chip, mesh, ax, per_host)
    pipe = _pipeline_terms(cfg, mesh.get("stage", 1))
    # a DPO row is two sequences, and the frozen reference adds a forward pass (a third of the step)
    tokens_dev = t.global_batch_size * sequences_per_row(cfg) * t.seq_len / math.prod(mesh.values())
    model = flops_per_token(m, t.seq_len) * tokens_dev * (1 + reference_copies(cfg) / 3)
    compute = (model + _extra_flops_per_token(cfg, mesh, pipe) * tokens_dev) * pipe.inflate / peak
    comm = {**_weight_traffic(cfg, mesh, bw, pipe), **_activation_traffic(cfg, mesh, bw, pipe)}
    step = max(compute, comm["fsdp"] + comm["data"] + comm["context"])
    step += comm["tensor"] + comm["expert"] + comm["stage"] + comm["head"]
    return {
        "compute_s": compute,
        **{k + "_s": v for k, v in comm.items()},
        "step_s": step,
        "mfu": model / (step * peak),
    }


class _Pipe(NamedTuple):
    """Pipeline terms of analytic_step: stages S, microbatches M, repeats R, iterations I
    (stage passes per device, the bubble's included: M R / (1 - bubble))."""

    stages: int
    microbatches: int
    repeats: int
    iterations: float
    inflate: float  # I / (M R) = 1 / (1 - bubble)
    weight_recompute: bool  # zero_bubble: W redoes the stage's forward (sharding/tick_pipeline.py)


def _pipeline_terms(cfg: Config, stages: int) -> _Pipe:
    """The bubble is the schedule's tick table's (sharding/pipeline_tables.py): for gpipe,
    circular, 1f1b and interleaved_1f1b I = M R + S - 1; zero_bubble's B and W fill the
    bubble to a third, I = M + (S - 1) / 3."""
    if stages <= 1:
        return _Pipe(1, 1, 1, 1, 1.0, False)
    p = cfg.pipeline
    pm, reps, schedule = p.resolved_microbatches(stages), p.repeats, p.schedule
    inflate = 1 / (1 - schedule_table(schedule, stages, pm, reps).bubble)
    return _Pipe(stages, pm, reps, pm * reps * inflate, inflate, schedule == "zero_bubble")


def _extra_flops_per_token(cfg: Config, mesh: dict[str, int], pipe: _Pipe) -> float:
    """FLOPs per token beyond the model's: remat recompute (with stages, each iteration's
    stage forward again), and the MoE buffer's padding rows, which XLA's cost model charges
    (ragged_dot over the receive buffer, capacity slots): (r - 1) x the routed experts' FLOPs."""
    m = cfg.model
    extra = recompute_flops_per_token(cfg)
    if pipe.stages > 1:
        extra += recompute_flops_per_token(cfg, "full") * (2 if pipe.weight_recompute else 1)
    if m.moe is not None:
        r = moe_row_factor(cfg, mesh)
        extra += (r - 1) * 18 * m.moe.top_k * m.d_model * m.moe.mlp_dim(m) * m.moe.num_moe_layers(m)
    return extra


def _weight_traffic(cfg: Config, mesh: dict[str, int], bw, pipe: _Pipe) -> dict[str, float]:
    """Seconds of the weight and gradient collectives per step: fsdp, data (and context),
    and the vocab-parallel head's activations (analytic_step's formulas)."""
    m, mb = cfg.model, cfg.train.microbatches
    g = lambda ax: mesh.get(ax, 1)
    p = DTYPE_BYTES[m.param_dtype]
    a = DTYPE_BYTES[m.compute_dtype]
    params, stack, f = m.param_count(), layer_stack_params(m), g("fsdp")
    # the share of a device's parameters it holds over fsdp: the routed experts split over
    # expert as well, everything else only over tensor
    share = expert_params(m) / params
    te = g("tensor") / (1 - share + share / g("expert"))
    gathered = params
    if pipe.stages > 1:
        gathered = pipe.iterations * stack / (pipe.stages * pipe.repeats) + params - stack
    out = {"head": 0.0}
    if f > 1 and cfg.mesh.head_sharding == "vocab":
        gathered -= m.vocab_size * m.d_model
        out["head"] = mb * 2 * head_rows_per_device(cfg, mesh) * m.d_model * a * (f - 1) / f / bw("fsdp")
    out["fsdp"] = mb * 3 * gathered / te * p * (f - 1) / f / bw("fsdp") if f > 1 else 0
    grads = (stack / pipe.stages + params - stack) / (f * te) * 4
    out["data"] = sum(2 * grads * (g(ax) - 1) / g(ax) / bw(ax) for ax in ("data", "context") if g(ax) > 1)
    return out


def _rows_per_token(m, ep: int) -> int:
    """Token rows a token sends in the expert-parallel exchange: one per chosen expert, or
    with per-shard dispatch one per expert shard, at most shards_per_token (models/moe.py)."""
    return shards_per_token(m, ep) if dispatch_per_shard(m, ep) else m.top_k


def _activation_traffic(cfg: Config, mesh: dict[str, int], bw, pipe: _Pipe) -> dict[str, float]:
    """Seconds of the activation collectives per step, on the critical path: tensor,
    context, expert and the pipeline's shift between stages (analytic_step's formulas)."""
    m, t = cfg.model, cfg.train
    g = lambda ax: mesh.get(ax, 1)
    a = DTYPE_BYTES[m.compute_dtype]
    mb = t.microbatches
    layers = m.n_layers / pipe.stages * pipe.inflate  # layer passes per device, per microbatch
    moe_layers = (m.moe.num_moe_layers(m) if m.moe else 0) * layers / m.n_layers
    if m.mtp is not None:  # each prediction module's block (never with stages) is one layer more
        layers += m.mtp.depth
        moe_layers += m.mtp.depth if m.moe else 0
    rows = t.global_batch_size * sequences_per_row(cfg)
    tok_mb = rows * t.seq_len / (g("data") * g("fsdp") * g("expert") * g("context") * mb)
    tp, c, e = g("tensor"), g("context"), g("expert")
    kv = attention_shape(m).kv  # keys and values per token (latent attention: expanded per head)
    return {
        "tensor": mb * 4 * layers * 2 * tok_mb * m.d_model * a * (tp - 1) / tp / bw("tensor")
        if tp > 1
        else 0,
        "context": mb * 3 * layers * (c - 1) * tok_mb * kv * a / bw("context") if c > 1 else 0,
        "expert": mb
        * 4
        * moe_layers
        * tok_mb
        * _rows_per_token(m.moe, e)
        * m.d_model
        * a
        * (e - 1)
        / e
        / bw("expert")
        if e > 1 and m.moe
        else 0,
        "stage": 2 * pipe.iterations * tok_mb / pipe.microbatches * m.d_model * a / bw("stage")
        if pipe.stages > 1
        else 0,
    }


# --- planning ---------------------------------------------------------------------


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.1f}" if x >= 10 * GiB else f"{x / GiB:.2f}"


def plan(
    cfg: Config,
    target: Target,
    *,
    top: int = 3,
    hbm_bytes: int | None = None,
    headroom: float = HEADROOM,
    compile: bool = True,
    charge_kernels: bool = True,
    log=lambda message: None,
) -> Plan:
    """Search, prune and confirm (module docstring). `hbm_bytes` overrides the target's device
    memory (a smaller device, for what-ifs and tests) both for the analytic check and for
    the compiled verdict."""
    if target.groups > 1:
        raise ConfigError("jaxtrain plan: one slice / host group for now (--slices / --hosts 1)")
    if hbm_bytes is not None:
        target = dataclasses.replace(target, hbm_bytes=int(hbm_bytes))
    rows = [analytic_row(cfg, cand, target, headroom) for cand in candidates(cfg, target.num_devices)]
    feasible = sorted(
        (r for r in rows if r.reason is None),
        key=lambda r: (r.analytic_step_s, r.comm_s, r.compute_s, r.candidate.microbatches, r.analytic_bytes),
    )
    rejected = [r for r in rows if r.reason is not None]
    notes = []
    if compile:
        ranked, ranked_by, compile_notes = _confirm(cfg, target, feasible, rejected, top, charge_kernels, log)
        notes += compile_notes
    else:
        ranked, ranked_by = feasible[:top], "analytic"
        notes.append("no compile (--no-compile): ranked and sized by the analytic model only")
    if not feasible:
        notes.append("no candidate fits by the analytic model: a bigger target, a smaller batch or seq_len")
    return Plan(
        target=target.describe(),
        platform=target.platform,
        hbm_bytes=target.hbm_bytes,
        headroom=headroom,
        ranked_by=ranked_by,
        ranked=ranked,
        rejected=sorted(rejected, key=lambda r: (r.analytic_step_s is None, r.analytic_step_s or 0)),
        searched=len(rows),
        notes=notes,
    )


def analytic_row(cfg: Config, cand: Candidate, target: Target, headroom: float = HEADROOM) -> Row:
    """The candidate judged by the analytic model: why it cannot run, or its estimated memory
    and step time (its other `auto` settings resolved for its mesh, as a run would)."""
    row = Row(cand)
    row.reason = invalid_reason(cfg, cand, target.num_devices)
    if row.reason:
        return row
    mesh = dict(cand.mesh)
    c = resolve(
        apply(cfg, cand), Placement(target.platform, mesh, target.hbm_bytes, chip=target.generation)
    ).config
    est = estimate(c, mesh, target.platform)
    row.analytic_bytes = est.total
    timing = analytic_step(c, mesh, hardware.chip(target.generation), target.chips)
    row.analytic_step_s, row.analytic_mfu = timing["step_s"], timing["mfu"]
    row.comm_s = sum(v for k, v in timing.items() if k not in ("compute_s", "step_s", "mfu"))
    row.compute_s = timing["compute_s"]
    if est.total > headroom * target.hbm_bytes:
        row.reason = (
            f"analytic {_gib(est.total)} GiB > {_gib(target.hbm_bytes)} GiB HBM x {headroom:g} headroom"
        )
    return row


def _confirm(cfg, target, feasible, rejected, top, charge_kernels, log) -> tuple[list[Row], str, list[str]]:
    """Compile the fastest analytic candidates until `top` fit (at most 2 x top compiles: a
    candidate the compiler refuses is replaced once); (ranked, ranked by, notes). Refused
    candidates join `rejected` with the compiler's reason."""
    can_estimate = target.platform == "tpu"
    ranked: list[Row] = []
    budget = 2 * top
    for row in feasible:
        if len(ranked) >= top or budget == 0:
            break
        budget -= 1
        cand = row.candidate
        log(f"compiling {cand.mesh_text()} remat={cand.remat} {cand.batching_text()}")
        row.reason = _compiled_verdict(row, apply(cfg, cand), target, can_estimate, charge_kernels)
        (rejected if row.reason else ranked).append(row)
    notes = []
    if feasible and not ranked:
        notes.append(
            f"the compiler refused the {2 * top - budget} fastest analytic candidates: "
            "raise --top to confirm more, or lower the batch or seq_len"
        )
    if can_estimate and ranked and all(r.compiled_step_s is not None for r in ranked):
        return sorted(ranked, key=lambda r: r.compiled_step_s), "compiled", notes
    if target.platform == "gpu":
        notes.append(
            "GPU target: XLA:GPU gives no cost estimate, so the compiled candidates are ranked "
            "by the analytic model (roofline FLOPs + communication); the compile confirms memory"
        )
    return ranked, "analytic", notes


def _compiled_verdict(row: Row, c: Config, target: Target, can_estimate: bool, charge_kernels: bool):
    """Compile one candidate; fill its compiled figures and return why it was refused (None: it fits)."""
    try:
        c, _, _ = config_for_target(c, target)
        r = compile_report(c, target, estimate=can_estimate, charge_kernels=charge_kernels)
    except ConfigError as e:
        return f"compile refused the config: {e}"
    total = (r.get("memory") or {}).get("total")
    row.compiled_bytes = total
    if not r["fits"]:
        return (
            f"compiled {_gib(total)} GiB does not fit {_gib(target.hbm_bytes)} GiB HBM"
            if total
            else f"compiled: does not fit ({r.get('compile_error', '')[:120]})"
        )
    row.compiled_step_s, row.compiled_mfu = r.get("step_seconds_est"), r.get("mfu_est")
    return None


def format_plan(p: Plan, *, show_rejected: int = 12) -> str:
    lines = [
        f"target   {p.target}: {_gib(p.hbm_bytes)} GiB HBM per device, analytic headroom {p.headroom:g}",
        f"searched {p.searched} candidates (mesh x remat x microbatches or pipeline); ranked by the "
        + ("compiler's TPU cost estimate" if p.ranked_by == "compiled" else "analytic model"),
        "",
        f"{'rank':<5}{'mesh':<34}{'remat':<21}{'batching':<18}{'analytic GiB':>14}{'compiled GiB':>14}"
        f"{'est. step s':>13}{'est. MFU':>10}",
    ]
    for i, r in enumerate(p.ranked, 1):
        c = r.candidate
        step = r.step_s
        mfu = r.compiled_mfu if r.compiled_mfu is not None else r.analytic_mfu
        src = "" if r.compiled_step_s is not None else "*"
        lines.append(
            f"{i:<5}{c.mesh_text():<34}{c.remat:<21}{c.batching_text():<18}{_gib(r.analytic_bytes):>14}"
            f"{_gib(r.compiled_bytes):>14}{(f'{step:.3f}' + src) if step else '-':>13}"
            f"{(f'{100 * mfu:.1f}%' + src) if mfu else '-':>10}"
        )
    if any(r.compiled_step_s is None for r in p.ranked):
        lines.append("(* analytic: roofline FLOPs + communication, not a compiler estimate)")
    if p.rejected:
        lines += [
            "",
            f"rejected ({len(p.rejected)}; the {min(show_rejected, len(p.rejected))} fastest by the model):",
        ]
        for r in p.rejected[:show_rejected]:
            c = r.candidate
            lines.append(f"  {c.mesh_text():<32}{c.remat:<21}{c.batching_text():<18}{r.reason}")
        counts: dict[str, int] = {}
        for r in p.rejected:
            key = r.reason.split(" ")[0]
            key = {"analytic": "analytic memory", "compiled": "compiled memory"}.get(key, "invalid shape")
            counts[key] = counts.get(key, 0) + 1
        lines.append("  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for note in p.notes:
        lines.append(f"note     {note}")
    return "\n".join(lines)


def check_output(path: str | Path, source: str | Path | None = None, *, force: bool = False) -> None:
    """Refuse to write the plan over `source` (the config it was planned from: never, even
    with `force`), over an existing file unless `force`, or into a folder. ConfigError."""
    out = Path(path)
    if source is not None and out.resolve() == Path(source).resolve():
        raise ConfigError(f"--apply={path}: that is the config being planned; write the plan to another file")
    if out.is_dir():
        raise ConfigError(f"--apply={path}: is a directory; expected a YAML file path")
    if out.exists() and not force:
        raise ConfigError(f"--apply={path}: the file exists; pass --force to replace it")


def write_config(
    cfg: Config, cand: Candidate, path: str | Path, *, source: str = "", force: bool = False
) -> Config:
    """Write the base config with the winning overrides as one loadable YAML; returns it.
    Never over `source`, and over an existing file only with `force` (check_output)."""
    check_output(path, source or None, force=force)
    out = apply(cfg, cand)
    header = (
        "# Written by `jaxtrain plan`" + (f" from {source}" if source else "") + "; the chosen overrides:\n"
    )
    header += "".join(f"#   {k}={v}\n" for k, v in cand.overrides().items())
    Path(path).write_text(header + yaml.safe_dump(to_dict(out), sort_keys=False))
    return out
