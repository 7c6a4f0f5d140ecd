"""Which step a restart restores, from which tier, agreed by every process.

Every process reports the local steps it holds (one small all-gather of a fixed-size int
array). The candidates are the steps every process holds, newer than the persistent tier's
newest; they are tried newest first, every process reading its own shards and all agreeing on
the outcome (a second all-gather of verdicts):

- all read it: restored from the local tier;
- a process's bytes prove it unreadable (read_errors.py): that process sets its copy aside as
  `{step}.unreadable`, a warning line says so, and the next candidate is tried;
- a process's local tier was written by another model, mesh or sharding: the run stops with
  CheckpointMismatchError (exit 2), one line;
- out of memory: CheckpointUnavailableError, as for the persistent tier.

With no candidate left, the persistent tier's newest readable checkpoint is restored
(Checkpointer.restore_latest, unchanged). So a process whose local tier is missing or
unreadable (a replaced host) never makes the others restore a step it cannot get. The choice
is one log line. Local steps newer than the restored one belong to an abandoned attempt and
are deleted, so that the rerun rewrites them.

A process's shards are only ever on its own host: where the mesh replicates the state across
slices (`mesh.dcn_data`), another slice's copy is not sent to a process that lacks its own;
that process's loss falls back to the persistent tier (docs/checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.recovery import read_errors
from jaxtrain.recovery.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnavailableError,
    Restored,
)
from jaxtrain.recovery.local import LocalCheckpointer
from jaxtrain.trainer.step import TrainState

MAX_HELD = 32  # local steps each process reports (newest first): the all-gather's fixed width
MISMATCH = 9  # a verdict above read_errors' own: the local tier does not fit the run


def _gather(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (int32), stacked: shape (process_count, len(row))."""
    row = np.asarray(row, np.int32)
    if jax.process_count() == 1:
        return row[None]
    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def held_by_every_process(steps: list[int]) -> tuple[list[int], list[list[int]]]:
    """(the steps every process holds, newest first; each process's own, newest first)."""
    row = np.full(MAX_HELD, -1, np.int32)
    newest = sorted(steps, reverse=True)[:MAX_HELD]
    row[: len(newest)] = newest
    per_process = [[int(s) for s in r if s >= 0] for r in _gather(row)]
    common = set(per_process[0]).intersection(*per_process[1:])
    return sorted(common, reverse=True), per_process


def _describe_held(per_process: list[list[int]]) -> str:
    if len(per_process) == 1:
        return f"this process holds {per_process[0] or 'none'}"
    none = [p for p, steps in enumerate(per_process) if not steps]
    held = "; ".join(f"process {p}: {steps or 'none'}" for p, steps in enumerate(per_process))
    return held + (
        f" (process{'es' * (len(none) > 1)} {', '.join(map(str, none))} hold none)" if none else ""
    )


def restore(
    persistent: Checkpointer | None,
    local: LocalCheckpointer | None,
    target: TrainState,
    mesh_shape: dict,
    *,
    resume: bool = True,
    log: Callable[[str], None] = print,
) -> Restored | None:
    """The agreed step from the agreed tier (module docstring); None for a fresh start.
    Every process must call it. `resume`: False refuses local steps as the persistent tier
    refuses checkpoints (a fresh run would mix with them)."""
    persistent_steps = persistent.steps() if persistent is not None and resume else []
    newest_persistent = persistent_steps[-1] if persistent_steps else None
    restored = None
    if local is not None:
        common, per_process = held_by_every_process(local.steps())
        if not resume and any(per_process):
            raise CheckpointError(
                f"checkpoint.resume=false but checkpoint.local_dir={local.local_dir!r} holds local "
                f"steps ({_describe_held(per_process)}); a fresh run would mix with them. Use another "
                "checkpoint.local_dir, or remove them"
            )
        candidates = [s for s in common if newest_persistent is None or s > newest_persistent]
        for step in candidates:
            restored = _try_local(local, step, target, mesh_shape, log)
            if restored is not None:
                break
        if resume and (restored is not None or newest_persistent is not None or any(per_process)):
            log(_choice(local, restored, persistent, newest_persistent, per_process))
    if restored is None and persistent is not None and resume:
        restored = persistent.restore_latest(target)
    if local is not None:
        local.discard_after(restored.step if restored is not None else 0)
    return restored


def _choice(local, restored, persistent, newest_persistent, per_process) -> str:
    """The one line that says which step and tier every process restores, and why."""
    if persistent is None:
        newest = "none (checkpoint.every=0)"
    else:
        step = "none" if newest_persistent is None else f"step {newest_persistent}"
        newest = f"{step} ({persistent.directory})"
    if restored is not None:
        return (
            f"restore: step {restored.step} from the local tier {local.local_dir}/process_*, the newest "
            f"step every process holds; the persistent tier's newest: {newest}"
        )
    why = f"no readable local step newer than it is held by every process ({_describe_held(per_process)})"
    if newest_persistent is None:
        return f"restore: nothing from either tier: starting from step 0; {why}"
    return (
        f"restore: step {newest_persistent} (or the newest readable before it) from the persistent "
        f"tier {persistent.directory}; {why}"
    )


def _try_local(
    local: LocalCheckpointer, step: int, target: TrainState, mesh_shape: dict, log: Callable[[str], None]
) -> Restored | None:
    """Local step `step` on every process, or None on every process (one set it aside)."""
    verdict, problem, restored = read_errors.OK, None, None
    try:
        problem = local.mismatch(step, target, mesh_shape)
        if problem is not None:
            verdict = MISMATCH
        else:
            restored = local.read(step, target)
    except Exception as e:  # noqa: BLE001 - classified: proof of damage, memory, or a read that proves nothing
        verdict, problem = read_errors.verdict(e), read_errors.summary(e)
    verdicts = _gather(np.asarray([verdict]))[:, 0]
    worst = int(verdicts.max())
    if worst == read_errors.OK:
        return restored
    if worst == MISMATCH:
        first = int(np.argmax(verdicts == MISMATCH))
        why = problem if verdict == MISMATCH else f"process {first}'s does not fit the run"
        raise CheckpointMismatchError(
            f"local checkpoint {local.path(step)}: {why}. The config changed since the local tier was "
            f"written; restore the old settings, or remove checkpoint.local_dir={local.local_dir!r} on "
            "every host (the persistent tier in checkpoint.dir restores onto any mesh). Nothing was touched"
        )
    if worst == read_errors.OUT_OF_MEMORY:
        raise CheckpointUnavailableError(
            f"out of memory restoring local checkpoint step {step} ({problem or 'on another process'}); "
            "nothing was moved or deleted. Free memory and run again"
        )
    bad = [int(p) for p in np.flatnonzero(verdicts != read_errors.OK)]
    if verdict == read_errors.UNREADABLE:
        moved = local.set_aside(step)
        log(
            f"warning: local checkpoint {local.path(step)} is unreadable ({problem}); "
            f"moved it to {moved.name}"
        )
    elif verdict != read_errors.OK:
        log(f"warning: could not read local checkpoint {local.path(step)} ({problem})")
    if jax.process_index() == 0:
        log(f"local step {step} is not readable on process(es) {bad}: trying the next candidate")
    return None
