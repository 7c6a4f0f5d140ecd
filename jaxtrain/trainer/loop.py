"""The training loop: mesh -> sharded state (fresh or resumed) -> steps -> metrics + checkpoints.

The loop waits on the device only at logging steps (`logging.every`), checkpoint
steps and preemption: there it fetches the metrics of every step since the last
fetch in one transfer, feeds them to the fault monitor, and writes a record for
the logging step. Step time is the wall time between two logging points divided
by the steps in between.

Evaluation (`eval.*`, trainer/evaluate.py): every `eval.every` steps and after the last one,
the held-out loss over the same `eval.batches` batches, through `TrainProgram.eval_step`
(jitted with the state's shardings, nothing donated); recorded as its own metrics line
`{"step", "eval_loss", "eval_perplexity", "eval_tokens", "eval_time_s"}` after the step's.
With `eval.tasks`, lm-eval's benchmarks on the training weights join that line
(`eval_<task>/<metric>`, `eval_tasks_time_s`); DPO and GRPO runs evaluate them alone.

`output_dir`, `checkpoint.dir`, `data.paths`, `eval.paths` and `train.init_from` may be
URLs (`gs://bucket/run`, any `etils.epath` scheme); process 0 alone writes the shared
files (config.yaml, metrics.jsonl, TensorBoard), Orbax writes the checkpoints.

Every `auto` setting is resolved once, first (planning/resolve.py), and config.yaml records the
resolved values.

Fault tolerance (details in jaxtrain/recovery: checkpoint.py, faults.py, distributed.py):
- resume: the newest complete checkpoint is restored (state, data position, fault-monitor
  state), so the losses continue exactly as in an uninterrupted run: from `checkpoint.dir`,
  or from the local tier (`checkpoint.local_dir`) when it holds a newer step whole across
  the processes (recovery/tiers.py);
- preemption: SIGTERM/SIGINT (or, multi-process, JAX's preemption sync point)
  finish the current step, save a checkpoint, wait for it and return;
- numerical faults: skipped updates / loss spikes are counted, and a streak of
  them rolls back to the last checkpoint (past the bad batches) or stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator

import jax
import yaml
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from jaxtrain import host, sharding
from jaxtrain.config import Config, held_out_eval, to_dict
from jaxtrain.data import make_data_iterator, make_eval_iterator, storage
from jaxtrain.data.prompts import PromptIterator
from jaxtrain.interchange.convert import load_params
from jaxtrain.interchange.peft import read_adapter
from jaxtrain.metrics import MetricsWriter
from jaxtrain.models import lora
from jaxtrain.observe import goodput
from jaxtrain.observe.profiler import ProfileWindow
from jaxtrain.observe.stragglers import StragglerReport
from jaxtrain.planning.flops import flops_per_token, mesh_peak_flops
from jaxtrain.planning.resolve import agreed, axis_rules, placement_of_devices, resolve
from jaxtrain.recovery import tiers
from jaxtrain.recovery.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    abstract_state,
    fingerprint,
    retry_delays,
)
from jaxtrain.recovery.distributed import describe_topology
from jaxtrain.recovery.faults import FaultMonitor
from jaxtrain.recovery.local import LocalCheckpointer
from jaxtrain.trainer.batches import BatchFeeder
from jaxtrain.trainer.evaluate import Evaluations, Evaluator, TaskEvaluator
from jaxtrain.trainer.program import TrainProgram, build_program, pipeline_schedule
from jaxtrain.trainer.rollout import RolloutFeeder
from jaxtrain.trainer.step import TrainState

# Config sections whose change does not affect the numbers of a resumed run.
_RESUME_NEUTRAL = ("output_dir", "checkpoint.", "logging.", "distributed.", "eval.", "profile.")


@dataclasses.dataclass
class TrainResult:
    metrics: list[dict]
    state: object
    program: TrainProgram
    mesh: jax.sharding.Mesh
    start_step: int = 0  # the step resumed from (0: fresh start)
    final_step: int = 0
    preempted_by: str | None = None  # "SIGTERM", "SIGINT" or "preemption notice"
    checkpoint_step: int | None = None  # newest checkpoint written by this run
    evals: list[dict] = dataclasses.field(default_factory=list)  # eval records (`eval.*`), oldest first


def make_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """The run's mesh: per-slice (ICI) degrees times `mesh.dcn_*` across slices / hosts."""
    dcn = {a: n for a, n in cfg.mesh.dcn_sizes().items() if n > 1}
    return sharding.make_mesh(
        cfg.mesh.sizes(), devices, dcn_axis_sizes=dcn or None, allow_plain_grid=cfg.mesh.allow_plain_grid
    )


