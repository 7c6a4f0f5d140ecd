"""The local checkpoint tier: each process's own shards of the train state, on its own host,
written every `checkpoint.local_every` steps (recovery/tiers.py decides which tier a restart
reads; docs/checkpoints.md says why this is ours and not Orbax's emergency manager).

Layout, per process `i` (its `jax.process_index()`):

  {local_dir}/process_{i}/{step}/arrays.bin     the distinct shards this process holds of
                                                every state array, back to back
  {local_dir}/process_{i}/{step}/manifest.json  per array: its name, shape, dtype and, per
                                                shard, its index, offset, size and CRC-32;
                                                the data position and meta (as the persistent
                                                tier's `data` and `meta` items); the mesh
                                                shape and process count it was written on

Nothing here is a collective: a process writes and reads only its own folder, so a save costs
no synchronisation and a lost host costs only its own folder.

Saving blocks the loop for the device-to-host copy of this process's shards (and for a
previous write still in flight); a background thread then writes the bytes, checksums them
(CRC-32, about as fast as the write to a RAM disk), and the newest `local_keep` steps are kept.

Atomicity: a step is written to `{step}.tmp-{pid}` (the manifest last, each file fsynced) and
renamed to `{step}` when complete, so a killed write leaves only a tmp folder, which `steps()`
never lists and the next run deletes.

Integrity is proved by the bytes, as read_errors.py asks: a manifest that does not parse or is
missing, `arrays.bin` shorter than the manifest says, or a shard whose CRC-32 differs is
`read_errors.UnreadableBytes` (or the JSON / file error read_errors already counts as proof).
One read decides (a local file does not have an outage to wait out); the caller skips to the
next candidate.

Restoring needs the same mesh shape, process count and sharding as the save (each process's
shards must cover what it holds now); `mismatch()` says in one line when they do not, before
any array is read. The persistent tier (checkpoint.py) restores onto any mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxtrain.recovery import read_errors
from jaxtrain.recovery.checkpoint import Restored
from jaxtrain.trainer.step import TrainState

MANIFEST, ARRAYS = "manifest.json", "arrays.bin"
FORMAT = 1  # manifest["format"]: bumped when the layout changes


def process_folder(local_dir: str | os.PathLike, process_index: int) -> Path:
    """`{local_dir}/process_{i}`: process `i`'s local checkpoints."""
    return Path(os.path.abspath(os.fspath(local_dir))) / f"process_{process_index}"


def _name(path) -> str:
    """A state leaf's tree path as `params/blocks/attn/wq`."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _index_key(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as ((start, stop), ...) per dimension."""
    return tuple(
        (s.indices(n)[0], s.indices(n)[1]) if isinstance(s, slice) else (int(s), int(s) + 1)
        for s, n in zip(index, shape)
    )


