"""Checkpoints: an Orbax CheckpointManager that saves asynchronously and restores onto any mesh.

One checkpoint is a step directory `{dir}/{step}` with three items:
  state  the TrainState (step, params, optimizer state, loss window; the loss scale with
         float16 compute, the fp8 amax histories and scales with model.fp8) as sharded
         arrays (OCDBT/zarr)
  data   the data iterator's position (`DataIterator.get_state()`: a batch index)
  meta   the resolved config, the fault monitor's state and the seed (model.lora: the
         frozen base's `fingerprint`, under "lora_base")

With model.lora the state's `params` are the adapters and its `frozen` base is never saved:
a resumed run reads the base from train.init_from again and refuses one whose fingerprint
differs from the checkpoint's.

The model has no random state of its own (no dropout); the data order is a pure
function of (seed, batch index), so `data` and `seed` are the whole RNG state.

Atomicity is Orbax's: a save is written to `{step}.orbax-checkpoint-tmp*` and
renamed when complete, so a killed run leaves at most a tmp directory, which
`steps()` never lists. On object stores (`gs://`), which cannot rename a directory,
Orbax writes `{step}` in place and marks it complete with `commit_success.txt` last;
`steps()` lists only marked steps there.

A failed restore costs a checkpoint only on proof (recovery/read_errors.py): metadata that does
not parse, a file missing, an array file truncated or undecodable, seen on two reads. Then,
with `checkpoint.on_unreadable: stop` (the default) the run stops naming it, with nothing
moved; with `skip` it is renamed to `{step}.unreadable` (kept for inspection, out of Orbax's
way) and the previous one is tried, so a bad checkpoint is never crash-looped on. Any other
failure (storage unavailable, credentials, out of memory) says nothing about the checkpoint:
the read is retried with backoff, then the run stops with `CheckpointUnavailableError`,
moving or deleting nothing. A run never starts again from step 0 while checkpoints exist
unless `skip` set every one of them aside (and a line says so). A checkpoint whose parameter
shapes differ from the model's is a `CheckpointMismatchError` and is not touched.

Saving blocks the loop only for the device-to-host copy. Orbax's replica-parallel
writing (replicated arrays split so that each replica writes a slice) is
turned off in a single process, where there is only one writer, and kept in
multi-process runs only for slices of at least 16 MiB: every slice shape
costs an XLA compile on the first save, which otherwise blocked the first save
for about 0.6 s (16.9% of a bench-peer step) for nothing.

Restoring reads each array straight into the target sharding (Orbax
`PyTreeRestore` with ShapeDtypeStructs carrying NamedShardings), so a
checkpoint written on one mesh restores onto another, with a different
device count or process count (Universal-Checkpointing style resharding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from jaxtrain.data import storage
from jaxtrain.recovery import read_errors
from jaxtrain.trainer.program import TrainProgram, state_shapes
from jaxtrain.trainer.step import TrainState


def checkpoint_path(directory: str | os.PathLike) -> epath.Path:
    """A checkpoint location as Orbax takes it: a local path made absolute, or a URL
    (`gs://bucket/run/checkpoints`, any `etils.epath` scheme) as given."""
    if storage.is_local(directory):
        return epath.Path(os.path.abspath(storage.as_path(directory)))
    return storage.as_path(directory)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory and the reason."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's parameters do not fit the configured model (the checkpoint is left as is)."""


class CheckpointUnreadableError(CheckpointError):
    """The checkpoint's bytes prove it unreadable and checkpoint.on_unreadable is `stop`
    (nothing was moved)."""


class CheckpointUnavailableError(CheckpointError):
    """The checkpoints could not be read for a reason outside them (storage, credentials,
    memory), after retries; nothing was moved or deleted. Running again once it is fixed
    resumes where the run was."""


ON_UNREADABLE = ("stop", "skip")


def retry_delays(retries: int) -> tuple[float, ...]:
    """Seconds between the reads storage did not serve: 2, 4, 8, ... (checkpoint.read_retries)."""
    return tuple(2.0 * 2**k for k in range(retries))


