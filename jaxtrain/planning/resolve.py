"""Every `auto` setting, resolved once for where the program runs.

A config may leave these settings on `auto`; before any program is built, `resolve` turns
them into values for a `Placement` (the platform, the mesh's axis sizes, one device's
memory), in this order, each step seeing the ones before it:

| setting                   | depends on      | `auto` picks                                               |
|---------------------------|-----------------|------------------------------------------------------------|
| model.attention_impl      | platform, chip, | GPU fastest measured (attention_speeds), TPU pallas, CPU xla |
|                           | model.mla       | xla for MLA whose value head dim differs from its qk one   |
| model.gpu_flash_kernel    | platform, chip  | GPU: mosaic (Hopper) where it takes the case, else triton  |
| model.linear_attention.impl | (none yet)    | xla everywhere: the Pallas kernel is not yet run or timed  |
|                           |                 | on a TPU or GPU (opt in with pallas)                       |
| model.cpu_tuning          | platform        | true on CPU: models/cpu_tuning.py's program changes        |
| model.scan_layers         | platform, mesh  | unrolled on one GPU (up to UNROLL_MAX_LAYERS), else scanned |
| model.moe.exchange        | platform        | padded on CPU (no ragged_all_to_all there), ragged else    |
| model.moe.grouped_matmul  | platform, chip  | TPU megablox, GPU grouped_matmul_choice, CPU ragged_dot    |
| model.moe.dispatch_per_shard | mesh         | true where a token reaches fewer expert shards than top_k  |
|                           |                 | (models/moe.py dispatch_per_shard), dropless, receive 0    |
| mesh.head_sharding        | mesh, batch     | vocab when a device gathers fewer rows than vocab columns  |
| train.loss_chunk          | mesh, batch     | 4 chunks once the f32 logits reach 16 MiB per device       |
| model.remat               | device memory   | of those that fit (footprint.py), GPU: least predicted     |
|                           | chip            | cost (remat_cost.py); else: least recompute                |

`jaxtrain train`, `compile`, `plan` and `generate` all resolve here, so they build the same
program for the same placement; the run's `config.yaml` records the resolved values and the
log has one line per resolved setting saying what and why (none for a setting the placement
does not use: `model.gpu_flash_kernel` off GPUs). A setting given explicitly that the
placement's platform cannot run (`model.attention_impl: cudnn` for a CPU program) is refused
here, in one line (a ConfigError). The model itself never asks which platform it runs on
(models/ hold no platform branches): it reads these values.

Nothing here starts a backend or needs a device: the planner resolves its candidates for
targets it only describes (a `Placement` is plain data).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain import sharding
from jaxtrain.config import Config, ConfigError
from jaxtrain.models.moe import dispatch_per_shard, shards_per_token
from jaxtrain.planning.attention_speeds import choose_gpu_attention, choose_gpu_flash_kernel
from jaxtrain.planning.footprint import (
    LOSS_AUTO_CHUNKS,
    device_memory_bytes,
    estimate,
    remat_policies,
    sequences_per_row,
)
from jaxtrain.planning.grouped_matmul_choice import choose_gpu_grouped_matmul
from jaxtrain.planning.remat_cost import policy_cost
from jaxtrain.sharding import hardware
from jaxtrain.sharding.mesh import mesh_shape_from_sizes

AUTO = "auto"
# train.loss_chunk=auto chunks (footprint.LOSS_AUTO_CHUNKS chunks) once one microbatch's f32
# logits reach this many MiB per device
LOSS_AUTO_MIN_MIB = 16
# model.scan_layers=auto unrolls the layer loop of a one-GPU program up to this many layers: no
# stacked buffers to copy each layer's kept activations into (on one H100, 2026-11-28, the
# gpu-peer step 0.1823 against 0.1864 s scanned, 22.3 against 23.4 GiB; the dropless MoE step
# 0.1732 against 0.1797 s), for a compile time that grows with depth (twice the scanned one at
# 16). Over several GPUs the unrolled program's memory moves either way with the mesh
# (compiled for 8 H100s: gpu-peer -0.6 GiB with fsdp, +2.6 with data; Llama-3-8B +8.4 with
# fsdp), and no speed was measured there, so those keep the scanned loop.
UNROLL_MAX_LAYERS = 32
REMAT_HEADROOM = 0.9  # model.remat=auto: the estimate must fit this fraction of a device's memory
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a program runs: everything an `auto` setting depends on besides the config."""

    platform: str  # "cpu" | "gpu" | "tpu"
    mesh_shape: Mapping[str, int]  # every mesh axis's size, ICI x DCN
    device_memory: int | None = None  # bytes one device holds; None: unknown
    memory_source: str = ""  # for the log: "H100 HBM", "host memory / 8 simulated devices"
    chip: str | None = None  # sharding/hardware.py's chip name ("h100", "v5p"); None: not in it


