"""Read wandb offline runs (``.wandb`` transaction logs) back into Python.

Verified against wandb 0.31.0. That version no longer ships a Python reader
(``wandb.sdk.internal.datastore.DataStore`` was removed together with the
Python internal process; all writing is done by the Go ``wandb-core``
binary).  The on-disk format is unchanged, however:

* 7-byte file header: b":W&B" + uint16 LE magic 0xBEE1 + uint8 version (0).
* Then a LevelDB-style log: 32 KiB blocks, each chunk has a 7-byte header
  ``<I crc32><H length><B type>`` (type 1=FULL, 2=FIRST, 3=MIDDLE, 4=LAST);
  crc is zlib (IEEE) crc32 of ``bytes([type]) + data``; a block tail shorter
  than 7 bytes is zero padding.
* Every reassembled payload is a serialized ``wandb.proto.wandb_internal_pb2.Record``.

Only the protobuf classes of the installed wandb package are used.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from collections.abc import Iterator
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_HEADER_IDENT = b":W&B"
_HEADER_MAGIC = 0xBEE1
_HEADER_LEN = 7
_BLOCK = 32768
_CHUNK_HDR = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(path: str) -> Iterator[pb.Record]:
    """Yield every Record stored in one ``.wandb`` file.

    A truncated final chunk (process killed while writing) ends the
    iteration silently; a checksum mismatch raises ValueError.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER_LEN:
        return
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER_LEN])
    if ident != _HEADER_IDENT or magic != _HEADER_MAGIC:
        raise ValueError(f"{path}: not a wandb transaction log")
    pos = _HEADER_LEN
    pending: bytearray | None = None
    while True:
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HDR:  # zero padding at block end
            pos += left_in_block
            continue
        if pos + _CHUNK_HDR > len(data):
            return
        crc, length, ctype = struct.unpack("<IHB", data[pos : pos + _CHUNK_HDR])
        start = pos + _CHUNK_HDR
        end = start + length
        if end > len(data):  # truncated tail
            return
        if ctype == 0 and length == 0:  # zeroed/preallocated space
            pos = end
            continue
        chunk = data[start:end]
        if zlib.crc32(chunk, zlib.crc32(bytes([ctype]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: checksum mismatch at offset {pos}")
        pos = end
        if ctype == _FULL:
            pending = None
            payload = chunk
        elif ctype == _FIRST:
            pending = bytearray(chunk)
            continue
        elif ctype == _MIDDLE:
            if pending is not None:
                pending += chunk
            continue
        elif ctype == _LAST:
            if pending is None:
                continue
            payload = bytes(pending + chunk)
            pending = None
        else:
            raise ValueError(f"{path}: unknown chunk type {ctype} at offset {pos}")
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _item_key(item: Any) -> list[str]:
    """Key path of a HistoryItem / SummaryItem / ConfigItem."""
    return list(item.nested_key) if len(item.nested_key) else [item.key]


def _item_value(item: Any) -> Any:
    # wandb-core always fills value_json (NaN/Infinity are valid for json.loads).
    if item.value_json:
        return json.loads(item.value_json)
    which = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    return getattr(item, which) if which and which != "none" else None


def _set_nested(d: dict, path: list[str], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _del_nested(d: dict, path: list[str]) -> None:
    for k in path[:-1]:
        d = d.get(k)
        if not isinstance(d, dict):
            return
    d.pop(path[-1], None)


def _read_one(path: str) -> dict:
    out: dict = {
        "file": path,
        "run_id": None,
        "entity": None,
        "project": None,
        "name": None,
        "tags": [],
        "config": {},
        "summary": {},
        "history": [],
        "start_time": None,
        "exit_code": None,
    }
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            for attr, field in (
                ("run_id", "run_id"),
                ("entity", "entity"),
                ("project", "project"),
                ("name", "display_name"),
            ):
                if getattr(r, field):
                    out[attr] = getattr(r, field)
            if r.HasField("start_time") and out["start_time"] is None:
                out["start_time"] = r.start_time.seconds + r.start_time.nanos / 1e9
            out["tags"] = list(r.tags)  # last run record wins (run.tags = ... resends it)
            for it in r.config.update:
                _set_nested(out["config"], _item_key(it), _item_value(it))
            for it in r.config.remove:
                _del_nested(out["config"], _item_key(it))
        elif kind == "config":
            for it in rec.config.update:
                _set_nested(out["config"], _item_key(it), _item_value(it))
            for it in rec.config.remove:
                _del_nested(out["config"], _item_key(it))
        elif kind == "history":
            row = {".".join(_item_key(it)): _item_value(it) for it in rec.history.item}
            if "_step" not in row and rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            out["history"].append(row)
        elif kind == "summary":
            for it in rec.summary.update:
                _set_nested(out["summary"], _item_key(it), _item_value(it))
            for it in rec.summary.remove:
                _del_nested(out["summary"], _item_key(it))
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    out["config"].pop("_wandb", None)
    out["summary"].pop("_wandb", None)
    return out


def find_wandb_files(path: str, run_id: str | None = None) -> list[str]:
    """Locate .wandb files.

    ``path`` may be a ``.wandb`` file, one ``offline-run-*`` folder, the
    ``wandb/`` folder, or the ``dir=`` passed to ``wandb.init`` (which
    contains ``wandb/``).
    """
    if os.path.isfile(path):
        return [path]
    pattern = f"run-{run_id}.wandb" if run_id else "run-*.wandb"
    files = glob.glob(os.path.join(path, pattern))
    if not files:
        for base in (path, os.path.join(path, "wandb")):
            files += glob.glob(os.path.join(base, "*run-*", pattern))
    return sorted(set(files))


def read_offline_run(run_dir: str, run_id: str | None = None) -> dict:
    """Read an offline run, merging every session (offline-run-* folder) of it.

    Each ``wandb.init(id=X, resume="allow", mode="offline")`` creates a *new*
    ``offline-run-<YYYYmmdd_HHMMSS>-X[-N]`` folder, so a resumed run is the
    union of several folders. Sessions are ordered by their run start time;
    history rows are concatenated in that order, config/summary updates from
    later sessions override earlier ones, name/tags/project come from the last
    session that set them.

    Returns dict(history=[{metric: value, "_step": n, ...}], config={...},
    summary={...}, run_id=..., entity=..., project=..., name=..., tags=[...],
    sessions=[paths of .wandb files in order]). Nested logged dicts appear as
    dotted keys ("a.b") in history rows.
    """
    files = find_wandb_files(run_dir, run_id)
    if not files:
        raise FileNotFoundError(f"no .wandb file found under {run_dir!r}")
    parts = [_read_one(f) for f in files]
    ids = {p["run_id"] for p in parts if p["run_id"]}
    if len(ids) > 1:
        raise ValueError(f"several runs under {run_dir!r}: {sorted(ids)}; pass run_id=")
    parts.sort(key=lambda p: (p["start_time"] or 0.0, p["file"]))
    result: dict = {
        "history": [],
        "config": {},
        "summary": {},
        "run_id": None,
        "entity": None,
        "project": None,
        "name": None,
        "tags": [],
        "sessions": [],
    }
    for p in parts:
        result["history"].extend(p["history"])
        result["config"].update(p["config"])
        result["summary"].update(p["summary"])
        for k in ("run_id", "entity", "project", "name"):
            if p[k]:
                result[k] = p[k]
        if p["tags"]:
            result["tags"] = p["tags"]
        result["sessions"].append(p["file"])
    return result
