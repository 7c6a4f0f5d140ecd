"""safetensors files read and written without the `safetensors` package's numpy layer.

Why not `safetensors.safe_open(framework="numpy")`: it cannot return the dtypes the published
checkpoints use (BF16, F8_E4M3: `module 'numpy' has no attribute 'float8_e4m3fn'`), and it
memory-maps the whole file, so every tensor it has read stays resident in the process (RSS)
until the handle closes: converting a checkpoint would count the checkpoint's size. Here a
tensor is read with one positioned read (`os.pread`) into its own buffer, typed with
ml_dtypes (which JAX ships), and freed when the caller drops it.

The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}} padded with spaces to a multiple of 8,
then the tensors' bytes (C order, little-endian) at data_offsets from the header's end.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype name <-> numpy dtype
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file that is not safetensors, or a dtype this reader does not know; names it."""


class SafetensorsFile:
    """One .safetensors file: its header parsed at open, each tensor read on request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise SafetensorsError(f"{self.path}: unreadable safetensors header ({e})") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self._data_start = 8 + n

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> np.dtype:
        code = self.entries[name]["dtype"]
        if code not in DTYPES:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} has dtype {code}; expected one of {tuple(DTYPES)}"
            )
        return DTYPES[code]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` as a fresh numpy array in its stored dtype."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype, shape = self.dtype(name), self.shape(name)
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise SafetensorsError(
                f"{self.path}: tensor {name!r}: {end - begin} bytes for {entry['dtype']}{list(shape)}"
            )
        buf = bytearray(end - begin)
        view = memoryview(buf)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                got = os.preadv(fd, [view[done:]], self._data_start + begin + done)
                if got <= 0:
                    raise SafetensorsError(f"{self.path}: truncated in tensor {name!r}")
                done += got
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=dtype.newbyteorder("<")).reshape(shape)


def write_file(
    path: str | Path, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None
) -> None:
    """Write (name, array) pairs as one .safetensors file (any dtype of `DTYPES`)."""
    arrays = [(name, np.ascontiguousarray(a)) for name, a in tensors]
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in arrays:
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)  # (little-endian hosts: x86, arm64)