def placement_of_devices(cfg: Config, devices: Sequence) -> Placement:
    """The placement of a run of `cfg` on these (jax) devices: their platform, the config's
    mesh over them (-1 filled; ICI x DCN), one device's memory (CPU: the host's over the
    simulated devices, as the door check counts it)."""
    dcn = cfg.mesh.dcn_sizes()
    per_slice = max(1, len(devices) // math.prod(dcn.values()))
    try:
        ici = mesh_shape_from_sizes(cfg.mesh.sizes(), per_slice)
    except ValueError:  # validate() reports a bad mesh; resolve against one device meanwhile
        ici = dict.fromkeys(cfg.mesh.sizes(), 1)
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(devices[0].platform, devices[0].platform)
    capacity, sharing = device_memory_bytes(devices[0])
    source = f"host memory / {sharing} simulated devices" if platform == "cpu" else devices[0].device_kind
    row = hardware.chip_for_device_kind(devices[0].device_kind) if platform != "cpu" else None
    return Placement(
        platform,
        {a: ici[a] * dcn.get(a, 1) for a in ici},
        capacity // sharing if capacity else None,
        source,
        row.name if row else None,
    )


@dataclasses.dataclass(frozen=True)
class Resolution:
    config: Config  # no `auto` left
    notes: tuple[str, ...]  # one log line per setting that was auto (and is used here)


def resolve(cfg: Config, placement: Placement, *, recorded_remat: str | None = None) -> Resolution:
    """Every `auto` of `cfg` resolved for `placement` (module docstring). `recorded_remat`: the
    policy an earlier attempt of the same run resolved `model.remat: auto` to (its
    config.yaml), which a resume keeps whatever memory this host has, so the resumed steps
    compute exactly as before."""
    notes = []
    for name, choose in _SETTINGS:
        current = _get(cfg, name)
        if current != AUTO:
            continue
        if name == "model.remat" and recorded_remat not in (None, AUTO):
            value, why = recorded_remat, "as recorded by this run's earlier attempt (resume)"
        else:
            value, why = choose(cfg, placement)
        cfg = _set(cfg, name, value)
        if why is None:  # a setting this placement does not use: resolved, not logged
            continue
        shown = str(value).lower() if isinstance(value, bool) else value  # as YAML writes it
        notes.append(f"{name}=auto -> {shown}: {why}")
    _refuse_other_platforms(cfg, placement)
    return Resolution(cfg, tuple(notes))


# Settings that name one platform's implementation, and the platform they need. Set explicitly
# for a program that runs elsewhere they would fail deep in the build (cuDNN's attention has
# no CPU or TPU lowering: an internal error) or never finish (the Mosaic GPU kernel's
# interpreter ran a tiny model's CPU training step for over 10 minutes), so resolution refuses
# them in one line; `jaxtrain compile --target gpu:...` resolves for a GPU and keeps them.
_GPU_ONLY_ATTENTION = {
    "cudnn": "cuDNN's fused attention runs only on NVIDIA GPUs",
    "pallas_mosaic": "the Hopper flash kernel (Pallas Mosaic GPU) runs only on Hopper GPUs",
}
_ATTENTION_HERE = {
    "cpu": "xla or auto (or pallas: the portable flash kernel, interpreted)",
    "tpu": "pallas (the Mosaic TPU flash kernel), xla or auto",
}


def _refuse_other_platforms(cfg: Config, p: Placement) -> None:
    impl = cfg.model.attention_impl
    if impl in _GPU_ONLY_ATTENTION and p.platform != "gpu":
        raise ConfigError(
            f"model.attention_impl={impl}: {_GPU_ONLY_ATTENTION[impl]}, and this program runs on "
            f"{p.platform.upper()}; expected {_ATTENTION_HERE.get(p.platform, 'xla or auto')} here, "
            "or compile it for a GPU with `jaxtrain compile --target gpu:h100`"
        )


def agreed(resolution: Resolution) -> Resolution:
    """Process 0's resolution, on every process of a multi-process run.

    Each process resolves against what it sees (its devices' memory, the config.yaml a
    resume finds, which process 0 alone writes), and two processes that resolved differently
    would compile different programs. So process 0's choices are broadcast and every process
    takes them, with its lines. A no-op in a single process."""
    if jax.process_count() == 1:
        return resolution
    values = {name: _get(resolution.config, name) for name, _ in _SETTINGS}
    mine = json.dumps({"values": values, "notes": list(resolution.notes)}).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(len(mine), np.int32)))
    buffer = np.zeros(size, np.uint8)  # the same shape on every process; process 0's bytes
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(mine, np.uint8)
    chosen = json.loads(bytes(multihost_utils.broadcast_one_to_all(buffer)).decode())
    cfg = resolution.config
    for name, value in chosen["values"].items():
        if value is not None:
            cfg = _set(cfg, name, value)
    return Resolution(cfg, tuple(chosen["notes"]))


