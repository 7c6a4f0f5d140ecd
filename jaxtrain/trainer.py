"""The training loop: mesh -> sharded state (fresh or resumed) -> steps -> metrics + checkpoints.

The loop waits on the device only at logging steps (`logging.every`), checkpoint
steps and preemption: there it fetches the metrics of every step since the last
fetch in one transfer, feeds them to the fault monitor, and writes a record for
the logging step. Step time is the wall time between two logging points divided
by the steps in between.

Fault tolerance (details in checkpoint.py, faults.py, distributed.py):
- resume: the newest complete checkpoint in `checkpoint.dir` is restored (state,
  data position, fault-monitor state), so the losses continue exactly as in an
  uninterrupted run;
- preemption: SIGTERM/SIGINT (or, multi-process, JAX's preemption sync point)
  finish the current step, save a checkpoint, wait for it and return;
- numerical faults: skipped updates / loss spikes are counted, and a streak of
  them rolls back to the last checkpoint (past the bad batches) or stops.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxtrain import sharding
from jaxtrain.checkpoint import Checkpointer, CheckpointError, abstract_state
from jaxtrain.config import Config, to_dict
from jaxtrain.data import make_data_iterator
from jaxtrain.faults import FaultMonitor
from jaxtrain.flops import flops_per_token, peak_flops_per_device
from jaxtrain.metrics import MetricsWriter
from jaxtrain.sharding.context import permute_batch
from jaxtrain.train_step import TrainProgram, TrainState, batch_to_device, build_program

# Config sections whose change does not affect the numbers of a resumed run.
_RESUME_NEUTRAL = ("output_dir", "checkpoint.", "logging.", "distributed.")


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


def make_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """The run's mesh: per-slice (ICI) degrees times `mesh.dcn_*` across slices / hosts."""
    dcn = {a: n for a, n in cfg.mesh.dcn_sizes().items() if n > 1}
    return sharding.make_mesh(cfg.mesh.sizes(), devices, dcn_axis_sizes=dcn or None)


def initial_state(cfg: Config, program: TrainProgram, target: TrainState, log) -> TrainState:
    """A fresh state: random init, or `train.init_from`'s converted weights (read straight
    into the run's shardings; the optimizer state starts empty either way)."""
    state = program.init()
    if cfg.train.init_from:
        from jaxtrain.convert import load_params

        log(f"initialising parameters from {cfg.train.init_from}")
        state = state._replace(params=load_params(cfg.train.init_from, cfg.model, target.params))
    return state