def _leaves(tree) -> list[tuple[str, object]]:
    """(name, leaf) of a state tree, in its flattening order (`frozen` left out)."""
    return [(_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclasses.dataclass
class _HostArray:
    """One state array's shards, copied to this host: {index key: numpy array}."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: dict[tuple[tuple[int, int], ...], np.ndarray]


def _snapshot(state: TrainState) -> list[_HostArray]:
    """Copy this process's distinct shards of every state array to host memory. The copies
    are all started before the first is waited for; they are the loop's whole cost of a save
    (the state itself is donated to the next step)."""
    picked: list[tuple[str, tuple, np.dtype, dict]] = []
    for name, leaf in _leaves(state):
        if isinstance(leaf, jax.Array):
            shards: dict = {}
            for shard in leaf.addressable_shards:  # a replicated shard is written once per process
                shards.setdefault(_index_key(shard.index, leaf.shape), shard.data)
            for data in shards.values():
                data.copy_to_host_async()
            picked.append((name, tuple(leaf.shape), leaf.dtype, shards))
        else:
            host = np.asarray(leaf)
            picked.append((name, host.shape, host.dtype, {_index_key((), ()): host}))
    return [
        _HostArray(name, shape, np.dtype(dtype), {k: np.array(v, copy=True) for k, v in shards.items()})
        for name, shape, dtype, shards in picked
    ]


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class LocalCheckpointer:
    """This process's local tier: save asynchronously, list, check and read its own steps.

    keep: the newest `keep` steps are kept. async_save: write in a background thread (one
    write at a time). Every method concerns this process's folder alone."""

    def __init__(
        self,
        local_dir: str | os.PathLike,
        *,
        keep: int = 2,
        async_save: bool = True,
        log: Callable[[str], None] = print,
    ):
        if keep < 1:
            raise ValueError(f"keep={keep}: expected a positive integer")
        self.local_dir = os.fspath(local_dir)
        self.directory = process_folder(local_dir, jax.process_index())
        self.keep, self.async_save, self.log = keep, async_save, log
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None  # a failed write's (step, error)
        self.directory.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.directory):  # leftovers of killed writes
            if ".tmp-" in name:
                shutil.rmtree(self.directory / name, ignore_errors=True)

    # --- saving --------------------------------------------------------------

    def save(self, step: int, state: TrainState, data_state: dict, meta: dict) -> float:
        """Start writing `state` as local step `step`; returns the seconds the caller was
        blocked (a previous write still in flight, then the device-to-host copy)."""
        jax.block_until_ready(state)  # time the save, not the step still running
        t0 = time.perf_counter()
        self.wait()
        arrays = _snapshot(state._replace(frozen=None))  # model.lora's base: train.init_from has it
        blocked = time.perf_counter() - t0
        header = {
            "format": FORMAT,
            "step": step,
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "data": data_state,
            "meta": meta,
        }
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write_or_keep_error, args=(step, arrays, header), name="jaxtrain-local-save"
            )
            self._thread.start()
        else:
            self._write_or_keep_error(step, arrays, header)
            self.wait()
        return blocked

    def _write_or_keep_error(self, step: int, arrays: list[_HostArray], header: dict) -> None:
        """Write, or keep the storage error (a full RAM disk, a failed local disk) for `wait`
        to report: the local tier is a cache, and the run goes on without this step."""
        try:
            self._write(step, arrays, header)
        except OSError as e:
            self._error = (step, e)
            shutil.rmtree(self.directory / f"{step}.tmp-{os.getpid()}", ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - a bug: raised in the loop's thread by wait()
            self._error = (step, e)

    def _write(self, step: int, arrays: list[_HostArray], header: dict) -> None:
        tmp = self.directory / f"{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        entries, offset = [], 0
        with open(tmp / ARRAYS, "wb") as f:
            for a in arrays:
                shards = []
                for key, host in a.shards.items():
                    raw = _bytes(host)
                    f.write(raw)
                    shards.append(
                        {
                            "index": [list(k) for k in key],
                            "offset": offset,
                            "bytes": raw.size,
                            "crc32": zlib.crc32(raw),
                        }
                    )
                    offset += raw.size
                entries.append(
                    {"name": a.name, "shape": list(a.shape), "dtype": a.dtype.name, "shards": shards}
                )
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / MANIFEST, "w") as f:
            json.dump({**header, "arrays": entries}, f)
            f.flush()
            os.fsync(f.fileno())
        final = self.directory / str(step)
        if final.exists():  # an abandoned timeline's step (after a rollback or an older restore)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Block until the write in flight is complete. A storage error it met is one warning
        line (the step is not in the local tier; the run goes on); any other error is raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            (step, error), self._error = self._error, None
            if not isinstance(error, OSError):
                raise error
            self.log(
                f"warning: local checkpoint step {step} was not written to {self.directory} ({error}); "
                "training goes on, and a restart restores an earlier local step or the persistent tier"
            )

    def close(self) -> None:
        self.wait()

    # --- finding and reading ---------------------------------------------------

    def steps(self) -> list[int]:
        """Complete local steps of this process, oldest first (tmp folders excluded)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def manifest(self, step: int) -> dict:
        """Step `step`'s manifest (a missing or unparsable one is proof: read_errors)."""
        text = (self.path(step) / MANIFEST).read_text()
        manifest = json.loads(text)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise read_errors.UnreadableBytes(f"{self.path(step) / MANIFEST}: not a format-{FORMAT} manifest")
        return manifest

    def mismatch(self, step: int, target: TrainState, mesh_shape: dict) -> str | None:
        """Why local step `step` cannot be restored onto `target` (its shapes, dtypes, mesh,
        process count or sharding differ), in a few words; None when it fits."""
        manifest = self.manifest(step)
        saved_mesh = {k: int(v) for k, v in manifest["meta"].get("mesh", {}).items()}
        want_mesh = {k: int(v) for k, v in mesh_shape.items()}
        if saved_mesh != want_mesh or manifest["process_count"] != jax.process_count():
            shown = lambda mesh: {k: v for k, v in mesh.items() if v > 1} or "single device"  # noqa: E731
            return (
                f"it was written on mesh {shown(saved_mesh)} by {manifest['process_count']} process(es); "
                f"the run has mesh {shown(want_mesh)} on {jax.process_count()}"
            )
        saved = {e["name"]: e for e in manifest["arrays"]}
        wanted = dict(_leaves(target._replace(frozen=None)))
        # the state's own order (its step, then params, ...): a model change names a parameter
        for name in [*wanted, *sorted(set(saved) - set(wanted))]:
            if name not in saved:
                return f"array {name!r} is in the run's state but not in the local checkpoint"
            if name not in wanted:
                return f"array {name!r} is in the local checkpoint but not in the run's state"
            got, want = tuple(saved[name]["shape"]), tuple(wanted[name].shape)
            if got != want:
                return f"array {name!r} has shape {got} in the local checkpoint but {want} in the run"
            if saved[name]["dtype"] != np.dtype(wanted[name].dtype).name:
                return (
                    f"array {name!r} is {saved[name]['dtype']} in the local checkpoint but "
                    f"{np.dtype(wanted[name].dtype).name} in the run"
                )
            held = {tuple(tuple(k) for k in s["index"]) for s in saved[name]["shards"]}
            for index in wanted[name].sharding.addressable_devices_indices_map(want).values():
                if _index_key(index, want) not in held:
                    return (
                        f"its shards of {name!r} do not cover this process's part of it (the "
                        "sharding changed: mesh.rules or the device order)"
                    )
        return None

    def read(self, step: int, target: TrainState) -> Restored:
        """Local step `step` onto `target`'s shardings, each shard's CRC-32 checked. Call
        `mismatch` first; bytes that fail their checks raise read_errors.UnreadableBytes."""
        manifest = self.manifest(step)
        path = self.path(step) / ARRAYS
        buffer = np.fromfile(path, dtype=np.uint8)
        saved = {e["name"]: e for e in manifest["arrays"]}
        target = target._replace(frozen=None)
        leaves = []
        for name, want in _leaves(target):
            entry = saved[name]
            dtype = jax.numpy.dtype(entry["dtype"])
            shards = {tuple(tuple(k) for k in s["index"]): s for s in entry["shards"]}
            on_devices = []
            memory_kind = getattr(want.sharding, "memory_kind", None)  # optimizer.offload: pinned_host
            for device, index in want.sharding.addressable_devices_indices_map(want.shape).items():
                key = _index_key(index, want.shape)
                host = self._shard(path, buffer, name, shards[key], dtype, key)
                place = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
                on_devices.append(jax.device_put(host, place))
            leaves.append(jax.make_array_from_single_device_arrays(want.shape, want.sharding, on_devices))
        state = jax.tree.unflatten(jax.tree.structure(target), leaves)
        return Restored(
            step=step,
            state=state,
            data_state=dict(manifest["data"]),
            meta=dict(manifest["meta"]),
            tier="local",
            path=str(self.path(step)),
        )

    @staticmethod
    def _shard(path: Path, buffer: np.ndarray, name: str, shard: dict, dtype, key) -> np.ndarray:
        start, size = shard["offset"], shard["bytes"]
        raw = buffer[start : start + size]
        if raw.size != size:
            raise read_errors.UnreadableBytes(
                f"{path} holds {buffer.size} bytes, its manifest names bytes {start}..{start + size} ({name})"
            )
        crc = zlib.crc32(raw)
        if crc != shard["crc32"]:
            raise read_errors.UnreadableBytes(
                f"{path}: a shard of {name!r} fails its CRC-32 check (read {crc:08x}, "
                f"written {shard['crc32']:08x})"
            )
        return raw.view(dtype).reshape(tuple(b - a for a, b in key))

    def set_aside(self, step: int) -> Path:
        """Rename step `step` to `{step}.unreadable` (kept for inspection, never listed)."""
        dst = self.directory / f"{step}.unreadable"
        shutil.rmtree(dst, ignore_errors=True)
        os.rename(self.path(step), dst)
        return dst

    def discard_after(self, step: int) -> list[int]:
        """Delete local steps newer than `step` (an abandoned timeline's: after a rollback, or
        newer than what every process restored). Returns their steps."""
        self.wait()
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            shutil.rmtree(self.path(s), ignore_errors=True)
        return newer