def check_resolved(cfg: Config) -> None:
    """ValueError naming the first setting still on `auto`: programs are built from resolved
    configs only (`resolve`, or `resolve_for_mesh` in tests and tools)."""
    for name, _ in _SETTINGS:
        if _get(cfg, name) == AUTO:
            raise ValueError(
                f"{name}=auto reached the program builder unresolved: resolve the config first "
                "(jaxtrain.planning.resolve.resolve or resolve_for_mesh)"
            )


def resolve_for_mesh(cfg: Config, mesh) -> Config:
    """`resolve` for a concrete `jax.sharding.Mesh` (tests, tools, notebooks): the config
    with every auto resolved for the mesh's devices."""
    devices = list(mesh.devices.flat)
    placement = placement_of_devices(cfg, devices)
    placement = dataclasses.replace(placement, mesh_shape=dict(mesh.shape))
    return resolve(cfg, placement).config


def axis_rules(cfg: Config) -> sharding.AxisRules:
    """The run's logical-axis rules: the `mesh.rules` preset, with the vocab-parallel head
    where `mesh.head_sharding` resolved to vocab."""
    if cfg.mesh.head_sharding == AUTO:
        raise ValueError("mesh.head_sharding=auto: resolve the config first (jaxtrain.planning.resolve)")
    rules = sharding.PRESETS[cfg.mesh.rules]
    return sharding.vocab_parallel_head(rules) if cfg.mesh.head_sharding == "vocab" else rules


# --- the settings, in resolution order -------------------------------------------------------


def _attention_impl(cfg: Config, p: Placement) -> tuple[str, str]:
    m = cfg.model
    head_dim, v_head_dim = _attention_head_dims(m)
    if p.platform == "gpu":
        return choose_gpu_attention(
            chip=p.chip,
            head_dim=head_dim,
            window=m.sliding_window is not None,
            compute_dtype=m.compute_dtype,
            softcap=m.attention_softcap is not None,
            sinks=m.attention_sinks,
            v_head_dim=v_head_dim,
        )
    if p.platform == "tpu":
        return "pallas", "the Pallas flash kernel (Mosaic TPU)"
    return "xla", "on CPU the Pallas kernels only run interpreted"


