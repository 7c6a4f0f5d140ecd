"""What a failed checkpoint read says about the checkpoint: proof that its bytes are bad, or
nothing at all.

A checkpoint is set aside (or the run stopped, `checkpoint.on_unreadable`) only on proof:
metadata that does not parse, a file its own manifest names that storage does not hold, an
array file shorter than its index says or that does not decompress. Everything else says
nothing about the checkpoint (storage answering 503 or not at all, expired credentials, out
of memory, a bug in the reader) and must not cost the user a checkpoint: such reads are
retried, then the run stops with nothing moved (recovery/checkpoint.py).

The proof is read from the exception chain. Orbax wraps TensorStore's errors in a bare
`Exception` ("Encountered error while reading array index ...") whose cause carries the
absl status code TensorStore starts its message with, e.g. (a file cut in half, a file
removed, from tests/test_checkpoint.py):
  OUT_OF_RANGE: Error reading "params.blocks.attn.wo/0.0.0.0" in OCDBT database ...:
      Requested byte range [900200, 930553) is not valid for value of size 717848
  FAILED_PRECONDITION: Error reading "params.blocks.attn.wq/0.0.0.0" ...: Truncated
      Zstd-compressed stream
  NOT_FOUND: Error opening "zarr" driver: Metadata at "loss_window/.zarray" ... does not exist
Storage outages come as UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, PERMISSION_DENIED or
UNAUTHENTICATED (TensorStore), or OSError / HTTP errors (gcsfs, for the JSON items); device
out-of-memory as RESOURCE_EXHAUSTED (XLA).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

OK, UNREADABLE, UNAVAILABLE, OUT_OF_MEMORY = 0, 1, 2, 3
"""Verdicts, ordered so that the worst one any process saw decides for all (max)."""

VERDICT_NAMES = {
    OK: "ok",
    UNREADABLE: "unreadable",
    UNAVAILABLE: "unavailable",
    OUT_OF_MEMORY: "out of memory",
}

#: TensorStore status codes that describe the bytes read, not the way to them.
PROOF_CODES = ("OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND")


class UnreadableBytes(Exception):
    """Raised by our own checks when the bytes prove it (a metadata file missing from a
    checkpoint marked complete); `verdict` reads it as proof."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _status_code(error: BaseException) -> str:
    """The absl status code a TensorStore / XLA message starts with ('' if none)."""
    head = str(error).lstrip().split(":", 1)[0]
    return head if head.isupper() and head.replace("_", "").isalpha() else ""


def is_out_of_memory(error: BaseException) -> bool:
    for e in _chain(error):
        if isinstance(e, MemoryError) or _status_code(e) == "RESOURCE_EXHAUSTED":
            return True
        if "out of memory" in str(e).lower():
            return True
    return False


def verdict(error: BaseException) -> int:
    """UNREADABLE when the exception chain proves the checkpoint's bytes bad (module
    docstring), OUT_OF_MEMORY for an allocation failure, UNAVAILABLE for everything else."""
    if is_out_of_memory(error):
        return OUT_OF_MEMORY
    for e in _chain(error):
        if isinstance(e, (UnreadableBytes, json.JSONDecodeError, FileNotFoundError)):
            return UNREADABLE
        if _status_code(e) in PROOF_CODES:
            return UNREADABLE
    return UNAVAILABLE


def summary(error: BaseException, limit: int = 200) -> str:
    """The gist of a read error, naming the innermost status code or type: TensorStore
    appends pages of spec details, Orbax wraps them in a bare Exception."""
    inner = next((e for e in _chain(error) if _status_code(e)), error)
    text = " ".join(str(inner).split()).split(" See full TensorStore details")[0]
    text = text.split(" [tensorstore_spec=")[0]
    text = text if _status_code(inner) else f"{type(inner).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
