"""Every file the data package reads or writes goes through here: local paths and
remote URLs (``gs://bucket/...``, anything `etils.epath` can open) alike.

Local files use plain ``os``/``open`` (and the loader memory-maps them); remote ones
go through `etils.epath` (its fsspec/gfile backends), which supports streaming reads,
ranged reads (``seek`` + ``read``) and whole-object writes. Nothing here appends to a
remote object, so every writer builds a file whole and renames it into place.

``gs://`` goes through gcsfs (fsspec) here and through TensorStore's GCS driver in Orbax
checkpoints. ``STORAGE_EMULATOR_HOST=http://HOST:PORT`` (the GCS emulator convention that
gcsfs and google-cloud-storage follow) points both at an emulator such as fake-gcs-server:
see `follow_storage_emulator`.
"""

from __future__ import annotations

import glob as _glob
import os
import sys
from typing import IO

from etils import epath

__all__ = [
    "as_path",
    "is_local",
    "open_read",
    "read_bytes",
    "write_atomic",
    "file_size",
    "exists",
    "is_file",
    "is_dir",
    "list_dir",
    "remove",
    "make_dirs",
    "glob_files",
    "join",
    "move_tree",
    "follow_storage_emulator",
]

_GLOB_CHARS = frozenset("*?[")


def follow_storage_emulator() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set, point every GCS client we use at that emulator.

    gcsfs follows the variable itself; here it also gets anonymous credentials (no search
    for Google credentials and no metadata-server probe) and its zonal/HNS bucket probe
    is turned off (a gRPC call to the storage control API, which emulators do not serve:
    every first access would stall for a minute). TensorStore, which writes and reads
    Orbax's arrays, does not read the variable: it gets ``TENSORSTORE_GCS_HTTP_URL`` and a
    placeholder token (``GOOGLE_AUTH_TOKEN_FOR_TESTING``, which it sends as is). Variables
    already set are left alone. Called on import, before gcsfs or TensorStore start.
    """
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return
    url = host if host.startswith(("http://", "https://")) else f"http://{host}"
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("FSSPEC_GCS_TOKEN", "anon")
    fsspec = sys.modules.get("fsspec")
    if fsspec is not None:  # imported already: its config read the environment before this
        fsspec.config.conf.setdefault("gcs", {}).setdefault("token", os.environ["FSSPEC_GCS_TOKEN"])


follow_storage_emulator()


def is_local(path: str | os.PathLike) -> bool:
    """A path on this machine's file system (no ``scheme://``, or ``file://``)."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def _local(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


def as_path(path: str | os.PathLike) -> epath.Path:
    return epath.Path(_local(path) if is_local(path) else os.fspath(path))


def join(directory: str | os.PathLike, *names: str) -> str:
    if is_local(directory):
        return os.path.join(_local(directory), *names)
    return "/".join([os.fspath(directory).rstrip("/"), *names])


def open_read(path: str | os.PathLike, *, random_access: bool = False) -> IO[bytes]:
    """A seekable binary file object (remote: ranged reads under the hood).

    ``random_access``: the caller seeks to scattered small ranges (token windows), so a
    remote file reads exactly the bytes asked for (fsspec ``cache_type="none"``) rather than
    prefetching ahead of each read as it does for streaming."""
    if is_local(path):
        return open(_local(path), "rb")
    if random_access:
        import fsspec  # remote paths only: a local run never loads the object-store stack

        fs, fs_path = fsspec.core.url_to_fs(os.fspath(path))
        return fs.open(fs_path, "rb", cache_type="none")
    return as_path(path).open("rb")


def read_bytes(path: str | os.PathLike) -> bytes:
    with open_read(path) as f:
        return f.read()


def write_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a part.
    ``fsync=False``: atomic against a killed process, not a lost host (for files rewritten
    often, where a flush to disk each time would cost more than the file is worth)."""
    tmp = f"{os.fspath(path)}.tmp"
    if is_local(path):
        with open(_local(tmp), "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(_local(tmp), _local(path))
    else:
        # Object stores (gs://, s3://, ...) replace an object atomically on upload: a
        # reader sees the old object or the new one. A temporary object + rename would be
        # a copy and a delete on top (GCS has no rename), for nothing.
        as_path(path).write_bytes(data)


def file_size(path: str | os.PathLike) -> int:
    if is_local(path):
        return os.path.getsize(_local(path))
    return int(as_path(path).stat().length)


def exists(path: str | os.PathLike) -> bool:
    return os.path.exists(_local(path)) if is_local(path) else as_path(path).exists()


def is_file(path: str | os.PathLike) -> bool:
    return os.path.isfile(_local(path)) if is_local(path) else as_path(path).is_file()


def is_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(_local(path)) if is_local(path) else as_path(path).is_dir()


def list_dir(path: str | os.PathLike) -> list[str]:
    """Names (not paths) in a directory, sorted; [] if it does not exist."""
    if not is_dir(path):
        return []
    if is_local(path):
        return sorted(os.listdir(_local(path)))
    return sorted(p.name for p in as_path(path).iterdir())


def remove(path: str | os.PathLike) -> None:
    if is_local(path):
        os.remove(_local(path))
    else:
        as_path(path).unlink()


def make_dirs(path: str | os.PathLike) -> None:
    if is_local(path):
        os.makedirs(_local(path), exist_ok=True)
    else:
        as_path(path).mkdir(parents=True, exist_ok=True)


def glob_files(pattern: str) -> list[str]:
    """Files matching a glob pattern (``**`` recurses), sorted."""
    if is_local(pattern):
        return sorted(m for m in _glob.glob(_local(pattern), recursive=True) if os.path.isfile(m))
    # Remote: glob below the longest directory prefix without glob characters.
    parts = pattern.split("/")
    fixed = next(i for i, p in enumerate(parts) if _GLOB_CHARS & set(p))
    base = as_path("/".join(parts[:fixed]))
    return sorted(os.fspath(p) for p in base.glob("/".join(parts[fixed:])) if p.is_file())


def has_glob(pattern: str) -> bool:
    return bool(_GLOB_CHARS & set(pattern))


def move_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move a directory (local: one rename; remote object stores: copy every object, then
    delete the originals, since they have no directories to rename)."""
    if is_local(src) and is_local(dst):
        os.replace(_local(src), _local(dst))
        return
    import fsspec  # remote paths only, as in open_read

    fs, src_path = fsspec.core.url_to_fs(os.fspath(src))
    fs.copy(src_path, fsspec.core.url_to_fs(os.fspath(dst))[1], recursive=True)
    fs.rm(src_path, recursive=True)