def _linear_attention_impl(cfg: Config, p: Placement) -> tuple[str, str | None]:
    # xla on every platform for now: the Pallas gated-delta kernels (pallas_kernels/
    # gated_delta.py) equal both jnp references in the interpreter and compile deviceless for
    # TPU v5p and H100, but have never run on a TPU or GPU and have no timing to choose them by.
    # A run opts in with model.linear_attention.impl=pallas; revisit once they are measured.
    if not cfg.model.has_linear_attention:
        return "xla", None  # no gated DeltaNet layer: nothing runs it
    return "xla", (
        "the gated delta rule in XLA; the Pallas kernel is not yet run or timed on a TPU or GPU "
        "(opt in with model.linear_attention.impl=pallas)"
    )


def _attention_head_dims(m) -> tuple[int, int | None]:
    """(the query/key head dim, the value head dim where it differs: latent attention's)."""
    if m.mla is None:
        return m.resolved_head_dim, None
    qk, v = m.mla.qk_head_dim, m.mla.v_head_dim
    return qk, (v if v != qk else None)


def _gpu_flash_kernel(cfg: Config, p: Placement) -> tuple[str, str | None]:
    m = cfg.model
    if p.platform != "gpu":
        return "triton", None  # TPUs and CPUs run their own flash kernel whatever this says
    head_dim, v_head_dim = _attention_head_dims(m)
    kernel, why = choose_gpu_flash_kernel(
        chip=p.chip,
        head_dim=head_dim,
        compute_dtype=m.compute_dtype,
        softcap=m.attention_softcap is not None,
        sinks=m.attention_sinks,
        v_head_dim=v_head_dim,
    )
    context = p.mesh_shape.get("context", 1)
    if kernel == "mosaic" and context > 1 and m.context_impl == "ring":
        from jaxtrain.pallas_kernels.flash_mgpu import ring_chunk_misfit

        misfit = ring_chunk_misfit(cfg.train.seq_len, context, head_dim)
        if misfit:
            chunk, tile = misfit
            return "triton", (
                f"the ring's chunks of {chunk} tokens are no multiple of the Hopper kernel's tile ({tile})"
            )
    return kernel, why


def _cpu_tuning(cfg: Config, p: Placement) -> tuple[bool, str]:
    if p.platform == "cpu":
        return True, "XLA:CPU's program changes (models/cpu_tuning.py)"
    return False, f"a {p.platform.upper()} program"


def _scan_layers(cfg: Config, p: Placement) -> tuple[bool, str | None]:
    n, devices = cfg.model.n_layers, math.prod(p.mesh_shape.values())
    if p.mesh_shape.get("stage", 1) > 1:
        return True, None  # pipeline stages run their own loop over the layers
    if p.platform != "gpu":
        return True, "one compiled layer body, whatever the depth"
    if devices > 1:
        return True, (
            f"{devices} GPUs: one compiled layer body; unrolling pays on one GPU, while over several the "
            "step's memory moved with the mesh (Llama-3-8B on 8 H100s with fsdp: 25.3 against 16.9 GiB)"
        )
    if n > UNROLL_MAX_LAYERS:
        return True, f"{n} layers, more than the {UNROLL_MAX_LAYERS} a GPU unrolls: one compiled layer body"
    return False, (
        f"{n} layers unrolled: no stacked buffers to copy each layer's kept activations into "
        f"(one GPU, up to {UNROLL_MAX_LAYERS} layers)"
    )


def _moe_exchange(cfg: Config, p: Placement) -> tuple[str, str]:
    if p.platform == "cpu":
        return "padded", "ragged_all_to_all is unimplemented on XLA:CPU"
    return "ragged", f"ragged_all_to_all on {p.platform.upper()}"


def _grouped_matmul(cfg: Config, p: Placement) -> tuple[str, str]:
    if p.platform == "tpu":
        return "megablox", "JAX's Pallas TPU grouped matmul"
    if p.platform == "gpu":
        m = cfg.model
        d_ff = m.moe.expert_mlp_dim if m.moe is not None and m.moe.expert_mlp_dim else m.mlp_dim
        return choose_gpu_grouped_matmul(
            chip=p.chip, d_model=m.d_model, d_ff=d_ff, compute_dtype=m.compute_dtype
        )
    return "ragged_dot", f"XLA's jax.lax.ragged_dot on {p.platform.upper()}"


