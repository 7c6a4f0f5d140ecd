"""Run configuration: YAML -> frozen, typed dataclasses, plus dotted overrides.

Nothing here imports jax, so the CLI can validate a config (and decide how many
CPU devices to simulate) before any backend starts. Every error is a
`ConfigError` naming the key, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxtrain import compose
from jaxtrain.models.config import ModelConfig


class ConfigError(ValueError):
    """A bad config key or value; the message names key, value and expectation."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Parallelism degrees per mesh axis (sharding.MESH_AXES); -1 fills the rest."""

    data: int = 1  # data parallelism: the batch split, parameters replicated
    fsdp: int = 1  # FSDP / ZeRO-3: the batch split, parameters and optimizer state sharded
    tensor: int = 1  # Megatron tensor parallelism: heads and MLP split
    context: int = 1  # sequence shards: ring / Ulysses attention (model.context_impl)
    expert: int = 1  # expert parallelism (MoE experts split over it; also a batch axis)
    stage: int = 1  # pipeline stages (layers split over them; see the `pipeline` section)
    rules: str = "fsdp_tensor"  # sharding.PRESETS: data_parallel | fsdp | fsdp_tensor | fsdp_tensor_sp
    # the untied output head: `embed` (FSDP on d_model like every weight, gathered
    # each step), `vocab` (vocab-parallel over fsdp, the activations gathered instead), `auto`
    # (vocab when a microbatch has fewer rows per device to gather than the head has vocabulary
    # entries per device; jaxtrain/planning/resolve.py)
    head_sharding: str = "auto"
    # DCN tier (across TPU slices / GPU hosts): these multiply the ICI degrees above,
    # which then count devices per slice. See `jaxtrain compile --slices`.
    dcn_data: int = 1
    dcn_fsdp: int = 1
    # TPU devices jax's mesh_utils cannot lay out on the torus (a subset of a slice, say) are
    # refused; true takes them in plain order, with a warning (collectives may cross far links)
    allow_plain_grid: bool = False

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in ("data", "stage", "fsdp", "context", "expert", "tensor")}

    def dcn_sizes(self) -> dict[str, int]:
        return {"data": self.dcn_data, "fsdp": self.dcn_fsdp}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 20  # optimizer steps in the run (a resumed run continues up to it)
    global_batch_size: int = 8  # sequences per step over all devices
    seq_len: int = 64  # tokens per sequence
    microbatches: int = 1  # gradient accumulation: the global batch is split into this many
    init_from: str | None = None  # converted weights (`jaxtrain convert hf-to-ckpt`) to start from
    # cross-entropy over this many sequence positions at a time (jaxtrain/trainer/loss.py), so the
    # [tokens, vocab] logits are never formed at once; 0: the plain loss over all of them;
    # auto: 4 chunks when the logits reach 16 MiB per device (jaxtrain/planning/resolve.py)
    loss_chunk: int | str = "auto"
    # what the step minimises: lm (next-token cross-entropy over the loss mask), dpo (direct
    # preference optimisation on `jaxtrain tokenize --preference` pairs; the `dpo` section) or
    # grpo (reinforcement learning from rewards on sampled completions; the `grpo` section)
    objective: str = "lm"