def initial_state(cfg: Config, program: TrainProgram, target: TrainState, log) -> TrainState:
    """A fresh state: random init, or `train.init_from`'s weights, read straight into the run's
    shardings and wrapped without a random initialisation (one copy of the parameters at any
    time); the optimizer state starts empty either way. model.lora: the base as above (frozen),
    the adapters fresh or read from model.lora.init_from (a PEFT adapter directory)."""
    lo = cfg.model.lora
    if lo is None:
        if not cfg.train.init_from:
            return program.init()
        log(f"initialising parameters from {cfg.train.init_from}")
        return program.init_with(load_params(cfg.train.init_from, cfg.model, target.params))
    if cfg.train.init_from:
        state = program.init_with(lora.join(load_base(cfg, target, log), program.init_adapters()))
    else:
        state = program.init()  # a random base: for tests and trials
    if lo.init_from:
        log(f"LoRA adapters from {lo.init_from}")
        state = state._replace(params=read_adapter(lo.init_from, cfg.model, target.params))
    return state


def load_base(cfg: Config, target: TrainState, log) -> dict:
    """model.lora's frozen base, train.init_from's weights, read into the run's shardings."""
    log(f"LoRA base (frozen) from {cfg.train.init_from}")
    return load_params(cfg.train.init_from, cfg.model, target.frozen)