def _dispatch_per_shard(cfg: Config, p: Placement) -> tuple[bool, str | None]:
    m, ep = cfg.model.moe, p.mesh_shape.get("expert", 1)
    if ep <= 1 or m.dispatch != "dropless":  # no exchange: nothing to choose
        return False, None
    n = shards_per_token(m, ep)
    if dispatch_per_shard(m, ep):
        return True, (
            f"a token's {m.top_k} experts lie on at most {n} of the {ep} expert shards: it is "
            f"sent {n} rows, not {m.top_k}"
        )
    if m.receive_factor:
        return False, f"model.moe.receive_factor={m.receive_factor} bounds the receive buffer by assignments"
    return False, f"a token's {m.top_k} experts may lie on {n} of the {ep} expert shards: nothing to save"


def head_rows_per_device(cfg: Config, mesh_shape: Mapping[str, int]) -> int:
    """Tokens of one microbatch that one device holds when the head is vocab-parallel
    (gathered over fsdp; still split over data, expert and context)."""
    t = cfg.train
    split = mesh_shape.get("data", 1) * mesh_shape.get("expert", 1) * mesh_shape.get("context", 1)
    rows = t.global_batch_size * sequences_per_row(cfg)  # a DPO row is two sequences
    return rows * t.seq_len // (max(1, t.microbatches) * split)


def _head_sharding(cfg: Config, p: Placement) -> tuple[str, str]:
    """Under FSDP every weight is sharded on d_model and all-gathered where it is used; for the
    head [d_model, vocab] that costs about 2 x d_model x vocab / tensor values per device per
    microbatch, however few tokens there are. `vocab` shards the head on vocab over fsdp
    instead (sharding.vocab_parallel_head) and gathers the final activations into the head's
    rows: about 2 x rows x d_model values. So vocab when rows < vocab / tensor: small batches,
    long vocabularies; never a pod's million-token batch. The embedding keeps its layout."""
    fsdp = p.mesh_shape.get("fsdp", 1)
    if fsdp <= 1:
        return "embed", "no fsdp axis to shard the vocabulary over"
    if cfg.mesh.rules == "data_parallel":
        return "embed", "mesh.rules=data_parallel replicates the head"
    if cfg.mesh.stage > 1:
        return "embed", "pipeline stages keep the head FSDP-sharded"
    rows = head_rows_per_device(cfg, p.mesh_shape)
    columns = cfg.model.vocab_size // max(1, p.mesh_shape.get("tensor", 1))
    if rows < columns:
        return "vocab", (
            f"a device gathers {rows} activation rows x d_model instead of the head's "
            f"{columns} vocabulary columns x d_model"
        )
    return "embed", f"{rows} activation rows per device >= {columns} vocabulary columns per device"


def logits_mib_per_device(cfg: Config, mesh_shape: Mapping[str, int]) -> float:
    """MiB of one microbatch's f32 logits on one device: the microbatch's tokens x vocab,
    spread over every axis that splits the batch or the vocabulary (the same count whether
    the head is FSDP- or vocab-parallel: mesh.head_sharding moves rows, not their number)."""
    t = cfg.train
    tokens = t.global_batch_size * t.seq_len // max(1, t.microbatches)
    split = math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert", "context", "tensor"))
    return 4 * tokens * cfg.model.vocab_size / split / 2**20


def _loss_chunk(cfg: Config, p: Placement) -> tuple[int, str]:
    """The plain loss forms one microbatch's [tokens, vocab] f32 logits at once; chunked
    (trainer/loss.py) only one chunk of them. Four chunks were faster as well as smaller once
    the logits are large (two gained less, eight no more); below LOSS_AUTO_MIN_MIB a small
    model's logits are not worth the scan."""
    if cfg.train.objective == "dpo":
        return 0, "the plain loss: train.objective=dpo needs each sequence's log-probability"
    if cfg.train.objective == "grpo":
        return 0, "the plain loss: train.objective=grpo needs each completion token's log-probability"
    if cfg.model.final_softcap is not None:
        return 0, f"the plain loss: model.final_softcap={cfg.model.final_softcap} (the chunked loss has none)"
    seq, mib = cfg.train.seq_len, logits_mib_per_device(cfg, p.mesh_shape)
    if mib < LOSS_AUTO_MIN_MIB:
        return 0, f"the plain loss: {mib:.1f} MiB of f32 logits per device, under {LOSS_AUTO_MIN_MIB} MiB"
    if seq % LOSS_AUTO_CHUNKS:
        return 0, f"the plain loss: train.seq_len={seq} does not split into {LOSS_AUTO_CHUNKS} chunks"
    return seq // LOSS_AUTO_CHUNKS, (
        f"{LOSS_AUTO_CHUNKS} chunks of {seq // LOSS_AUTO_CHUNKS} positions: {mib:.1f} MiB of f32 logits "
        "per device at once otherwise"
    )


