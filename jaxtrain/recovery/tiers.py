"""Which step a restart restores, from which tier, agreed by every process.

Every process reports the local steps it holds (one small all-gather of a fixed-size int
array). The candidates are the local steps newer than the persistent tier's newest that are
held whole across the processes: every process holds its own shards, or (where the state is
replicated along mesh axis `data`, as across slices with `mesh.dcn_data`) every process of
one replica holds them. They are tried newest first, the holders reading their own shards and
all agreeing on the outcome (a second all-gather of verdicts):

- all holders read it: restored from the local tier; with a replica, one jitted program
  copies the source replica's arrays to every device (an exact copy, through the collectives
  XLA picks), and the data position and meta are sent from the first holder;
- a process's bytes prove it unreadable (read_errors.py): that process sets its copy aside as
  `{step}.unreadable`, a warning line says so, and the next candidate is tried;
- a process's local tier was written by another model, mesh or sharding: the run stops with
  CheckpointMismatchError (exit 2), one line;
- out of memory: CheckpointUnavailableError, as for the persistent tier.

With no candidate left, the persistent tier's newest readable checkpoint is restored
(Checkpointer.restore_latest, unchanged). So a process whose local tier is missing or
unreadable (a replaced host) never makes the others restore a step it cannot get: its shards
come from a replica, or every process falls back. The choice is one log line. Local steps
newer than the restored one belong to an abandoned attempt and are deleted, so that the rerun
rewrites them.
"""

from __future__ import annotations

import json
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
REPLICA_AXIS = "data"  # the mesh axis across which the state is replicated (mesh.dcn_data: slices)


def _gather(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (int32), stacked: shape (process_count, len(row))."""
    row = np.asarray(row, np.int32)
    if jax.process_count() == 1:
        return row[None]
    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def held_per_process(steps: list[int]) -> list[list[int]]:
    """Each process's local steps, newest first (at most MAX_HELD each), on every process."""
    row = np.full(MAX_HELD, -1, np.int32)
    newest = sorted(steps, reverse=True)[:MAX_HELD]
    row[: len(newest)] = newest
    return [[int(s) for s in r if s >= 0] for r in _gather(row)]


def _candidates(
    per_process: list[list[int]], target: TrainState, newest_persistent: int | None
) -> list[tuple[int, set[int], int | None]]:
    """(step, the processes holding it, the replica index it is sent from or None), newest
    first: the local steps newer than the persistent tier's newest that every process holds,
    or that the processes of one whole replica along mesh axis `data` hold, when the state is
    replicated along it (module docstring)."""
    newer = {s for steps in per_process for s in steps if newest_persistent is None or s > newest_persistent}
    everyone = set(range(len(per_process)))
    found = []
    for step in sorted(newer, reverse=True):
        holders = {p for p, steps in enumerate(per_process) if step in steps}
        if holders == everyone:
            found.append((step, holders, None))
        elif (source := replica_source(target, holders)) is not None:
            found.append((step, holders, source))
    return found


def _names_axis(spec, axis: str) -> bool:
    return any(axis in (p if isinstance(p, tuple) else (p,)) for p in spec if p is not None)


def replica_source(target: TrainState, holders: set[int], axis: str = REPLICA_AXIS) -> int | None:
    """The index along mesh axis `axis` of a replica whose devices all belong to `holders`,
    when every state array is replicated along `axis` (its sharding never names it); None
    otherwise (no such axis of size > 1, an array sharded along it, no whole replica held)."""
    leaves = jax.tree.leaves(target._replace(frozen=None))
    if not leaves or not holders:
        return None
    mesh = leaves[0].sharding.mesh
    if axis not in mesh.axis_names or mesh.shape[axis] < 2:
        return None
    if any(leaf.sharding.mesh != mesh or _names_axis(leaf.sharding.spec, axis) for leaf in leaves):
        return None
    by_replica = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    for r in range(by_replica.shape[0]):
        if all(d.process_index in holders for d in by_replica[r].flat):
            return r
    return None


def _send_replica(restored: Restored | None, target: TrainState, source: int, axis: str = REPLICA_AXIS):
    """Every process's state, copied from replica `source` along `axis`: the processes that
    read the step contribute their arrays, the others zeros, and one jitted program selects
    the source replica's values for every device (exact: a copy, no arithmetic)."""
    target = target._replace(frozen=None)
    leaves = jax.tree.leaves(target)
    mesh = leaves[0].sharding.mesh
    have = jax.tree.leaves(restored.state._replace(frozen=None)) if restored is not None else None
    stacked = []
    for i, want in enumerate(leaves):
        spec = jax.sharding.PartitionSpec(axis, *want.sharding.spec)
        sharding = jax.sharding.NamedSharding(mesh, spec, memory_kind=want.sharding.memory_kind)
        blocks = []
        index_map = want.sharding.addressable_devices_indices_map(want.shape)
        by_device = {s.device: s.data for s in have[i].addressable_shards} if have is not None else {}
        for device, index in index_map.items():
            if device in by_device:
                block = np.asarray(by_device[device])
            else:
                shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, want.shape))
                block = np.zeros(shape, want.dtype)
            place = jax.sharding.SingleDeviceSharding(device, memory_kind=want.sharding.memory_kind)
            blocks.append(jax.device_put(block[None], place))
        shape = (mesh.shape[axis], *want.shape)
        stacked.append(jax.make_array_from_single_device_arrays(shape, sharding, blocks))
    pick = jax.jit(lambda xs: [x[source] for x in xs], out_shardings=[leaf.sharding for leaf in leaves])
    return jax.tree.unflatten(jax.tree.structure(target), pick(stacked))