def _is_abandoned_read(unraisable) -> bool:
    """True for what a failed restore's other shard reads leave behind.

    Orbax runs a restore's shard reads as coroutines on a private event loop; the first
    failed read ends the loop and closes it. The other reads are abandoned:
    - each of Orbax's read coroutines ends with the read's own error (or GeneratorExit)
      when it is garbage collected ("Exception ignored in: <coroutine
      _read_array_index_and_device_put>"); coroutines of other code are not matched, since
      the hook stays installed for the process;
    - TensorStore completes the reads still in flight on its own threads, after the
      restore has returned, and their callbacks find the loop closed (RuntimeError "Event
      loop is closed" from call_soon_threadsafe, reported with no object)."""
    exc, obj = unraisable.exc_value, unraisable.object
    if inspect.iscoroutine(obj):
        return "orbax" in obj.cr_code.co_filename
    return obj is None and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _drop_abandoned_reads() -> None:
    """Install, once per process, an unraisable hook that drops `_is_abandoned_read` reports
    and passes everything else to the hook it wraps.

    It stays installed because the late reports come after the restore has returned, from
    TensorStore's threads, several at once. Formatting them (Python's default hook prints
    a traceback block each; pytest's formats them in the reporting thread) was noise at
    best, and CPython 3.12.1 once crashed formatting two concurrently (a segfault in
    linecache/tokenize under pytest's hook, in CI)."""
    if getattr(sys.unraisablehook, "jaxtrain_drops_abandoned_reads", False):
        return
    wrapped = sys.unraisablehook

    def hook(unraisable):
        if not _is_abandoned_read(unraisable):
            wrapped(unraisable)

    hook.jaxtrain_drops_abandoned_reads = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet_failed_reads():
    """Keep a failed restore to the one warning line the caller prints.

    Orbax logs its own warnings about the item it could not read (silenced here while the
    restore runs), and the reads a failure abandons report errors when they end, during
    and after the restore (dropped by `_drop_abandoned_reads`). The abandoned coroutines
    are collected before leaving, so their reports surface here and not in later code."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    _drop_abandoned_reads()
    try:
        yield
    finally:
        gc.collect()
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclasses.dataclass
class Restored:
    step: int
    state: TrainState
    data_state: dict
    meta: dict
    tier: str = "persistent"  # or "local" (recovery/local.py)
    path: str = ""  # the step's folder


def abstract_state(program: TrainProgram) -> TrainState:
    """ShapeDtypeStructs of the train state with the program's (concrete-mesh) shardings:
    the restore target. Nothing is allocated."""
    shapes = state_shapes(program)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, program.state_shardings
    )


def fingerprint(params: dict | None) -> str | None:
    """A short hex digest of a parameter tree's exact values and shapes (None for None): per
    leaf, a position-weighted wrapping sum of its float32 bits, computed where the arrays
    live (one pass; only a few integers come to the host). It tells a checkpoint's LoRA base
    from another, not an adversary's forgery."""
    if params is None:
        return None

    @jax.jit
    def sums(tree):
        def one(x):
            bits = jax.lax.bitcast_convert_type(x.astype(np.float32), np.uint32).reshape(-1)
            weights = jax.lax.iota(np.uint32, bits.size) * np.uint32(2654435761) + np.uint32(1)
            return jax.numpy.sum(bits * weights, dtype=np.uint32)

        return jax.tree.map(one, tree)

    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(sums(params)))[0]
    digest = 0
    for path, v in flat:
        for item in (jax.tree_util.keystr(path), int(v)):
            digest = (digest * 1000003 + hash_text(str(item))) % 2**64
    return f"{digest:016x}"


def hash_text(text: str) -> int:
    """A stable 64-bit hash of `text` (Python's hash() is salted per process)."""
    h = 1469598103934665603
    for byte in text.encode():
        h = ((h ^ byte) * 1099511628211) % 2**64
    return h


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a/b/c": leaf}, in sorted key order."""
    if isinstance(tree, dict):
        out = {}
        for k in sorted(tree):
            out.update(_flatten(tree[k], f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): tree}


def first_param_mismatch(saved: dict, expected: dict) -> str | None:
    """Describe the first parameter (sorted by path) whose presence or shape differs, or None."""
    saved_flat, expected_flat = _flatten(saved), _flatten(expected)
    for path in sorted(set(saved_flat) | set(expected_flat)):
        if path not in saved_flat:
            return f"parameter {path!r} is in the model but not in the checkpoint"
        if path not in expected_flat:
            return f"parameter {path!r} is in the checkpoint but not in the model"
        got, want = tuple(saved_flat[path].shape), tuple(expected_flat[path].shape)
        if got != want:
            return f"parameter {path!r} has shape {got} in the checkpoint but {want} in the model"
    return None