def _remat(cfg: Config, p: Placement) -> tuple[str, str]:
    """The policy `auto` runs: of those whose estimated step memory fits REMAT_HEADROOM x the
    device's memory, on a GPU of the hardware table the one of least predicted cost
    (remat_cost.py: recompute and activation traffic), elsewhere the cheapest in recomputed
    FLOPs (footprint.REMAT_BY_COST, the order in which they are tried). Nothing fits: `full`,
    the smallest (the door check or the compiler then has the last word)."""
    if p.device_memory is None:
        return "none", "device memory unknown"
    budget, where = REMAT_HEADROOM * p.device_memory, f" ({p.memory_source})" if p.memory_source else ""
    gib = lambda b: f"{b / GiB:.1f}" if b >= 10 * GiB else f"{b / GiB:.2f}"
    with_policy = lambda policy: _set(cfg, "model.remat", policy)
    need = {q: estimate(with_policy(q), p.mesh_shape, p.platform).total for q in remat_policies(cfg.model)}
    fits = [policy for policy in need if need[policy] <= budget]
    of = f"of {gib(p.device_memory)} GiB{where} x {REMAT_HEADROOM:g}"
    if not fits:
        return "full", f"nothing fits, full needs est. {gib(need['full'])} GiB per device {of}"
    chip = hardware.CHIPS.get(p.chip or "")
    if p.platform == "gpu" and chip is not None and chip.hbm_bytes_per_s:
        cost = {policy: policy_cost(with_policy(policy), p.mesh_shape, chip) for policy in fits}
        best = min(fits, key=lambda policy: cost[policy].total_s)  # ties: the least recompute
        c = cost[best]
        others = ", ".join(f"{q} {cost[q].total_s * 1e3:.1f}" for q in fits if q != best)
        return best, (
            f"the least predicted cost that fits on {chip.name.upper()}: {c.total_s * 1e3:.1f} ms "
            f"(recompute {c.recompute_s * 1e3:.1f} + activation traffic {c.traffic_s * 1e3:.1f}; "
            f"{others or 'no other fits'}), est. {gib(need[best])} GiB per device {of}"
        )
    first = next(iter(need))
    why = f"; {first} needs {gib(need[first])} GiB" if fits[0] != first else ""
    return fits[0], f"the cheapest policy that fits, est. {gib(need[fits[0]])} GiB per device {of}{why}"


_SETTINGS = (
    ("model.attention_impl", _attention_impl),
    ("model.gpu_flash_kernel", _gpu_flash_kernel),
    ("model.linear_attention.impl", _linear_attention_impl),
    ("model.cpu_tuning", _cpu_tuning),
    ("model.scan_layers", _scan_layers),
    ("model.moe.exchange", _moe_exchange),
    ("model.moe.grouped_matmul", _grouped_matmul),
    ("model.moe.dispatch_per_shard", _dispatch_per_shard),
    ("mesh.head_sharding", _head_sharding),
    ("train.loss_chunk", _loss_chunk),
    ("model.remat", _remat),
)


def _get(cfg: Config, name: str):
    """The value of a dotted setting; None where its section is absent (model.moe: null)."""
    node = cfg
    for part in name.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _set(cfg, name: str, value):
    """`cfg` with the dotted setting replaced (frozen dataclasses all the way down)."""
    head, _, rest = name.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _set(getattr(cfg, head), rest, value)})