def _broadcast_json(doc: dict | None, source_process: int) -> dict:
    """`doc` as process `source_process` has it, on every process (two small all-gathers)."""
    raw = np.frombuffer(json.dumps(doc).encode(), np.uint8) if doc is not None else np.zeros(0, np.uint8)
    lengths = _gather(np.asarray([raw.size]))[:, 0]
    padded = np.zeros(int(lengths.max()), np.int32)
    padded[: raw.size] = raw
    rows = _gather(padded)
    return json.loads(bytes(rows[source_process, : lengths[source_process]].astype(np.uint8)))


def _describe_held(per_process: list[list[int]]) -> str:
    if len(per_process) == 1:
        return f"this process holds {per_process[0] or 'none'}"
    none = [p for p, steps in enumerate(per_process) if not steps]
    held = "; ".join(f"process {p}: {steps or 'none'}" for p, steps in enumerate(per_process))
    if not none:
        return held
    who = f"processes {', '.join(map(str, none))} hold" if len(none) > 1 else f"process {none[0]} holds"
    return f"{held} ({who} none)"


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
    restored = None
    if local is not None:
        persistent_steps = persistent.steps() if persistent is not None and resume else []
        newest_persistent = persistent_steps[-1] if persistent_steps else None
        per_process = held_per_process(local.steps())
        if not resume and any(per_process):
            raise CheckpointError(
                f"checkpoint.resume=false but checkpoint.local_dir={local.local_dir!r} holds local "
                f"steps ({_describe_held(per_process)}); a fresh run would mix with them. Use another "
                "checkpoint.local_dir, or remove them"
            )
        candidates = _candidates(per_process, target, newest_persistent)
        for step, holders, source in candidates:
            restored = _try_local(local, step, target, mesh_shape, log, holders, source)
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
            f"step held whole across the processes; the persistent tier's newest: {newest}"
        )
    why = f"no readable local step newer than it is held by every process ({_describe_held(per_process)})"
    if newest_persistent is None:
        return f"restore: nothing from either tier: starting from step 0; {why}"
    return (
        f"restore: step {newest_persistent} (or the newest readable before it) from the persistent "
        f"tier {persistent.directory}; {why}"
    )


def _try_local(
    local: LocalCheckpointer,
    step: int,
    target: TrainState,
    mesh_shape: dict,
    log: Callable[[str], None],
    holders: set[int],
    source: int | None,
) -> Restored | None:
    """Local step `step` on every process, or None on every process (one set it aside). The
    `holders` read their own; with a `source` replica, it is sent to the others."""
    verdict, problem, restored = read_errors.OK, None, None
    if jax.process_index() in holders:
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
    if worst == read_errors.OK and source is not None:
        first = min(holders)
        header = {"data": restored.data_state, "meta": restored.meta} if restored is not None else None
        header = _broadcast_json(header, first)
        state = _send_replica(restored, target, source)
        sent_to = sorted(set(range(jax.process_count())) - holders)
        path = str(local.path(step)) if restored is not None else f"{local.local_dir}/process_{first}/{step}"
        log(f"local step {step}: replica {source} along mesh axis {REPLICA_AXIS} sent to process {sent_to}")
        return Restored(step, state, dict(header["data"]), dict(header["meta"]), tier="local", path=path)
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