OBJECTIVES = ("lm", "dpo", "grpo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """Direct preference optimisation (train.objective=dpo; jaxtrain/trainer/dpo.py), TRL's
    sigmoid loss: per pair, z = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
    with log-probs summed over the response tokens, loss = -(1 - label_smoothing) x
    log sigmoid(beta z) - label_smoothing x log sigmoid(-beta z), the mean over the batch's
    pairs. The reference is the initial weights, frozen (train.init_from, or the seed's)."""

    beta: float = 0.1  # how far the policy may move from the reference (KL strength)
    label_smoothing: float = 0.0  # the chance a preference label is flipped (cDPO); 0: plain DPO


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Group relative policy optimisation (train.objective=grpo; jaxtrain/trainer/grpo.py and
    rollout.py), TRL's GRPOTrainer: `group_size` completions per prompt of data.source=prompts
    are sampled with the training weights, scored by `rewards`, and trained on with the clipped
    ratio against the sampling policy (and a k3 KL penalty against the initial weights)."""

    max_prompt_len: int | None = None  # prompt tokens kept (from the right); null: seq_len - max_new_tokens
    rewards: tuple[str, ...] = ()  # module:function callables, TRL's reward signature
    reward_weights: tuple[float, ...] = ()  # one per reward; empty: 1 each
    group_size: int = 8  # completions per prompt (train.global_batch_size counts completions)
    max_new_tokens: int = 256  # completion length limit (a completion ends at EOS or here)
    temperature: float = 1.0  # sampling temperature; the log-probs trained are of logits / it
    top_p: float = 1.0  # nucleus sampling (1: off), after top_k
    top_k: int = 0  # keep the k largest logits (0: off), after the temperature
    scale_rewards: str = "group"  # advantages divided by the std of: group | batch | none
    updates_per_rollout: int = 1  # steps that reuse one rollout (TRL's num_iterations)
    epsilon: float = 0.2  # ratio clip below (1 - epsilon) and, without epsilon_high, above
    epsilon_high: float | None = None  # ratio clip above (1 + epsilon_high); null: epsilon
    beta: float = 0.0  # k3 KL penalty weight against the frozen initial weights (0: none)
    loss_type: str = "dapo"  # aggregation: grpo | bnpo | dr_grpo | dapo

    def prompt_len(self, seq_len: int) -> int:
        """max_prompt_len as it applies (its default: what seq_len leaves for the completion)."""
        return self.max_prompt_len if self.max_prompt_len is not None else seq_len - self.max_new_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism, active when mesh.stage > 1 (sharding/pipeline.py): the layers
    run as mesh.stage stages over `microbatches` slices of each (train.microbatches) batch.
    gpipe: stage s holds one contiguous block of layers; circular: `repeats` blocks each,
    the microbatches going round the stages `repeats` times. Both run every forward, then
    every backward. 1f1b (one block per stage), interleaved_1f1b (`repeats` blocks, laid out
    as circular's) and zero_bubble (1f1b with the weight gradients deferred) interleave
    forwards and backwards, so a stage keeps at most ~stage microbatches' inputs
    (sharding/tick_pipeline.py). Idle share of each device (the bubble): that of the
    schedule's tick table (sharding/pipeline_tables.py); (stage - 1) / (microbatches *
    repeats + stage - 1) for all but zero_bubble."""

    microbatches: int | None = None  # null: mesh.stage
    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zero_bubble
    repeats: int = 1  # circular, interleaved_1f1b: layer blocks per stage (>= 2); others: 1

    def resolved_microbatches(self, stages: int) -> int:
        return stages if self.microbatches is None else self.microbatches


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling, on when model.compute_dtype is float16 (trainer/precision.py): the
    objective is multiplied by `scale` before the backward pass and the gradients divided
    by it; a step whose gradients overflow is skipped and the scale multiplied by
    `backoff_factor` (not below `min_scale`); after `growth_interval` clean steps in a row it
    is multiplied by `growth_factor`. The scale is part of the train state (checkpointed)."""

    init: float = 2.0**15  # the first step's scale
    growth_interval: int = 2000  # clean steps in a row before the scale grows
    growth_factor: float = 2.0  # the scale's growth, then
    backoff_factor: float = 0.5  # the scale's cut after an overflow
    min_scale: float = 1.0  # an overflow at this scale is a numerical fault (faults.*)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """Muon (optimizer.name=muon; jaxtrain/trainer/muon.py), as torch.optim.Muon computes it,
    for the hidden weight matrices, each taken in Hugging Face's [out, in] shape: the
    momentum buffer an average (buf = momentum x buf + (1 - momentum) x g), the update
    orthogonalised by `ns_steps` Newton-Schulz iterations in `ns_dtype`, weight decay
    1 - lr x weight_decay, the step scaled by the adjusted lr."""

    momentum: float = 0.95  # the momentum buffer's decay
    nesterov: bool = True  # the update (1 - momentum) x g + momentum x buf; false: buf
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: tuple[float, ...] = (3.4445, -4.775, 2.0315)  # (a, b, c) of the quintic
    eps: float = 1e-7  # floor of the Frobenius norm the update is divided by first
    # the lr of a [out, in] matrix: match_rms_adamw 0.2 x sqrt(max(out, in)) x lr (Moonshot's,
    # so AdamW's lr and weight decay carry over); original sqrt(max(1, out / in)) x lr (Keller's)
    adjust_lr: str = "match_rms_adamw"
    lr: float | None = None  # peak lr (on optimizer.lr's schedule); null: optimizer.lr
    weight_decay: float | None = None  # null: optimizer.weight_decay
    ns_dtype: str = "float32"  # float32 | bfloat16 (torch's own)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QKClipConfig:
    """QK-clip (Kimi K2's MuonClip; jaxtrain/trainer/qk_clip.py): after each update, every
    attention head whose largest pre-softmax logit in the step exceeded `tau` has its query
    and key weights scaled down by g = tau / max_logit (sqrt(g) on each; with grouped KV
    heads, g on the query head alone; with model.mla, sqrt(g) on the no-RoPE query and key
    parts, g on the RoPE query part, the shared RoPE key untouched)."""

    tau: float | None = None  # null: off


OPTIMIZERS = ("adamw", "muon")  # optimizer.name
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # optimizer.muon.adjust_lr
STATE_DTYPES = ("float32", "bfloat16")  # optimizer.state_dtype, optimizer.muon.ns_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`; with name muon,
    Muon for the hidden weight matrices and this AdamW for the rest (embeddings, LM head,
    norm scales, biases, routers), on the same schedule."""

    name: str = "adamw"  # adamw | muon

    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 5  # linear warmup from 0 to lr
    decay_steps: int | None = None  # None: train.steps
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio x lr
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.1  # matmul weights and embeddings only (optimizer.decays)
    clip_norm: float | None = 1.0  # global-norm clipping; null disables
    # Keep the Adam moments in pinned host memory (memory kinds), moved to the device for the
    # update and back (donated) inside the step; offload_params: the fp32 master weights too.
    offload: bool = False
    offload_params: bool = False
    # ZeRO-1: the optimizer state (Adam moments) is also split over mesh.data (each leaf on its
    # largest dimension data divides); parameters and gradients stay as the rules place them.
    shard_state: bool = False
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)  # float16 only
    # the dtype of Adam's moments and Muon's momentum (the update is computed in float32 either
    # way); null: the master weights' (model.param_dtype)
    state_dtype: str | None = None
    muon: MuonConfig = dataclasses.field(default_factory=MuonConfig)  # name muon
    qk_clip: QKClipConfig = dataclasses.field(default_factory=QKClipConfig)


PACKINGS = ("by_directory", "windows", "documents")  # data.packing


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | text | tokens | prompts (train.objective=grpo)
    # text: files or globs; tokens: `jaxtrain tokenize` output dirs; prompts: JSONL files
    paths: tuple[str, ...] = ()
    # text: byte | path to a Hugging Face tokenizers JSON (tokens: in the dirs); prompts: a
    # Hugging Face tokenizer directory (tokenizer.json and its chat template)
    tokenizer: str = "byte"
    shuffle: bool = True  # text and tokens: a seeded permutation of the windows (resumable)
    # tokens: mixture weight per path (any positive scale); empty: each dir's token count
    weights: tuple[float, ...] = ()
    # tokens: how a directory's stream becomes rows. windows: fixed seq_len + 1 windows of the
    # stream (documents cut at window edges); documents: whole documents packed greedily into rows
    # in order, the rest padded, one longer than seq_len + 1 cut to its head; by_directory:
    # documents for chat directories (`tokenize --chat`), windows for the others (a rule on the
    # data, not an `auto` left for resolve.py: the saved config says it as it ran)
    packing: str = "by_directory"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints of the whole run state (params, optimizer, step, data
    position, fault-monitor state, resolved config); see jaxtrain/recovery/checkpoint.py."""

    dir: str | None = None  # default {output_dir}/checkpoints
    every: int = 0  # save every N steps and at the last step; 0: never save
    keep: int = 3  # keep the newest K checkpoints ...
    keep_every: int = 0  # ... plus, forever, every step that is a multiple of M (0: none)
    resume: bool = True  # start from the newest complete checkpoint in `dir`, if any
    async_save: bool = True  # write in the background; the loop waits only for the snapshot
    # a checkpoint whose bytes prove it unreadable: stop the run naming it, nothing moved (stop),
    # or set it aside as {step}.unreadable and resume from the one before (skip)
    on_unreadable: str = "stop"
    # reads storage did not serve (unavailable, credentials) are retried this many times,
    # 2, 4, 8, ... s apart, then the run stops with exit 5, nothing moved
    read_retries: int = 4
    # the local tier (recovery/local.py): a path on each host (local disk, or a RAM disk such
    # as /dev/shm/run), where every process writes its own shards to {local_dir}/process_{i}/
    # every local_every steps (below `every`), keeping the newest local_keep; null: no local tier
    local_dir: str | None = None
    local_every: int = 0  # steps between local saves (needs local_dir; 0: none)
    local_keep: int = 2  # local steps kept per process


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-controller runs (one process per host): jax.distributed.initialize.

    With `coordinator_address` null, JAX's cluster auto-detection is used where
    it applies (Cloud TPU pods, SLURM, Open MPI) and a single process otherwise.
    """

    coordinator_address: str | None = None  # host:port of process 0, e.g. 10.0.0.1:1234
    num_processes: int | None = None  # processes in the job (with coordinator_address)
    process_id: int | None = None  # this process's index, 0 .. num_processes - 1
    auto_detect: bool = True  # TPU pod / SLURM / Open MPI environments
    initialization_timeout: int = 300  # seconds to wait for every process to connect
    heartbeat_timeout: int = 60  # a process silent this long is lost: the others exit non-zero


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Numerical faults: a non-finite loss/gradient (update skipped inside the step)
    or a loss spike. `max_consecutive` faults in a row trigger `on_too_many`."""

    skip_nonfinite: bool = True  # skip the update when loss or gradients are not finite
    spike_factor: float | None = None  # a loss > spike_factor x running median is a fault (null: off)
    spike_window: int = 32  # steps in that running median
    max_consecutive: int = 3  # consecutive faulty steps before acting
    on_too_many: str = "rollback"  # rollback: to the last checkpoint, past the bad batches | stop
    max_rollbacks: int = 3  # rollbacks in one run before stopping instead
    # TESTING HOOK (fault-injection tests only): these global batch indices get
    # loss_mask = inf, so their loss and gradients are not finite.
    testing_poison_batches: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out loss during training (jaxtrain/trainer/evaluate.py): `eval_loss` and `eval_perplexity`
    every `every` steps and after the last step, over the same `batches` batches each time.
    Eval data: `paths` (tokens: `jaxtrain tokenize` directories, their eval split if they have
    one, else their train split; text: held-out files); empty: the `eval` split of
    data.paths (tokens), a held-out synthetic stream (synthetic); text needs `paths`."""

    every: int = 0  # evaluate every N steps and after the last one; 0: never
    batches: int = 8  # eval batches per evaluation (the same ones every time); 0: tasks only
    batch_size: int | None = None  # rows per eval batch; null: train.global_batch_size
    paths: tuple[str, ...] = ()  # held-out data (see above); empty: the data's own eval split
    # lm-evaluation-harness tasks at the same steps, on the training mesh and weights
    # (jaxtrain/evaluation.py; needs the `eval` extra): each metric logged as
    # eval_<task>/<metric> (lm-eval's filter appended when it is not `none`)
    tasks: tuple[str, ...] = ()  # lm-eval task or group names; empty: none
    include_path: str | None = None  # a folder of task YAMLs of your own
    limit: float | None = None  # documents per task: a count, or a fraction (< 1); null: all
    num_fewshot: int | None = None  # few-shot examples per prompt; null: each task's own
    task_batch_size: int = 8  # requests per batch (eval.batch_size is the held-out loss's)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases (jaxtrain/observe/wandb_log.py; `pip install wandb`): the records of
    metrics.jsonl and the resolved config, logged by process 0. The run id is kept in
    output_dir/wandb_run_id, so a resumed run continues the same W&B run."""

    mode: str = "disabled"  # online | offline (files under output_dir/wandb, `wandb sync` later) | disabled
    project: str | None = None  # null: "jaxtrain"
    entity: str | None = None  # team or user; null: W&B's default for the API key
    name: str | None = None  # display name; null: the last part of output_dir
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Which process is slow (multi-process runs; jaxtrain/observe/stragglers.py): every `every`
    steps each process's own time per step (its step time less the time it waited for the
    device and the others at the sync point) and data wait are gathered; a process whose own
    time is over the median's by more than `slower_by` of the step time is named in a warning
    line and in metrics.jsonl."""

    every: int = 100  # steps between two reports; 0: off
    slower_by: float = 0.2  # 0.2: it adds over 20% of a step to every step


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    every: int = 1  # log metrics every N steps (the only host sync in the loop)
    tensorboard: bool = True  # TensorBoard event files under output_dir/tensorboard
    progress: bool = True  # rich progress bar on the console
    # MFU's peak: this per device, instead of the chip table (by device kind and compute
    # dtype) or, for a device the table lacks, a matmul measured on one device
    peak_flops_per_device: float | None = None
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    stragglers: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """A profiler window (jax.profiler, on every process): the steps `steps[0]..steps[1]`
    (inclusive) are traced into `dir`, for XProf or TensorBoard's profile plugin
    (`tensorboard --logdir DIR` or `xprof --logdir DIR`)."""

    steps: tuple[int, ...] = ()  # [first, last] step to trace (1-based, inclusive); empty: none
    dir: str | None = None  # null: {output_dir}/profile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    # metrics.jsonl, config.yaml, tensorboard/ and checkpoints/ go here (a path or a gs:// URL)
    output_dir: str = "runs/default"
    seed: int = 0  # parameters and synthetic / shuffled data follow from it
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)  # train.objective=dpo
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # train.objective=grpo
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)

    def under_output(self, name: str) -> str:
        """`output_dir/name`, for a local path or a URL."""
        if "://" in self.output_dir:  # gs://bucket/run (a URL: pathlib would fold the //)
            return self.output_dir.rstrip("/") + "/" + name
        return str(Path(self.output_dir) / name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir if self.checkpoint.dir is not None else self.under_output("checkpoints")

    @property
    def profile_dir(self) -> str:
        return self.profile.dir if self.profile.dir is not None else self.under_output("profile")

    @property
    def mesh_size(self) -> int:
        """Devices the mesh needs, or None-like 0 when an axis is -1 (fills the rest)."""
        sizes = self.mesh.sizes().values()
        return 0 if -1 in sizes else math.prod(sizes) * math.prod(self.mesh.dcn_sizes().values())


# --- building dataclasses from plain data, with type checks -------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against annotation `tp`; convert where YAML is loose (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}={value!r}: expected {' or '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        if isinstance(value, dict) and typing.get_origin(item) is tuple:
            value = list(value.items())  # a mapping field stored as (key, value) pairs
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, prefix=f"{key}.")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            raise ConfigError(f"{prefix}{k}: unknown key; expected one of {', '.join(sorted(fields))}")
    kwargs = {k: _coerce(f"{prefix}{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a dataclass's own check (__post_init__) names its key
        raise ConfigError(str(e)) from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        # `model={d_model: 64}` merges into the section rather than replacing it, so
        # the YAML's other model settings are not silently reset to their defaults.
        _merge(node[last], value)
    else:
        node[last] = value


def _one_line(error: Exception) -> str:
    """A YAML or decoding error as one line: where it is and what is wrong."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(error).split())


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value parsed as YAML: 3 -> int, 1e-3 -> float, [a, b] -> list)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads "1e-3" as a string; accept numeric strings for numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML at `path` (or defaults), apply `key=value` overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r}: is a directory; expected a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            data = yaml.safe_load(p.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r}: not valid YAML ({_one_line(e)})") from None
        if data is None:
            # An empty file would otherwise train on every default without a word.
            raise ConfigError(
                f"config file {str(p)!r}: empty; expected a YAML mapping of sections "
                "(model, train, data, ...; see configs/tiny.yaml)"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def validate_paths(cfg: Config) -> None:
    """Paths of the right kind, checked before anything is written or compiled: a folder
    where a folder is needed (output_dir, checkpoint.dir, train.init_from). URLs
    (gs://...) are left to the storage layer."""
    folders = {"output_dir": cfg.output_dir, "checkpoint.dir": cfg.checkpoint_dir}
    if cfg.checkpoint.local_dir is not None:
        folders["checkpoint.local_dir"] = cfg.checkpoint.local_dir
    if cfg.train.init_from:
        folders["train.init_from"] = cfg.train.init_from
    for key, value in folders.items():
        if "://" in str(value):
            continue
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}={value!r}: is a file; expected a folder (or a new path)")
        for parent in path.parents:  # a file in the way: mkdir would fail deep inside
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"{key}={value!r}: {str(parent)!r} is a file; expected a folder")
                break
    if cfg.train.init_from and "://" not in cfg.train.init_from and not Path(cfg.train.init_from).exists():
        raise ConfigError(
            f"train.init_from={cfg.train.init_from!r}: not found; expected a converted checkpoint "
            "(jaxtrain convert hf-to-ckpt) or a training run's output_dir / checkpoint folder"
        )


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Cross-field checks; `num_devices` (when known) is checked against the mesh."""
    try:
        cfg.model.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    refused = compose.refusals(cfg)  # the pairs of features jaxtrain/compose.py refuses
    if refused:
        raise ConfigError(refused[0])
    if cfg.model.param_dtype == "float16":
        # Master weights and Adam moments in float16 lose small updates (10-bit mantissa);
        # fp16 training keeps them float32 and computes in float16 with loss scaling.
        raise ConfigError(
            "model.param_dtype='float16': master weights must stay float32 (or bfloat16); "
            "for fp16 training set model.compute_dtype=float16 (dynamic loss scaling)"
        )
    _validate_precision(cfg)
    _validate_mesh(cfg)
    _validate_pipeline(cfg)
    _validate_context(cfg)
    _validate_linear_attention(cfg)
    _validate_train(cfg)
    _validate_dpo(cfg)
    _validate_grpo(cfg)
    if num_devices is not None:
        _validate_devices(cfg, num_devices)
    elif cfg.train.global_batch_size % cfg.train.microbatches:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size}: expected a multiple of "
            f"train.microbatches={cfg.train.microbatches}"
        )
    if cfg.data.source not in ("synthetic", "text", "tokens", "prompts"):
        raise ConfigError(f"data.source={cfg.data.source!r}: expected synthetic, text, tokens or prompts")
    _validate_data_tokens(cfg.data)
    if cfg.data.source == "text" and not cfg.data.paths:
        raise ConfigError("data.paths=[]: data.source=text needs at least one file or glob")
    _validate_optimizer(cfg.optimizer)
    if cfg.logging.every < 1:
        raise ConfigError(f"logging.every={cfg.logging.every}: expected a positive integer")
    _validate_fault_tolerance(cfg)
    _validate_eval(cfg)
    _validate_observability(cfg)
    compose.warn_untested(cfg)


def _validate_mesh(cfg: Config) -> None:
    m, model = cfg.mesh, cfg.model
    for axis, size in m.sizes().items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: expected a positive size or -1 (fill the rest)")
    if list(m.sizes().values()).count(-1) > 1:
        raise ConfigError("mesh: at most one axis may be -1")
    for axis, size in m.dcn_sizes().items():
        if size < 1:
            raise ConfigError(f"mesh.dcn_{axis}={size}: expected a positive integer")
    if m.expert > 1 and model.moe is not None and model.moe.num_experts % m.expert:
        raise ConfigError(
            f"model.moe.num_experts={model.moe.num_experts}: expected a multiple of "
            f"mesh.expert={m.expert} (experts are split evenly over the expert axis)"
        )
    rules = ("data_parallel", "fsdp", "fsdp_tensor", "fsdp_tensor_sp")
    if m.rules not in rules:
        raise ConfigError(f"mesh.rules={m.rules!r}: expected one of {rules}")
    heads = ("auto", "embed", "vocab")
    if m.head_sharding not in heads:
        raise ConfigError(f"mesh.head_sharding={m.head_sharding!r}: expected one of {heads}")
    if m.head_sharding == "vocab" and m.rules == "data_parallel":
        raise ConfigError(
            "mesh.head_sharding='vocab' shards the head over fsdp, but mesh.rules='data_parallel' "
            "replicates every parameter; use mesh.rules=fsdp or fsdp_tensor, or mesh.head_sharding=auto"
        )
    if m.head_sharding == "vocab" and m.stage > 1:
        raise ConfigError(
            f"mesh.head_sharding='vocab' with mesh.stage={m.stage}: the vocab-parallel head is not "
            "supported with pipeline stages; use mesh.head_sharding=auto or embed"
        )
    if m.tensor > 0:
        for key in ("n_heads", "n_kv_heads"):
            if getattr(model, key) % m.tensor:
                raise ConfigError(
                    f"model.{key}={getattr(model, key)}: expected a multiple of mesh.tensor={m.tensor}"
                )


def _validate_context(cfg: Config) -> None:
    """Context parallelism keeps batches in zig-zag order: 2 chunks per shard."""
    m, t, model = cfg.mesh, cfg.train, cfg.model
    if m.context <= 1:
        return
    if t.seq_len % (2 * m.context):
        raise ConfigError(
            f"train.seq_len={t.seq_len}: expected a multiple of 2 * mesh.context="
            f"{2 * m.context} (load-balanced context parallelism)"
        )
    if model.context_impl == "ulysses" and model.n_heads % (m.context * max(m.tensor, 1)):
        raise ConfigError(
            f"model.context_impl='ulysses' needs model.n_heads={model.n_heads} "
            f"divisible by mesh.context={m.context} x mesh.tensor={m.tensor}; "
            f"use model.context_impl=ring"
        )
    flash = model.attention_impl in ("pallas", "pallas_mosaic", "cudnn")  # the ring's blocks: flash
    if flash and model.flash_kernel_on_gpu == "mosaic" and model.context_impl == "ring":
        from jaxtrain.pallas_kernels.flash_mgpu import ring_chunk_misfit

        misfit = ring_chunk_misfit(t.seq_len, m.context, model.resolved_head_dim)
        if misfit:
            chunk, tile = misfit
            raise ConfigError(
                f"train.seq_len={t.seq_len} with mesh.context={m.context} and "
                f"model.attention_impl={model.attention_impl} and model.gpu_flash_kernel="
                f"{model.gpu_flash_kernel}: the ring's chunks of {chunk} tokens (seq_len / "
                f"(2 * context)) must be a multiple of {tile}, the Hopper flash kernel's tile; expected "
                f"train.seq_len a multiple of {2 * m.context * tile}, or the Triton kernel "
                "(attention_impl pallas, gpu_flash_kernel triton)"
            )


def _validate_linear_attention(cfg: Config) -> None:
    """What the gated DeltaNet layers (model.layer_types: linear_attention) do not run with
    yet, refused in one line; their key heads split over mesh.tensor as whole groups."""
    model, m = cfg.model, cfg.mesh
    if not model.has_linear_attention:
        return
    la = model.linear_attention
    refused = {
        "mesh.stage": (m.stage not in (0, 1), m.stage, "1 (no pipeline stages)"),
        "mesh.context": (
            m.context not in (0, 1),
            m.context,
            "1 (the state is not passed between shards yet)",
        ),
    }
    for key, (on, value, expected) in refused.items():
        if on:
            raise ConfigError(
                f"{key}={value!r} with linear_attention layers (model.layer_types): expected {expected}"
            )
    if m.tensor > 0 and la.num_key_heads % m.tensor:
        raise ConfigError(
            f"model.linear_attention.num_key_heads={la.num_key_heads}: expected a multiple of "
            f"mesh.tensor={m.tensor}"
        )


def _validate_train(cfg: Config) -> None:
    t = cfg.train
    if t.seq_len < 1:
        raise ConfigError(f"train.seq_len={t.seq_len}: expected a positive integer")
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps}: expected a positive integer")
    if t.loss_chunk != "auto" and (
        isinstance(t.loss_chunk, str) or t.loss_chunk < 0 or (t.loss_chunk and t.seq_len % t.loss_chunk)
    ):
        raise ConfigError(
            f"train.loss_chunk={t.loss_chunk}: expected auto, 0 (off) or a positive divisor of "
            f"train.seq_len={t.seq_len}"
        )
    if t.microbatches < 1:
        raise ConfigError(f"train.microbatches={t.microbatches}: expected a positive integer")
    if t.global_batch_size < 1:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size}: expected a positive integer")


def _validate_dpo(cfg: Config) -> None:
    t, d = cfg.train, cfg.dpo
    if t.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={t.objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if not (math.isfinite(d.beta) and d.beta > 0):
        raise ConfigError(f"dpo.beta={d.beta}: expected a positive number")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(
            f"dpo.label_smoothing={d.label_smoothing}: expected a number in [0, 0.5) (the chance a "
            "preference label is flipped)"
        )
    if t.objective != "dpo":
        return
    if cfg.data.source != "tokens":
        raise ConfigError(
            f"train.objective=dpo with data.source={cfg.data.source!r}: DPO trains on preference pairs; "
            "expected data.source=tokens with directories written by `jaxtrain tokenize --preference`"
        )
    if cfg.eval.every and not cfg.eval.tasks:
        raise ConfigError(
            f"eval.every={cfg.eval.every} with train.objective=dpo: held-out evaluation measures the LM "
            "loss; expected eval.every=0 (the dpo/* training metrics track the preference fit), or "
            "eval.tasks (benchmarks, which run without the held-out loss)"
        )


def _validate_grpo(cfg: Config) -> None:
    t, g = cfg.train, cfg.grpo
    if g.group_size < 2:
        raise ConfigError(
            f"grpo.group_size={g.group_size}: expected an integer >= 2 (advantages compare a group)"
        )
    if g.max_new_tokens < 1:
        raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens}: expected a positive integer")
    if not (math.isfinite(g.temperature) and g.temperature > 0):
        raise ConfigError(f"grpo.temperature={g.temperature}: expected a positive number")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"grpo.top_p={g.top_p}: expected a number in (0, 1] (1: off)")
    if not 0 <= g.top_k <= cfg.model.vocab_size:
        raise ConfigError(
            f"grpo.top_k={g.top_k}: expected an integer in [0, model.vocab_size={cfg.model.vocab_size}]"
        )
    if g.scale_rewards not in ("group", "batch", "none"):
        raise ConfigError(f"grpo.scale_rewards={g.scale_rewards!r}: expected group, batch or none")
    if g.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise ConfigError(f"grpo.loss_type={g.loss_type!r}: expected grpo, bnpo, dr_grpo or dapo")
    if g.updates_per_rollout < 1:
        raise ConfigError(f"grpo.updates_per_rollout={g.updates_per_rollout}: expected a positive integer")
    if not (math.isfinite(g.epsilon) and 0 <= g.epsilon < 1):
        raise ConfigError(f"grpo.epsilon={g.epsilon}: expected a number in [0, 1)")
    if g.epsilon_high is not None and not (math.isfinite(g.epsilon_high) and g.epsilon_high >= 0):
        raise ConfigError(f"grpo.epsilon_high={g.epsilon_high}: expected null or a number >= 0")
    if not (math.isfinite(g.beta) and g.beta >= 0):
        raise ConfigError(f"grpo.beta={g.beta}: expected a number >= 0")
    if g.reward_weights and len(g.reward_weights) != len(g.rewards):
        raise ConfigError(
            f"grpo.reward_weights={list(g.reward_weights)}: expected one weight per grpo.rewards "
            f"entry ({len(g.rewards)}), or none (1 each)"
        )
    for name in g.rewards:
        module, _, function = str(name).partition(":")
        if not module or not function:
            raise ConfigError(f"grpo.rewards entry {name!r}: expected module:function")
    if t.objective != "grpo":
        if cfg.data.source == "prompts":
            raise ConfigError(
                f"data.source=prompts with train.objective={t.objective!r}: prompts are for "
                "train.objective=grpo"
            )
        return
    if cfg.data.source != "prompts":
        raise ConfigError(
            f"train.objective=grpo with data.source={cfg.data.source!r}: GRPO samples completions of "
            "prompts; expected data.source=prompts (JSONL rows with `prompt` or `messages`)"
        )
    if not cfg.data.paths:
        raise ConfigError("data.paths=[]: data.source=prompts needs at least one JSONL file")
    if not g.rewards:
        raise ConfigError(
            "grpo.rewards=[]: train.objective=grpo needs at least one reward function (module:function)"
        )
    if t.global_batch_size % g.group_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size}: expected a multiple of "
            f"grpo.group_size={g.group_size} (it counts completions)"
        )
    prompt_len = g.prompt_len(t.seq_len)
    if prompt_len < 1 or prompt_len + g.max_new_tokens > t.seq_len:
        raise ConfigError(
            f"grpo.max_prompt_len={prompt_len} + grpo.max_new_tokens={g.max_new_tokens}: expected at least "
            f"one prompt token and a sum <= train.seq_len={t.seq_len}"
        )
    if cfg.eval.every and not cfg.eval.tasks:
        raise ConfigError(
            f"eval.every={cfg.eval.every} with train.objective=grpo: held-out evaluation measures the LM "
            "loss; expected eval.every=0 (the grpo/* metrics track the rewards), or eval.tasks "
            "(benchmarks, which run without the held-out loss)"
        )


def _validate_devices(cfg: Config, num_devices: int) -> None:
    """The mesh against the device count, and the batches against the mesh."""
    m, t = cfg.mesh, cfg.train
    sizes = m.sizes()
    dcn = m.dcn_sizes()  # slices / hosts: the per-slice axes see num_devices / their product
    if num_devices % math.prod(dcn.values()) == 0:
        num_devices //= math.prod(dcn.values())
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices % known:
            raise ConfigError(
                f"mesh: the fixed axes multiply to {known}, which does not divide "
                f"the device count {num_devices}"
            )
        sizes = {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}
    elif known != num_devices:
        raise ConfigError(
            f"mesh: product {known} "
            f"({' x '.join(f'{a}={s}' for a, s in sizes.items() if s > 1) or 'all 1'}) "
            f"does not equal the device count {num_devices}"
        )
    dp = sizes["data"] * dcn["data"] * sizes["fsdp"] * dcn["fsdp"] * sizes["expert"]
    pm = cfg.pipeline.resolved_microbatches(sizes["stage"]) if sizes["stage"] > 1 else 1
    if t.global_batch_size % (dp * t.microbatches * pm):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size}: expected a multiple of "
            f"mesh.data*mesh.fsdp*mesh.expert ({dp}) x train.microbatches ({t.microbatches})"
            f" x pipeline.microbatches ({pm}) = {dp * t.microbatches * pm}"
        )
    # the eval forward splits its batch as the step does: train.microbatches slices, each
    # through the pipeline's microbatches
    if cfg.eval.batch_size is not None and cfg.eval.batch_size % (dp * t.microbatches * pm):
        raise ConfigError(
            f"eval.batch_size={cfg.eval.batch_size}: expected a multiple of "
            f"mesh.data*mesh.fsdp*mesh.expert ({dp}) x train.microbatches ({t.microbatches})"
            f" x pipeline.microbatches ({pm}) = {dp * t.microbatches * pm}"
        )


def _validate_optimizer(o: OptimizerConfig) -> None:
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr}: expected a positive number")
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps}: expected >= 0")
    if o.clip_norm is not None and o.clip_norm <= 0:
        raise ConfigError(f"optimizer.clip_norm={o.clip_norm}: expected a positive number or null")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio={o.min_lr_ratio}: expected a value in [0, 1]")
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={o.name!r}: expected one of {', '.join(OPTIMIZERS)}")
    if o.state_dtype is not None and o.state_dtype not in STATE_DTYPES:
        raise ConfigError(
            f"optimizer.state_dtype={o.state_dtype!r}: expected null or one of {', '.join(STATE_DTYPES)}"
        )
    if o.qk_clip.tau is not None and not (math.isfinite(o.qk_clip.tau) and o.qk_clip.tau > 0):
        raise ConfigError(f"optimizer.qk_clip.tau={o.qk_clip.tau}: expected a positive number or null")
    _validate_muon(o.muon)


def _validate_muon(m: MuonConfig) -> None:
    if not 0 <= m.momentum < 1:
        raise ConfigError(f"optimizer.muon.momentum={m.momentum}: expected a value in [0, 1)")
    if not 1 <= m.ns_steps < 100:
        raise ConfigError(f"optimizer.muon.ns_steps={m.ns_steps}: expected an integer in [1, 100)")
    if len(m.ns_coefficients) != 3:
        raise ConfigError(
            f"optimizer.muon.ns_coefficients={list(m.ns_coefficients)}: expected three numbers (a, b, c)"
        )
    if not m.eps > 0:
        raise ConfigError(f"optimizer.muon.eps={m.eps}: expected a positive number")
    if m.adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError(
            f"optimizer.muon.adjust_lr={m.adjust_lr!r}: expected one of {', '.join(MUON_ADJUST_LR)}"
        )
    if m.lr is not None and not m.lr > 0:
        raise ConfigError(f"optimizer.muon.lr={m.lr}: expected a positive number or null")
    if m.weight_decay is not None and m.weight_decay < 0:
        raise ConfigError(f"optimizer.muon.weight_decay={m.weight_decay}: expected >= 0 or null")
    if m.ns_dtype not in STATE_DTYPES:
        raise ConfigError(
            f"optimizer.muon.ns_dtype={m.ns_dtype!r}: expected one of {', '.join(STATE_DTYPES)}"
        )


def held_out_eval(cfg: Config) -> bool:
    """Whether evaluations measure the held-out loss: eval.every set, eval.batches > 0 and an LM
    objective (DPO and GRPO runs evaluate eval.tasks alone)."""
    return bool(cfg.eval.every) and cfg.eval.batches > 0 and cfg.train.objective not in ("dpo", "grpo")


def _validate_eval(cfg: Config) -> None:
    e, d = cfg.eval, cfg.data
    if e.every < 0:
        raise ConfigError(f"eval.every={e.every}: expected >= 0 (0 turns evaluation off)")
    if e.batches < 0 or (e.batches == 0 and not e.tasks):
        raise ConfigError(
            f"eval.batches={e.batches}: expected a positive integer (0: no held-out loss, with eval.tasks)"
        )
    _validate_eval_tasks(cfg)
    if e.batches == 0:  # tasks alone: no held-out batches to check
        return
    if e.batch_size is not None and (e.batch_size < 1 or e.batch_size % cfg.train.microbatches):
        raise ConfigError(
            f"eval.batch_size={e.batch_size}: expected a positive multiple of "
            f"train.microbatches={cfg.train.microbatches}"
        )
    if e.every and d.source == "text" and not e.paths:
        raise ConfigError(
            "eval.paths=[]: eval with data.source=text needs held-out text files in eval.paths "
            "(text has no eval split; or `jaxtrain tokenize --eval-fraction` and data.source=tokens)"
        )
    if e.paths and d.source == "synthetic":
        raise ConfigError(
            f"eval.paths={list(e.paths)}: data.source=synthetic evaluates on a held-out synthetic "
            "stream; eval.paths is for the text and tokens sources"
        )


def _validate_eval_tasks(cfg: Config) -> None:
    e = cfg.eval
    if not e.tasks:
        return
    if any(not isinstance(t, str) or not t.strip() for t in e.tasks):
        raise ConfigError(f"eval.tasks={list(e.tasks)}: expected lm-eval task names")
    if e.limit is not None and not (e.limit > 0 and (e.limit < 1 or e.limit == int(e.limit))):
        raise ConfigError(f"eval.limit={e.limit}: expected a positive count or a fraction in (0, 1)")
    if e.num_fewshot is not None and e.num_fewshot < 0:
        raise ConfigError(f"eval.num_fewshot={e.num_fewshot}: expected an integer >= 0")
    if e.task_batch_size < 1:
        raise ConfigError(f"eval.task_batch_size={e.task_batch_size}: expected a positive integer")
    for axis in ("context", "stage"):
        if getattr(cfg.mesh, axis) != 1:
            raise ConfigError(
                f"eval.tasks with mesh.{axis}={getattr(cfg.mesh, axis)}: task evaluation runs the "
                f"generation paths, which need mesh.{axis}=1"
            )
    # not run yet: lm-eval answering in every process of a multi-host mesh, and parameters that
    # live in host memory between steps
    processes = cfg.distributed.num_processes or 1
    if processes > 1 or cfg.mesh.dcn_data > 1 or cfg.mesh.dcn_fsdp > 1:
        raise ConfigError(
            "eval.tasks with several processes (distributed.num_processes / mesh.dcn_*): not supported "
            "yet; expected one process (or `jaxtrain eval` on a checkpoint)"
        )
    if cfg.optimizer.offload_params:
        raise ConfigError(
            "eval.tasks with optimizer.offload_params=true: not supported yet; expected "
            "offload_params false (or `jaxtrain eval` on a checkpoint)"
        )


def _validate_precision(cfg: Config) -> None:
    ls = cfg.optimizer.loss_scale
    if not (math.isfinite(ls.init) and ls.init > 0):
        raise ConfigError(f"optimizer.loss_scale.init={ls.init}: expected a positive number")
    if ls.growth_interval < 1:
        raise ConfigError(f"optimizer.loss_scale.growth_interval={ls.growth_interval}: expected >= 1")
    if ls.growth_factor < 1:
        raise ConfigError(f"optimizer.loss_scale.growth_factor={ls.growth_factor}: expected >= 1")
    if not 0 < ls.backoff_factor < 1:
        raise ConfigError(f"optimizer.loss_scale.backoff_factor={ls.backoff_factor}: expected in (0, 1)")
    if not 0 < ls.min_scale <= ls.init:
        raise ConfigError(
            f"optimizer.loss_scale.min_scale={ls.min_scale}: expected > 0 and <= "
            f"optimizer.loss_scale.init={ls.init}"
        )


def _validate_pipeline(cfg: Config) -> None:
    p, stages = cfg.pipeline, cfg.mesh.stage
    schedules = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
    if p.schedule not in schedules:
        raise ConfigError(f"pipeline.schedule={p.schedule!r}: expected one of {', '.join(schedules)}")
    blocks = p.schedule in ("circular", "interleaved_1f1b")
    if p.microbatches is not None and p.microbatches < 1:
        raise ConfigError(f"pipeline.microbatches={p.microbatches}: expected a positive integer or null")
    if not blocks and p.repeats != 1:
        raise ConfigError(
            f"pipeline.repeats={p.repeats}: schedule {p.schedule} has 1 block of layers per stage; "
            "expected 1, or pipeline.schedule=circular or interleaved_1f1b"
        )
    if blocks and p.repeats < 2:
        one = "gpipe" if p.schedule == "circular" else "1f1b"
        raise ConfigError(
            f"pipeline.repeats={p.repeats}: schedule {p.schedule} expects >= 2 blocks per stage "
            f"(repeats=1 is {one})"
        )
    if stages == -1:
        raise ConfigError("mesh.stage=-1: expected an explicit number of pipeline stages")
    if stages <= 1:
        return
    m = p.resolved_microbatches(stages)
    if p.schedule == "circular" and m < stages:
        raise ConfigError(f"pipeline.microbatches={m}: the circular schedule expects >= mesh.stage={stages}")
    if p.schedule == "interleaved_1f1b" and m % stages:
        raise ConfigError(
            f"pipeline.microbatches={m}: the interleaved_1f1b schedule expects a multiple of "
            f"mesh.stage={stages}"
        )
    model, moe = cfg.model, cfg.model.moe
    chunks = stages * p.repeats
    stacks = (
        {"model.n_layers": model.n_layers}
        if moe is None
        else {
            "model.moe.first_dense_layers": moe.first_dense_layers,
            "MoE layer groups (model.n_layers - first_dense_layers) / moe.every": moe.num_moe_layers(model),
        }
    )
    for name, n in stacks.items():
        if n % chunks:
            raise ConfigError(
                f"{name}={n}: expected a multiple of mesh.stage x pipeline.repeats = {chunks} "
                "(each stage holds equal blocks of layers)"
            )


def _validate_data_tokens(d: DataConfig) -> None:
    if d.source == "tokens" and not d.paths:
        raise ConfigError("data.paths=[]: data.source=tokens needs at least one `jaxtrain tokenize` output")
    if d.packing not in PACKINGS:
        raise ConfigError(f"data.packing={d.packing!r}: expected one of {', '.join(PACKINGS)}")
    if d.packing == "documents" and d.source != "tokens":
        raise ConfigError(
            f"data.packing=documents with data.source={d.source!r}: only data.source=tokens packs "
            "whole documents (its directories record where each one ends)"
        )
    if not d.weights:
        return
    if d.source != "tokens":
        raise ConfigError(f"data.weights={list(d.weights)}: only data.source=tokens mixes paths by weight")
    if len(d.weights) != len(d.paths):
        raise ConfigError(
            f"data.weights={list(d.weights)}: expected one weight per data.paths entry ({len(d.paths)})"
        )
    for i, w in enumerate(d.weights):
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(f"data.weights[{i}]={w}: expected a positive number")


def _validate_local_tier(c: CheckpointConfig) -> None:
    """checkpoint.local_*: a host path, saved more often than the persistent tier."""
    if c.local_dir is not None and "://" in c.local_dir:
        raise ConfigError(
            f"checkpoint.local_dir={c.local_dir!r}: expected a path on each host (local disk or a "
            "RAM disk such as /dev/shm/run), not object storage; object storage is checkpoint.dir's"
        )
    if c.local_dir == "":
        raise ConfigError("checkpoint.local_dir='': expected a path on each host or null (no local tier)")
    if c.local_every < 0:
        raise ConfigError(f"checkpoint.local_every={c.local_every}: expected >= 0 (0: no local tier)")
    if c.local_keep < 1:
        raise ConfigError(f"checkpoint.local_keep={c.local_keep}: expected a positive integer")
    if c.local_every > 0 and c.local_dir is None:
        raise ConfigError(
            f"checkpoint.local_every={c.local_every}: expected checkpoint.local_dir to be set too "
            "(a path on each host)"
        )
    if c.local_dir is not None and c.local_every == 0:
        raise ConfigError(
            f"checkpoint.local_dir={c.local_dir!r}: expected checkpoint.local_every > 0 "
            "(the steps between local saves)"
        )
    if c.every > 0 and c.local_every >= c.every:
        raise ConfigError(
            f"checkpoint.local_every={c.local_every}: expected below checkpoint.every={c.every} "
            "(the local tier is the frequent one)"
        )


def _validate_fault_tolerance(cfg: Config) -> None:
    c, d, f = cfg.checkpoint, cfg.distributed, cfg.faults
    if c.every < 0:
        raise ConfigError(f"checkpoint.every={c.every}: expected >= 0 (0 turns saving off)")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep}: expected a positive integer")
    if c.keep_every < 0:
        raise ConfigError(f"checkpoint.keep_every={c.keep_every}: expected >= 0 (0: keep only the newest)")
    if c.dir == "":
        raise ConfigError("checkpoint.dir='': expected a path or null ({output_dir}/checkpoints)")
    if c.on_unreadable not in ("stop", "skip"):
        raise ConfigError(f"checkpoint.on_unreadable={c.on_unreadable!r}: expected one of stop, skip")
    if c.read_retries < 0:
        raise ConfigError(f"checkpoint.read_retries={c.read_retries}: expected >= 0")
    _validate_local_tier(c)
    explicit = {k: getattr(d, k) for k in ("coordinator_address", "num_processes", "process_id")}
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = [k for k in explicit if k not in given]
        raise ConfigError(
            f"distributed.{given[0]}={explicit[given[0]]!r}: expected "
            f"{', '.join('distributed.' + k for k in missing)} to be set too"
        )
    if d.coordinator_address is not None:
        host, _, port = d.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"distributed.coordinator_address={d.coordinator_address!r}: expected host:port"
            )
    if d.num_processes is not None and d.num_processes < 1:
        raise ConfigError(f"distributed.num_processes={d.num_processes}: expected a positive integer")
    if d.process_id is not None and d.num_processes is not None and not 0 <= d.process_id < d.num_processes:
        raise ConfigError(
            f"distributed.process_id={d.process_id}: expected 0 <= process_id < "
            f"distributed.num_processes={d.num_processes}"
        )
    if d.num_processes and cfg.mesh_size and cfg.mesh_size % d.num_processes:
        raise ConfigError(
            f"distributed.num_processes={d.num_processes}: expected a divisor of the "
            f"mesh size {cfg.mesh_size}"
        )
    for key in ("initialization_timeout", "heartbeat_timeout"):
        if getattr(d, key) < 1:
            raise ConfigError(f"distributed.{key}={getattr(d, key)}: expected a positive number of seconds")
    if f.spike_factor is not None and f.spike_factor <= 1:
        raise ConfigError(f"faults.spike_factor={f.spike_factor}: expected a number > 1 or null")
    if f.spike_window < 3:
        raise ConfigError(f"faults.spike_window={f.spike_window}: expected >= 3")
    if f.max_consecutive < 1:
        raise ConfigError(f"faults.max_consecutive={f.max_consecutive}: expected a positive integer")
    if f.on_too_many not in ("rollback", "stop"):
        raise ConfigError(f"faults.on_too_many={f.on_too_many!r}: expected rollback or stop")
    if f.max_rollbacks < 0:
        raise ConfigError(f"faults.max_rollbacks={f.max_rollbacks}: expected >= 0")
    bad = [b for b in f.testing_poison_batches if b < 0]
    if bad:
        raise ConfigError(
            f"faults.testing_poison_batches={list(f.testing_poison_batches)}: expected batch indices >= 0"
        )


def _validate_observability(cfg: Config) -> None:
    w, st, pr = cfg.logging.wandb, cfg.logging.stragglers, cfg.profile
    if w.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"logging.wandb.mode={w.mode!r}: expected online, offline or disabled")
    if st.every < 0:
        raise ConfigError(f"logging.stragglers.every={st.every}: expected >= 0 (0: off)")
    if not st.slower_by > 0:
        raise ConfigError(f"logging.stragglers.slower_by={st.slower_by}: expected a fraction > 0")
    if pr.steps and (len(pr.steps) != 2 or not 1 <= pr.steps[0] <= pr.steps[1]):
        raise ConfigError(
            f"profile.steps={list(pr.steps)}: expected [first, last] with 1 <= first <= last (or [])"
        )


def to_dict(cfg: Config) -> dict:
    """Plain, YAML/JSON-ready dict of a config (tuples become lists)."""

    def convert(x):
        if isinstance(x, tuple):
            return [convert(v) for v in x]
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        return x

    return convert(dataclasses.asdict(cfg))