class _ProcessLog:
    """Non-primary processes of a multi-process run: log lines only (process 0 writes metrics)."""

    def __init__(self):
        self.prefix = f"[process {jax.process_index()}] "

    def write(self, record: dict) -> None:
        pass

    def has_earlier_records(self) -> bool:
        return False

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        pass

    def open(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def log(self, message: str) -> None:
        print(self.prefix + message, file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _Preemption:
    """Stop requests: SIGTERM/SIGINT in a single process; in a multi-process job, JAX's
    preemption sync point (its own SIGTERM notifier, shared by all processes, which then
    agree on the step to stop at). A second SIGINT interrupts at once."""

    def __init__(self):
        self.synced = jax_distributed.global_state.preemption_sync_manager is not None
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum, frame):
        if self.synced:  # hand it to JAX's SIGTERM notifier, which tells every process
            os.kill(os.getpid(), signal.SIGTERM)
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C stops at once
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __enter__(self):
        signals = [signal.SIGINT] if self.synced else [signal.SIGINT, signal.SIGTERM]
        for s in signals:
            try:
                self._previous[s] = signal.signal(s, self._on_signal)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def requested(self, step: int) -> bool:
        if self.synced:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "preemption notice"
                return True
            return False
        return self.signal_name is not None


def _config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += _config_changes(a, b, name + ".")
        elif a != b and not name.startswith(_RESUME_NEUTRAL):
            changes.append(f"{name}: {a!r} -> {b!r}")
    return changes


def train(cfg: Config, *, devices=None) -> TrainResult:
    """Train `cfg` (resuming from its newest checkpoint) on `devices` (default: all)."""
    clock = goodput.GoodputClock(first_step=0)  # from here on every second is in a bucket
    devices = list(devices) if devices is not None else jax.devices()
    resolution = agreed(resolve(cfg, placement_of_devices(cfg, devices), recorded_remat=_recorded_remat(cfg)))
    cfg = resolution.config
    run = None
    try:
        with _setup(cfg, devices, clock, notes=resolution.notes) as run:
            with clock.phase("restore"):
                restored = _resume(run)
            # Accepted (data readable, checkpoints fit the model): only now touch output_dir.
            _record_start(run, restored)
            if restored is None:
                state = initial_state(cfg, run.program, run.target, run.writer.log)
            else:
                state = _with_base(run, restored)
            run.base_fingerprint = fingerprint(state.frozen)
            step = clock.first_step = int(jax.device_get(state.step))
            result = TrainResult(
                metrics=[],
                state=state,
                program=run.program,
                mesh=run.mesh,
                start_step=step,
                final_step=step,
                checkpoint_step=restored.step if restored else None,
            )
            if step >= cfg.train.steps:
                run.writer.log(
                    f"nothing to do: the checkpoint is at step {step} >= train.steps={cfg.train.steps}"
                )
                return result
            if isinstance(run.feeder, RolloutFeeder):
                run.feeder.start(step)
            with clock.phase("data_wait"):
                batch = _next_batch(run, state)
            t0 = time.perf_counter()
            with clock.phase("compile"):
                step_fn = run.program.step.lower(state, batch[0]).compile()
            run.writer.log(f"compiled train step in {time.perf_counter() - t0:.1f} s")
            with _Preemption() as preemption:
                clock.looping()
                try:
                    state, step = _loop(run, result, step_fn, state, step, batch, preemption)
                finally:
                    run.profile.stop()
                with clock.phase("checkpoint_save"):
                    if run.checkpointer is not None:
                        run.checkpointer.wait()  # the last write is on disk before we say so
                    if run.local is not None:
                        run.local.wait()
            if result.preempted_by:
                _log_preemption(run, result, step)
            result.state, result.final_step = state, step
            return result
    finally:
        if run is not None:  # once more, the teardown included: goodput.json covers all of train()
            run.goodput_file.write(clock, durable=True)


def _next_batch(run: _Run, state) -> tuple[dict, int]:
    """(the next step's device batch, its batch index); train.objective=grpo samples it with
    `state`'s weights (trainer/rollout.py)."""
    return run.feeder.next(state) if isinstance(run.feeder, RolloutFeeder) else run.feeder.next()


def _loop(run: _Run, result: TrainResult, step_fn, state, step: int, first_batch, preemption: _Preemption):
    """Train steps until `train.steps`, a stop request or a fault stop; returns (state, step).

    Batches come as (device batch, global batch index), each fetched while the step
    before it runs on the device."""
    total = run.cfg.train.steps
    batch, batch_index = first_batch
    pending: list[tuple[int, int, dict]] = []  # (step, batch index, device metrics) not yet fetched
    timer = _StepTimer(step)
    clock, stragglers = run.clock, run.stragglers
    stragglers.reset()  # the first window starts with the steps
    while step < total:
        with run.profile.step(step + 1):
            state, metrics = step_fn(state, batch)
        step += 1
        run.profile.after(step, state)
        stragglers.step_done()
        pending.append((step, batch_index, metrics))
        data_state = run.feeder.data_state()  # position of the next batch to train on
        if step < total:
            t0 = time.perf_counter()
            with clock.phase("data_wait"):
                batch, batch_index = _next_batch(run, state)  # overlaps the step (grpo: waits for it)
            stragglers.window.data_wait += time.perf_counter() - t0
        stop = preemption.requested(step)  # sync ids = step numbers, as Orbax uses
        save_due = run.save_due(step, stop)
        local_due = run.local_due(step, stop, save_due)
        log_due = step % run.cfg.logging.every == 0 or step == total
        # Evaluate at eval.every and after the last step (not when stopping early).
        eval_due = (
            run.evaluator is not None and run.evaluator.due(step, total) and (not stop or step == total)
        )
        straggler_due = stragglers.due(step)
        if not (log_due or save_due or local_due or stop or eval_due or straggler_due):
            continue
        t0 = time.perf_counter()
        action, newest = _process_pending(pending, run.monitor)
        if action == "rollback":
            with clock.phase("restore"):
                frozen = state.frozen  # model.lora's base: not in checkpoints, unchanged by steps
                state, step, (batch, batch_index) = _rollback(run, step)
                state = state._replace(frozen=frozen)
            timer.reset(step)
            stragglers.reset()
            continue
        if action == "stop":
            raise run.monitor.stop_error()
        # Before the save, so that a checkpoint at this step means its evaluation ran; its
        # record is written after the step's own.
        with clock.phase("eval"):
            evaluated = run.evaluator(state, step) if eval_due else None
        with clock.phase("checkpoint_save"):
            blocked = run.save(step, state, data_state, result) if save_due else None
            local_blocked = run.save_local(step, state, data_state, result) if local_due else None
        stragglers.window.waited += time.perf_counter() - t0  # the device, the others, eval, save
        if log_due:
            record = _metrics_record(run, step, newest, timer.lap(step), blocked, local_blocked)
            run.writer.write(record)
            result.metrics.append(record)
            clock.logged(step)
        if evaluated is not None:
            run.writer.write(evaluated)
            result.evals.append(evaluated)
            timer.reset(step)  # the evaluation is not step time
        if straggler_due:
            _report_stragglers(run, step)
        if evaluated is not None or blocked is not None:
            run.writer.sync()  # remote output_dir: metrics durable with each checkpoint / eval
        if log_due or evaluated is not None or blocked is not None or local_blocked is not None:
            run.goodput_file.write(clock, durable=evaluated is not None or blocked is not None)
        if stop:
            result.preempted_by = preemption.signal_name
            break
    return state, step


# --- what the loop is built from ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rates:
    """Per-step work and the mesh's peak, for tokens/s and MFU."""

    tokens_per_step: int
    flops_per_step: float
    peak_total: float  # FLOP/s of the whole mesh
    peak_source: str

    @classmethod
    def for_run(cls, cfg: Config, mesh: jax.sharding.Mesh) -> _Rates:
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        flops = flops_per_token(cfg.model, cfg.train.seq_len) * tokens
        if cfg.train.objective == "dpo":  # two sequences per row, and the reference's forward pass
            tokens, flops = 2 * tokens, 2 * flops * 4 / 3
        total, source = mesh_peak_flops(
            mesh.devices.flat[0], mesh.size, cfg.logging.peak_flops_per_device, dtype=cfg.model.compute_dtype
        )
        return cls(tokens, flops, total, source)


@dataclasses.dataclass
class _Run:
    """What a run holds besides the train state (built by `_setup`)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    program: TrainProgram
    feeder: BatchFeeder | RolloutFeeder
    writer: MetricsWriter | _ProcessLog
    checkpointer: Checkpointer | None
    monitor: FaultMonitor
    target: TrainState  # abstract state (shapes, shardings) that checkpoints restore into
    rates: _Rates
    clock: goodput.GoodputClock
    goodput_file: goodput.GoodputFile
    stragglers: StragglerReport
    profile: ProfileWindow
    evaluator: Evaluations | None = None  # `eval.every` > 0
    base_fingerprint: str | None = None  # model.lora: the frozen base's (checkpoint meta)
    local: LocalCheckpointer | None = None  # the local tier (`checkpoint.local_dir`)

    def save_due(self, step: int, stop: bool) -> bool:
        every = self.cfg.checkpoint.every
        return (
            self.checkpointer is not None
            and every > 0
            and (step % every == 0 or step == self.cfg.train.steps or stop)
        )

    def local_due(self, step: int, stop: bool, save_due: bool) -> bool:
        """A local save: every `checkpoint.local_every` steps, unless the persistent tier saves
        this step (a restart would prefer it); at a stop or the last step too, when there is no
        persistent tier to save them."""
        c = self.cfg.checkpoint
        if self.local is None or save_due:
            return False
        return step % c.local_every == 0 or (c.every == 0 and (stop or step == self.cfg.train.steps))

    def meta(self) -> dict:
        """A checkpoint's `meta` (either tier): the config, the fault monitor, the seed, the layout."""
        meta = {
            "config": to_dict(self.cfg),
            "faults": self.monitor.state_dict(),
            "seed": self.cfg.seed,
            "process_count": jax.process_count(),
            "mesh": dict(self.mesh.shape),
        }
        if self.base_fingerprint is not None:
            meta["lora_base"] = self.base_fingerprint
        return meta

    def save_local(self, step: int, state, data_state: dict, result: TrainResult) -> float:
        """Local-tier save of `step` (this process's shards); returns the seconds the loop was blocked."""
        blocked = self.local.save(step, state, data_state, self.meta())
        self.clock.saved(step, tier="local")
        if self.cfg.checkpoint.every == 0:
            result.checkpoint_step = step
        self.writer.log(f"local checkpoint step {step}: loop blocked {blocked * 1e3:.0f} ms")
        return blocked

    def save(self, step: int, state, data_state: dict, result: TrainResult) -> float | None:
        """Checkpoint `step`; returns the seconds the loop was blocked (None: not written)."""
        blocked = self.checkpointer.save(step, state, data_state, self.meta())
        if blocked is not None:
            result.checkpoint_step = step
            self.clock.saved(step)
            self.writer.log(
                f"checkpoint step {step}: loop blocked {blocked * 1e3:.0f} ms, "
                f"writing {'in the background' if self.cfg.checkpoint.async_save else 'done'}"
            )
        return blocked


def _recorded_remat(cfg: Config) -> str | None:
    """The policy an earlier attempt of this run resolved `model.remat: auto` to, when this
    one resumes it (its config.yaml): the resumed steps then compute exactly as before,
    whatever memory this host has. None when there is nothing to resume."""
    if cfg.model.remat != "auto":
        return None
    recorded = storage.as_path(cfg.output_dir) / "config.yaml"
    local = cfg.checkpoint.local_dir is not None and os.path.isdir(cfg.checkpoint.local_dir)
    held = local or storage.as_path(cfg.checkpoint_dir).is_dir()
    if not (cfg.checkpoint.resume and held and recorded.is_file()):
        return None
    try:
        return (yaml.safe_load(recorded.read_text()) or {}).get("model", {}).get("remat")
    except (yaml.YAMLError, OSError, AttributeError):
        return None


@contextlib.contextmanager
def _setup(cfg: Config, devices, clock: goodput.GoodputClock, notes: tuple[str, ...] = ()) -> Iterator[_Run]:
    """Mesh, data, metrics writer, program, checkpointer, for resolved `cfg`.

    On exit the checkpointer closes first (waiting for a write still in flight), then
    the data iterators, the metrics writer, the mesh and the axis rules."""
    mesh = make_mesh(cfg, devices)
    rules = axis_rules(cfg)
    rates = _Rates.for_run(cfg, mesh)
    data, eval_data = _open_data(cfg)
    log = cfg.logging
    writer_cm = (
        MetricsWriter(
            cfg.output_dir,
            total_steps=cfg.train.steps,
            tensorboard=log.tensorboard,
            progress=log.progress,
            wandb=(log.wandb, to_dict(cfg)),
        )
        if jax.process_index() == 0
        else _ProcessLog()
    )
    with jax.set_mesh(mesh), sharding.axis_rules(rules), writer_cm as writer:
        program = build_program(cfg, mesh, rules)
        _log_start(cfg, mesh, rates, writer, (*notes, *filter(None, [host.note()])))
        checkpointer = _checkpointer(cfg, writer.log)
        local = None
        if cfg.checkpoint.local_dir is not None:
            local = LocalCheckpointer(
                cfg.checkpoint.local_dir,
                keep=cfg.checkpoint.local_keep,
                async_save=cfg.checkpoint.async_save,
                log=writer.log,
            )
        if cfg.train.objective == "grpo":
            feeder = RolloutFeeder(cfg, data, mesh, program, rules, writer.log, clock)
        else:
            feeder = BatchFeeder(cfg, data, mesh, program.batch_sharding)
        evaluator = None
        held_out = Evaluator(cfg, eval_data, feeder, program, writer.log) if eval_data is not None else None
        tasks = None
        if cfg.eval.every and cfg.eval.tasks:
            tasks = TaskEvaluator(cfg, mesh, rules, program, writer.log)
        if held_out is not None or tasks is not None:
            evaluator = Evaluations(cfg.eval.every, held_out, tasks)
            writer.log(evaluator.describe())
        run = None
        try:
            run = _Run(
                cfg=cfg,
                mesh=mesh,
                program=program,
                feeder=feeder,
                writer=writer,
                checkpointer=checkpointer,
                monitor=FaultMonitor(cfg.faults),
                target=abstract_state(program),
                rates=rates,
                clock=clock,
                goodput_file=goodput.GoodputFile(cfg.output_dir, primary=jax.process_index() == 0),
                stragglers=StragglerReport(
                    log.stragglers.every, log.stragglers.slower_by, jax.process_count()
                ),
                profile=ProfileWindow(cfg.profile.steps, cfg.profile_dir, writer.log),
                evaluator=evaluator,
                local=local,
            )
            yield run
        finally:
            with clock.phase("checkpoint_save"):
                if checkpointer is not None:
                    checkpointer.close()  # waits for a write still in flight
                if local is not None:
                    local.close()
            for it in (data, eval_data):  # open shard files (remote: HTTP sessions)
                if hasattr(it, "close"):
                    it.close()
            if run is not None:
                _report_goodput(run)  # the writer is still open; closing it is all that is left


def _open_data(cfg: Config):
    """(this process's train data iterator, the eval one or None)."""
    data_args = dict(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        seed=cfg.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if cfg.train.objective == "grpo":
        g = cfg.grpo
        prompts = PromptIterator(
            cfg.data,
            max_prompt_len=g.prompt_len(cfg.train.seq_len),
            global_batch_size=cfg.train.global_batch_size // g.group_size,
            seed=cfg.seed,
        )
        return prompts, None
    data = make_data_iterator(
        cfg.data,
        global_batch_size=cfg.train.global_batch_size,
        pairs=cfg.train.objective == "dpo",
        **data_args,
    )
    if not held_out_eval(cfg):
        return data, None
    eval_rows = cfg.eval.batch_size or cfg.train.global_batch_size
    return data, make_eval_iterator(cfg.data, cfg.eval.paths, global_batch_size=eval_rows, **data_args)


def _log_start(cfg: Config, mesh, rates: _Rates, writer, notes) -> None:
    """The run's first log lines: mesh, rules, size and peak; what each `auto` resolved to;
    the host heap; the pipeline's bubble; the processes' topology."""
    writer.log(
        f"mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1) or 'single device'} "
        f"rules={cfg.mesh.rules} params={cfg.model.param_count():,} "
        f"peak={rates.peak_total:.3g} FLOP/s ({rates.peak_source})"
    )
    for note in notes:
        writer.log(note)
    pp = pipeline_schedule(cfg)
    if pp is not None:
        writer.log(
            f"pipeline: {cfg.pipeline.schedule}, {pp.stages} stages x {pp.microbatches} microbatches"
            f" x {pp.repeats} repeats; bubble (idle share of its tick table) = {pp.bubble:.3f}"
        )
    if jax.process_count() > 1:
        writer.log(describe_topology())


def _record_start(run: _Run, restored) -> None:
    """Write config.yaml (process 0) and, when metrics.jsonl already holds an earlier run's
    records, a marker row, so appended rows are never mixed in silently."""
    if jax.process_index() != 0:
        return
    cfg = run.cfg
    out = storage.as_path(cfg.output_dir)  # a local path or a URL (gs://bucket/run)
    out.mkdir(parents=True, exist_ok=True)
    run.writer.open()  # TensorBoard, W&B: started here, not at the first step's record
    run.goodput_file.start(restored.step if restored is not None else None)
    if run.writer.has_earlier_records():
        step = restored.step if restored is not None else 0
        marker = {"step": step, "event": "resume" if restored is not None else "restart"}
        if restored is not None:
            marker["tier"] = restored.tier
            marker["checkpoint"] = restored.path
        run.writer.write(marker)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _checkpointer(cfg: Config, log) -> Checkpointer | None:
    """The run's checkpointer: when it saves (`checkpoint.every`) or may resume from one."""
    c, ckpt_dir = cfg.checkpoint, storage.as_path(cfg.checkpoint_dir)
    if c.every > 0 or (c.resume and ckpt_dir.is_dir()):
        return Checkpointer(
            ckpt_dir,
            keep=c.keep,
            keep_every=c.keep_every,
            async_save=c.async_save,
            log=log,
            on_unreadable=c.on_unreadable,
            retry_delays=retry_delays(c.read_retries),
        )
    return None


class _StepTimer:
    """Wall time per step between two logging points (the loop syncs with the device only there)."""

    def __init__(self, step: int):
        self.reset(step)

    def reset(self, step: int) -> None:
        self.time, self.step = time.perf_counter(), step

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.time) / (step - self.step)
        self.time, self.step = now, step
        return per_step


def _process_pending(pending: list[tuple[int, int, dict]], monitor: FaultMonitor) -> tuple[str | None, dict]:
    """The loop's host sync: fetch the metrics of every step since the last sync in one
    transfer and feed them to the fault monitor, oldest first, up to the first action.
    Returns (the action, "rollback" / "stop" / None; the newest step's metrics) and
    empties `pending`."""
    fetched = jax.device_get([m for _, _, m in pending])
    action = None
    for (step, batch_index, _), m in zip(pending, fetched):
        action = monitor.observe(step, batch_index, float(m["loss"]), bool(m["skipped"]), int(m["fault"]))
        if action:
            break
    pending.clear()
    return action, fetched[-1]


def _metrics_record(
    run: _Run, step: int, m: dict, step_time: float, blocked: float | None, local_blocked: float | None = None
) -> dict:
    """One line of metrics.jsonl: the step's metrics (host values), throughput and MFU."""
    rates, monitor = run.rates, run.monitor
    record = {
        "step": step,
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "lr": float(m["lr"]),
        "skipped": int(m["skipped"]),
        "skipped_total": monitor.skipped_total,
        "step_time_s": step_time,
        "tokens_per_second": rates.tokens_per_step / step_time,
        "mfu": rates.flops_per_step / step_time / rates.peak_total,
        "mfu_peak_flops": rates.peak_total,  # the mesh's, in the compute dtype
        "mfu_peak_source": rates.peak_source,
    }
    peak = _peak_memory_bytes()
    if peak is not None:
        record["peak_memory_bytes"] = peak
    if run.cfg.faults.spike_factor is not None:
        record["spikes_total"] = monitor.spikes_total
    pp = pipeline_schedule(run.cfg)
    if pp is not None:
        record["pipeline_bubble"] = pp.bubble
    # Extra scalar metrics of the step (MoE router losses and load; DPO's rewards and accuracy;
    # GRPO's; the multi-token prediction loss; QK-clip's attention/max_logit).
    record.update(
        {k: float(v) for k, v in m.items() if k.startswith(("moe_", "dpo/", "grpo/", "mtp_", "attention/"))}
    )
    if isinstance(run.feeder, RolloutFeeder):  # the rollout's rewards, lengths and sampling speed
        record.update(run.feeder.metrics_for(step))
    if "loss_scale" in m:  # float16: the scale the step ran at; overflow skips, apart from `skipped`
        record["loss_scale"] = float(m["loss_scale"])
        record["loss_scale_skipped"] = int(m["loss_scale_skipped"])
        record["loss_scale_overflows"] = int(m["loss_scale_overflows"])
    if blocked is not None:
        record["checkpoint_blocked_s"] = blocked
    if local_blocked is not None:
        record["local_checkpoint_blocked_s"] = local_blocked
    return record


def _peak_memory_bytes() -> int | None:
    """The most memory this process's first device has held so far (its allocator's peak:
    GPU and TPU; None where the backend keeps no statistics, as on CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None


def _report_stragglers(run: _Run, step: int) -> None:
    """Every process gathers the window's times (a collective); process 0 records them."""
    record, warning = run.stragglers.report(step)
    if jax.process_index() == 0:
        run.writer.write(record)
        if warning:
            run.writer.log("WARNING " + warning)


def _report_goodput(run: _Run) -> None:
    """goodput.json, its line and its TensorBoard scalars (and W&B summary), at the end of an
    attempt that got as far as writing to output_dir."""
    doc = run.goodput_file.write(run.clock, durable=True)
    if doc is None:
        return
    run.writer.log(goodput.describe(doc))
    step = run.clock.last_logged[0] if run.clock.last_logged else run.clock.first_step
    run.writer.scalars("goodput", {"ratio": doc["goodput"], **doc["seconds"]}, step)


def _log_preemption(run: _Run, result: TrainResult, step: int) -> None:
    if run.checkpointer is not None and run.cfg.checkpoint.every > 0:
        where = f"saved checkpoint step {result.checkpoint_step} in {run.checkpointer.directory}"
    elif run.local is not None:
        where = f"saved local checkpoint step {result.checkpoint_step} in {run.local.directory}"
    else:
        where = "no checkpoint written (checkpoint.every=0)"
    run.writer.log(
        f"preempted by {result.preempted_by} after step {step}: {where}; run the same command again to resume"
    )


def _resume(run: _Run):
    """Restore the newest readable checkpoint into (state, data position, monitor); None if none.
    recovery/tiers.py picks the step and the tier every process restores."""
    cfg, checkpointer = run.cfg, run.checkpointer
    if checkpointer is None and run.local is None:
        return None
    if not cfg.checkpoint.resume and checkpointer is not None:
        if existing := checkpointer.steps():
            raise CheckpointError(
                f"checkpoint.resume=false but {checkpointer.directory} already holds checkpoints "
                f"{existing}; a fresh run would mix with them. Use another checkpoint.dir / "
                "output_dir, or remove them"
            )
    restored = tiers.restore(
        checkpointer,
        run.local,
        run.target,
        dict(run.mesh.shape),
        resume=cfg.checkpoint.resume,
        log=run.writer.log,
    )
    if restored is None:
        return None
    run.feeder.seek(restored.data_state)
    run.monitor.load_state_dict(restored.meta.get("faults", {}))
    run.writer.log(
        f"resumed from checkpoint {restored.path} "
        f"(step {restored.step}, next batch {restored.data_state.get('batch')})"
    )
    changes = _config_changes(restored.meta.get("config", {}), to_dict(cfg))
    if changes:
        run.writer.log("config changed since that checkpoint: " + "; ".join(changes))
    return restored


def _with_base(run: _Run, restored) -> TrainState:
    """The restored state, with model.lora's frozen base read again from train.init_from
    (checkpoints hold only the adapters), refused if it is not the base the checkpoint was
    trained on (its fingerprint in the checkpoint's meta)."""
    cfg = run.cfg
    if cfg.model.lora is None:
        return restored.state
    if cfg.train.init_from:
        frozen = load_base(cfg, run.target, run.writer.log)
    else:  # the seed's random base, made again
        frozen = run.program.init().frozen
    saved, have = restored.meta.get("lora_base"), fingerprint(frozen)
    if saved != have:
        raise CheckpointMismatchError(
            f"checkpoint {restored.path}: its LoRA adapters were "
            f"trained on a base with fingerprint {saved}, but train.init_from={cfg.train.init_from!r} "
            f"has {have}; expected the same base weights (or train into a new output_dir)"
        )
    return restored.state._replace(frozen=frozen)


def _rollback(run: _Run, step: int):
    """Restore the newest checkpoint before the fault streak; continue past its batches.
    Returns (state, step, (device batch, batch index))."""
    cfg, checkpointer, monitor, writer = run.cfg, run.checkpointer, run.monitor, run.writer
    streak = monitor.streak
    restored = None
    if checkpointer is not None:
        checkpointer.wait()
        restored = checkpointer.restore_latest(run.target, before=streak.first_step)
    if restored is None:
        raise monitor.stop_error(
            f"no checkpoint from before step {streak.first_step} to roll back to"
            + ("" if cfg.checkpoint.every else "; checkpoint.every=0")
        )
    discarded = checkpointer.discard_after(restored.step)
    if run.local is not None:  # the abandoned timeline's local steps too
        discarded += run.local.discard_after(restored.step)
    run.clock.rolled_back(restored.step)
    resume_batch = streak.last_batch + 1
    writer.log(
        f"rollback after {monitor.describe_streak()}: restored checkpoint step {restored.step}, "
        f"continuing with batch {resume_batch} (batches {restored.data_state.get('batch')}.."
        f"{streak.last_batch} skipped)" + (f"; discarded newer checkpoints {discarded}" if discarded else "")
    )
    writer.write(
        {
            "step": step,
            "event": "rollback",
            "to_step": restored.step,
            "resume_batch": resume_batch,
            "streak_first_step": streak.first_step,
            "streak_last_step": streak.last_step,
        }
    )
    monitor.after_rollback(restored.meta.get("faults"))
    run.feeder.seek(dict(restored.data_state, batch=resume_batch))
    return restored.state, restored.step, _next_batch(run, restored.state)