class _ProcessLog:
    """Non-primary processes of a multi-process run: log lines only (process 0 writes metrics)."""

    def __init__(self):
        self.prefix = f"[process {jax.process_index()}] "

    def write(self, record: dict) -> None:
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
        from jax._src import distributed as jax_distributed

        self.synced = jax_distributed.global_state.preemption_sync_manager is not None
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum, frame):
        if self.synced:  # hand it to JAX's SIGTERM notifier, which tells every process
            import os

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
            from jax.experimental import multihost_utils

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
    mesh = make_mesh(cfg, devices)
    rules = sharding.PRESETS[cfg.mesh.rules]
    primary = jax.process_index() == 0
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if primary:
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.train.seq_len) * tokens_per_step
    peak, peak_source = peak_flops_per_device(mesh.devices.flat[0], cfg.logging.peak_flops_per_device)
    # Simulated CPU devices share one host: the measured matmul peak is the whole host's.
    peak_total = peak if (peak_source == "measured matmul") else peak * mesh.size
    total = cfg.train.steps
    ckpt_cfg = cfg.checkpoint

    data = make_data_iterator(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    poison = frozenset(cfg.faults.testing_poison_batches)

    def next_batch():
        """(device batch, its global batch index)."""
        index = data.get_state()["batch"]
        rows = next(data)
        if index in poison:  # TESTING HOOK: faults.testing_poison_batches
            rows = dict(rows, loss_mask=np.full_like(rows["loss_mask"], np.inf))
        # Context parallelism: zig-zag sequence order (load-balanced causal ring).
        rows = permute_batch(rows, mesh.shape["context"])
        return batch_to_device(rows, program.batch_sharding), index

    history: list[dict] = []
    writer_cm = (
        MetricsWriter(
            out, total_steps=total, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress
        )
        if primary
        else _ProcessLog()
    )
    with jax.set_mesh(mesh), sharding.axis_rules(rules), writer_cm as writer:
        program = build_program(cfg, mesh, rules)
        writer.log(
            f"mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1) or 'single device'} "
            f"rules={cfg.mesh.rules} params={cfg.model.param_count():,} "
            f"peak={peak_total:.3g} FLOP/s ({peak_source})"
        )
        if jax.process_count() > 1:
            from jaxtrain.distributed import describe_topology

            writer.log(describe_topology())

        ckpt_dir = Path(cfg.checkpoint_dir)
        checkpointer = None
        if ckpt_cfg.every > 0 or (ckpt_cfg.resume and ckpt_dir.is_dir()):
            checkpointer = Checkpointer(
                ckpt_dir,
                keep=ckpt_cfg.keep,
                keep_every=ckpt_cfg.keep_every,
                async_save=ckpt_cfg.async_save,
                log=writer.log,
            )
        try:
            target = abstract_state(program)
            monitor = FaultMonitor(cfg.faults)
            restored = _resume(cfg, checkpointer, target, data, monitor, writer)
            state = (
                restored.state if restored is not None else initial_state(cfg, program, target, writer.log)
            )
            start = step = int(jax.device_get(state.step))
            result = TrainResult(
                metrics=history,
                state=state,
                program=program,
                mesh=mesh,
                start_step=start,
                final_step=start,
                checkpoint_step=restored.step if restored else None,
            )
            if start >= total:
                writer.log(f"nothing to do: the checkpoint is at step {start} >= train.steps={total}")
                return result

            batch, batch_index = next_batch()
            t0 = time.perf_counter()
            step_fn = program.step.lower(state, batch).compile()
            writer.log(f"compiled train step in {time.perf_counter() - t0:.1f} s")

            def save(step, state, data_state) -> float | None:
                meta = {
                    "config": to_dict(cfg),
                    "faults": monitor.state_dict(),
                    "seed": cfg.seed,
                    "process_count": jax.process_count(),
                    "mesh": dict(mesh.shape),
                }
                blocked = checkpointer.save(step, state, data_state, meta)
                if blocked is not None:
                    result.checkpoint_step = step
                    writer.log(
                        f"checkpoint step {step}: loop blocked {blocked * 1e3:.0f} ms, "
                        f"writing {'in the background' if ckpt_cfg.async_save else 'done'}"
                    )
                return blocked

            pending: list[tuple[int, int, dict]] = []  # (step, batch index, device metrics)
            last_time, last_step = time.perf_counter(), step
            with _Preemption() as preemption:
                while step < total:
                    state, metrics = step_fn(state, batch)
                    step += 1
                    pending.append((step, batch_index, metrics))
                    data_state = data.get_state()  # position of the next batch to train on
                    if step < total:
                        batch, batch_index = next_batch()  # overlaps the step
                    stop = preemption.requested(step)  # sync ids = step numbers, as Orbax uses
                    save_due = (
                        checkpointer is not None
                        and ckpt_cfg.every > 0
                        and (step % ckpt_cfg.every == 0 or step == total or stop)
                    )
                    log_due = step % cfg.logging.every == 0 or step == total
                    if not (log_due or save_due or stop):
                        continue
                    fetched = jax.device_get([m for _, _, m in pending])  # the loop's host sync
                    action = None
                    for (s, b, _), m in zip(pending, fetched):
                        action = (
                            monitor.observe(s, b, float(m["loss"]), bool(m["skipped"]), int(m["fault"]))
                            or action
                        )
                        if action:
                            break
                    pending.clear()
                    if action == "rollback":
                        state, step, batch, batch_index = _rollback(
                            cfg, checkpointer, monitor, target, data, writer, step, next_batch
                        )
                        last_time, last_step = time.perf_counter(), step
                        continue
                    if action == "stop":
                        raise monitor.stop_error()
                    blocked = save(step, state, data_state) if save_due else None
                    if log_due:
                        m = fetched[-1]
                        now = time.perf_counter()
                        step_time = (now - last_time) / (step - last_step)
                        last_time, last_step = now, step
                        record = {
                            "step": step,
                            "loss": float(m["loss"]),
                            "grad_norm": float(m["grad_norm"]),
                            "lr": float(m["lr"]),
                            "skipped": int(m["skipped"]),
                            "skipped_total": monitor.skipped_total,
                            "step_time_s": step_time,
                            "tokens_per_second": tokens_per_step / step_time,
                            "mfu": flops_per_step / step_time / peak_total,
                        }
                        if cfg.faults.spike_factor is not None:
                            record["spikes_total"] = monitor.spikes_total
                        # Extra scalar metrics of the step (MoE router losses and load).
                        record.update({k: float(v) for k, v in m.items() if k.startswith("moe_")})
                        if blocked is not None:
                            record["checkpoint_blocked_s"] = blocked
                        writer.write(record)
                        history.append(record)
                    if stop:
                        result.preempted_by = preemption.signal_name
                        break
                if checkpointer is not None:
                    checkpointer.wait()  # the last write is on disk before we say so
            if result.preempted_by:
                where = (
                    f"saved checkpoint step {result.checkpoint_step} in {checkpointer.directory}"
                    if checkpointer is not None and ckpt_cfg.every > 0
                    else "no checkpoint written (checkpoint.every=0)"
                )
                writer.log(
                    f"preempted by {result.preempted_by} after step {step}: {where}; "
                    "run the same command again to resume"
                )
        finally:
            if checkpointer is not None:
                checkpointer.close()  # waits for a write still in flight
    result.state, result.final_step = state, step
    return result


def _resume(cfg, checkpointer, target, data, monitor, writer):
    """Restore the newest readable checkpoint into (state, data position, monitor); None if none."""
    if checkpointer is None:
        return None
    if not cfg.checkpoint.resume:
        if existing := checkpointer.steps():
            raise CheckpointError(
                f"checkpoint.resume=false but {checkpointer.directory} already holds checkpoints "
                f"{existing}; a fresh run would mix with them. Use another checkpoint.dir / "
                "output_dir, or remove them"
            )
        return None
    restored = checkpointer.restore_latest(target)
    if restored is None:
        return None
    data.set_state(restored.data_state)
    monitor.load_state_dict(restored.meta.get("faults", {}))
    writer.log(
        f"resumed from checkpoint {checkpointer.directory / str(restored.step)} "
        f"(step {restored.step}, next batch {restored.data_state.get('batch')})"
    )
    changes = _config_changes(restored.meta.get("config", {}), to_dict(cfg))
    if changes:
        writer.log("config changed since that checkpoint: " + "; ".join(changes))
    return restored


def _rollback(cfg, checkpointer, monitor, target, data, writer, step, next_batch):
    """Restore the newest checkpoint before the fault streak; continue past its batches."""
    streak = monitor.streak
    restored = None
    if checkpointer is not None:
        checkpointer.wait()
        restored = checkpointer.restore_latest(target, before=streak.first_step)
    if restored is None:
        raise monitor.stop_error(
            f"no checkpoint from before step {streak.first_step} to roll back to"
            + ("" if cfg.checkpoint.every else "; checkpoint.every=0")
        )
    discarded = checkpointer.discard_after(restored.step)
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
    data.set_state(dict(restored.data_state, batch=resume_batch))
    batch, batch_index = next_batch()
    return restored.state, restored.step, batch, batch_index