def _worst_everywhere(verdict: int) -> int:
    """The worst read_errors verdict any process reached (so that all take the same branch)."""
    if jax.process_count() == 1:
        return verdict
    return int(np.max(multihost_utils.process_allgather(np.asarray(verdict))))


MIN_REPLICA_SLICE_BYTES = 16 * 2**20


def _array_handlers():
    """Orbax type handlers for the train state (arrays and scalars), with
    replica-parallel writing only across processes and for large slices (see the
    module docstring)."""
    th = ocp.type_handlers
    arrays = th.ArrayHandler(
        use_replica_parallel=jax.process_count() > 1,
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    )
    return th.create_type_handler_registry(
        (jax.Array, arrays),
        (np.ndarray, th.NumpyHandler()),
        (np.number, th.ScalarHandler()),
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
    )


class _DropLogMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


class Checkpointer:
    """Save / find / restore train-state checkpoints under `directory`.

    keep: the newest `keep` checkpoints are kept; keep_every: every step that is
    a multiple of it is also kept, forever (0: none). async_save: write in a
    background thread; `save` then blocks only while device arrays are copied.
    read_only: only find and read checkpoints (`steps`, `restore_params`, `read_meta`):
    no directory is created and no tmp directory of a run still writing is cleaned up.
    on_unreadable: `stop` or `skip` a checkpoint proved unreadable (module docstring);
    retry_delays: the seconds between reads that storage did not serve (their count is the
    number of retries). Every process must call every method (Orbax synchronizes them).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        log: Callable[[str], None] = print,
        read_only: bool = False,
        on_unreadable: str = "stop",
        retry_delays: tuple[float, ...] = retry_delays(4),
    ):
        if on_unreadable not in ON_UNREADABLE:
            raise ValueError(f"on_unreadable={on_unreadable!r}: expected one of {ON_UNREADABLE}")
        if keep < 1:
            raise ValueError(f"keep={keep}: expected a positive integer")
        if keep_every < 0:
            raise ValueError(f"keep_every={keep_every}: expected >= 0")
        self.directory = checkpoint_path(directory)
        self.log = log
        self.on_unreadable, self.retry_delays = on_unreadable, tuple(retry_delays)
        keep_policies = [policies.LatestN(n=keep)]
        if keep_every:
            keep_policies.append(policies.EveryNSteps(interval_steps=keep_every))
        if read_only:  # nothing created, cleaned up or deleted: a run may be writing here
            options = ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, create=False, cleanup_tmp_directories=False
            )
        else:
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save,
                preservation_policy=policies.AnyPreservationPolicy(keep_policies),
                cleanup_tmp_directories=True,  # leftovers of killed writes
                create=True,
            )
        # Handlers named up front, so a fresh manager can read item metadata before any save.
        registry = ocp.handlers.create_default_handler_registry(
            state=ocp.PyTreeCheckpointHandler(type_handler_registry=_array_handlers()),
            data=ocp.JsonCheckpointHandler(),
            meta=ocp.JsonCheckpointHandler(),
        )
        # Orbax warns on every read-only open; that is the point here, so not for the user.
        quiet = _DropLogMessage("Given directory is read only")
        absl_logger = logging.getLogger("absl")
        absl_logger.addFilter(quiet)
        try:
            # opening lists the steps and cleans up tmp directories: storage reads like any other
            self.manager = self._retried(
                f"opening {self.directory}",
                lambda: ocp.CheckpointManager(self.directory, options=options, handler_registry=registry),
            )
        finally:
            absl_logger.removeFilter(quiet)

    # --- saving --------------------------------------------------------------

    def save(self, step: int, state: TrainState, data_state: dict, meta: dict) -> float | None:
        """Start saving `state` as checkpoint `step`; returns the seconds the caller was
        blocked (device-to-host snapshot, plus waiting for a previous write still in
        flight), or None if checkpoint `step` already exists."""
        if step in self.manager.all_steps():
            return None
        jax.block_until_ready(state)  # time the save, not the step still running
        state = state._replace(frozen=None)  # model.lora's base: train.init_from has it
        t0 = time.perf_counter()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Block until every started save is on disk (finalized)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # --- finding and restoring -----------------------------------------------

    def steps(self) -> list[int]:
        """Complete checkpoints on disk, oldest first (Orbax tmp directories excluded). A
        listing storage does not serve is retried (retry_delays), then
        CheckpointUnavailableError: never an empty list that would start the run afresh."""

        def listing():
            self.manager.reload()
            return sorted(self.manager.all_steps())

        return self._retried(f"listing {self.directory}", listing)

    def _retried(self, what: str, read: Callable[[], Any]) -> Any:
        """read(), again after each of retry_delays while it fails; then
        CheckpointUnavailableError naming `what` and the last error."""
        t0 = time.monotonic()
        for attempt, delay in enumerate((*self.retry_delays, None)):
            running = set(threading.enumerate())
            try:
                with _quiet_failed_reads():  # the failure is reported once, below
                    return read()
            except Exception as e:  # noqa: BLE001 - storage errors come as many types; retried, then reported
                with _quiet_failed_reads():  # background reads it started (Orbax's tmp cleanup) end here
                    for thread in set(threading.enumerate()) - running:
                        if type(thread).__module__.startswith("orbax"):
                            with contextlib.suppress(Exception):  # its error is `e`'s, reported below
                                thread.join(timeout=60)
                if delay is None:
                    raise CheckpointUnavailableError(
                        f"{what} failed {attempt + 1} times in {time.monotonic() - t0:.0f} s "
                        f"({read_errors.summary(e)}); nothing was moved or deleted. Run again once "
                        "storage is reachable"
                    ) from e
                time.sleep(delay)
        raise AssertionError("unreachable")

    def restore_latest(self, target: TrainState, *, before: int | None = None) -> Restored | None:
        """Restore the newest checkpoint (with step < `before`, if given) onto `target`'s
        shardings. None if there is none. One proved unreadable stops the run
        (CheckpointUnreadableError) or, with on_unreadable `skip`, is set aside and the one
        before it tried; reads storage does not serve end in CheckpointUnavailableError; a
        parameter-shape mismatch raises CheckpointMismatchError. Nothing is moved except by
        `skip`."""
        set_aside: list[str] = []
        restored = None
        for step in reversed(self.steps()):
            if before is not None and step >= before:
                continue
            restored, proof = self._try_restore(step, target)
            if restored is not None:
                break
            path = self.directory / str(step)
            if self.on_unreadable == "stop":
                raise CheckpointUnreadableError(
                    f"checkpoint {path} is unreadable ({proof}); stopped, nothing moved. Set "
                    "checkpoint.on_unreadable=skip to set it aside and resume from the newest "
                    "readable checkpoint before it"
                )
            set_aside.append(
                f"checkpoint {path} is unreadable ({proof}); moved it to {self._set_aside(step).name}"
            )
        fallback = (
            f"fell back to step {restored.step}"
            if restored
            else "no earlier one to fall back to: starting from step 0 (checkpoint.on_unreadable=skip)"
        )
        for line in set_aside:  # one line each, once the step it fell back to is known
            self.log(f"warning: {line}; {fallback}")
        return restored

    def restore(self, step: int, target: TrainState) -> Restored:
        """Restore checkpoint `step` onto `target` (raises CheckpointError if unreadable).
        The restored state's `frozen` (model.lora's base) is None: the caller supplies it."""
        target = target._replace(frozen=None)
        self._check_fits(step, target)
        items = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                ),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        state = items["state"]
        if not isinstance(state, TrainState):  # older Orbax returns the target's structure as a dict
            state = TrainState(**state)
        return Restored(
            step=step,
            state=state,
            data_state=dict(items["data"]),
            meta=dict(items["meta"] or {}),
            path=str(self.directory / str(step)),
        )

    def param_metadata(self, step: int) -> dict:
        """The stored parameter tree of checkpoint `step`: Orbax array metadata (shape, dtype)."""
        return dict(self.manager.item_metadata(step)["state"]["params"])

    def restore_params(self, step: int, target: dict | None = None) -> dict:
        """Only the parameters of checkpoint `step` (an Orbax partial restore: the optimizer
        state is not read). `target`: ShapeDtypeStructs with shardings to read them into;
        None: host numpy arrays in their stored dtypes (one copy, no device memory)."""
        if target is None:
            stored = self.param_metadata(step)
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored)
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored)
        else:
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        items = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
                )
            ),
        )
        return items["state"]["params"]

    def read_meta(self, step: int) -> dict:
        """Checkpoint `step`'s `meta` item (the resolved config under "config", ...)."""
        items = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(items["meta"] or {})

    def _check_fits(self, step: int, target: TrainState) -> None:
        path = self.directory / str(step)
        items = self.manager.item_metadata(step)
        metadata = items["state"] if items is not None else None
        saved_params = metadata["params"] if metadata is not None else None
        if saved_params is None:  # Orbax reads a missing or unserved metadata file as None
            if not storage.exists(path / "state" / "_METADATA"):
                raise read_errors.UnreadableBytes(f"{path / 'state' / '_METADATA'} is missing")
            raise OSError(f"{path / 'state' / '_METADATA'}: no state metadata read")
        mismatch = first_param_mismatch(dict(saved_params), target.params)
        window = metadata.get("loss_window") if hasattr(metadata, "get") else None
        want = tuple(target.loss_window.shape)
        if not mismatch and (window is None or tuple(window.shape) != want):
            got = "none" if window is None else f"{tuple(window.shape)[0]} losses"
            mismatch = (
                f"its loss window (spike detection) holds {got}, the run expects "
                f"faults.spike_window={want[0]}"
            )
        for field, what in (
            ("loss_scale", "a dynamic loss scale (model.compute_dtype=float16)"),
            ("fp8", "fp8 scaling state (model.fp8=true)"),
        ):
            saved = metadata.get(field) if hasattr(metadata, "get") else None
            if not mismatch and (saved is None) != (getattr(target, field) is None):
                has = "has" if saved is not None else "has no"
                wants = "expects one" if getattr(target, field) is not None else "does not"
                mismatch = f"it {has} {what}; the run {wants}"
        if not mismatch and target.fp8 is not None:
            mismatch = first_param_mismatch(dict(metadata["fp8"]), target.fp8)
            mismatch = mismatch and "fp8 state: " + mismatch.replace("parameter", "entry")
        if mismatch:
            raise CheckpointMismatchError(
                f"checkpoint {path}: {mismatch}. The config changed since this run was "
                "checkpointed; restore the old settings, or train into a new output_dir "
                "(or checkpoint.dir). The checkpoint was left untouched"
            )

    def _try_restore(self, step: int, target: TrainState) -> tuple[Restored | None, str | None]:
        """(the restored step, None), or (None, the proof that it is unreadable: one line).

        Proof must hold on two reads (and on every process's verdict, the worst of which
        decides); reads that prove nothing are retried after each of retry_delays and then
        raise CheckpointUnavailableError, as an out-of-memory does at once."""
        path = self.directory / str(step)
        t0, proofs = time.monotonic(), 0
        delays = iter(self.retry_delays)
        while True:
            error = None
            with _quiet_failed_reads():
                try:
                    restored = self.restore(step, target)
                except CheckpointMismatchError:
                    raise
                except Exception as e:  # noqa: BLE001 - classified: proof of damage, or a read to retry
                    restored, error = None, e
            verdict = _worst_everywhere(read_errors.OK if error is None else read_errors.verdict(error))
            if verdict == read_errors.OK:
                return restored, None
            detail = read_errors.summary(error) if error is not None else "failed on another process"
            if verdict == read_errors.UNREADABLE:
                proofs += 1
                if proofs == 2:
                    return None, detail
                continue
            if verdict == read_errors.OUT_OF_MEMORY:
                raise CheckpointUnavailableError(
                    f"out of memory restoring checkpoint {path} ({detail}); nothing was moved or "
                    "deleted. Free memory (other processes on the devices or host), or restore onto "
                    "more devices, and run again"
                ) from error
            delay = next(delays, None)
            if delay is None:
                raise CheckpointUnavailableError(
                    f"could not read checkpoint {path} ({detail}; {len(self.retry_delays)} retries in "
                    f"{time.monotonic() - t0:.0f} s); nothing was moved or deleted. Run again once "
                    "storage is reachable"
                ) from error
            time.sleep(delay)

    def _set_aside(self, step: int) -> Path:
        """Rename step directory out of Orbax's namespace (`{step}.unreadable[-n]`)."""
        src = self.directory / str(step)
        dst = src.with_name(f"{step}.unreadable")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{step}.unreadable-{n}")
        if jax.process_index() == 0:
            storage.move_tree(src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
        self.manager.reload()
        return dst

    def discard_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (after a rollback they belong to an abandoned
        timeline, and Orbax only saves steps newer than the newest). Returns their steps."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.manager.delete(s)
        return newer
