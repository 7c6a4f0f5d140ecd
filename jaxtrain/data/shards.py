"""Token shards on disk: the format `jaxtrain tokenize` writes and `data.source: tokens` reads.

A token directory holds, per split (``train``, and ``eval`` when some documents were
held out)::

    manifest.json            written last: its presence means the directory is complete
    tokenizer.json           a copy of the tokenizer (HF tokenizers only)
    train-00000.tokens       token ids, little-endian uint16 (vocab <= 65536) or uint32, no header
    train-00000.docs         uint64 little-endian: split-wide token offsets where documents end
    train-00001.tokens ...

A split is one stream of tokens: every document's ids followed by EOS (EOS belongs to
the document it ends), documents in input order. The stream is cut into shards of
exactly ``shard_tokens`` tokens (the last one shorter), regardless of document
boundaries, so token ``t`` of the split is at offset ``t % shard_tokens`` of shard
``t // shard_tokens``. A document ends at offset ``e`` when its EOS is token ``e - 1``;
each ``.docs`` file lists, in order, the ends that fall in its shard
(``first_token < e <= first_token + tokens``).

``manifest.json``::

    format "jaxtrain-tokens", version 1
    tokenizer {name, sha256, vocab_size, eos_id}
    dtype "uint16" | "uint32", shard_tokens
    text_field, separator, eval_fraction          how the documents were read and split
    inputs [{path, bytes}]                         what was read, in order
    splits {train|eval: {tokens, documents, shards: [{tokens_file, docs_file, tokens,
            documents, first_token, sha256, docs_sha256}]}}

A document goes to ``eval`` when ``blake2b(utf8 text, digest_size=8)`` read as a
big-endian integer, divided by 2**64, is below ``eval_fraction``: a document's split
depends on its text alone, so duplicates land on the same side and adding files to a
corpus moves no document across.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os

import numpy as np

from . import storage
from .core import DataError

FORMAT = "jaxtrain-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_COPY = "tokenizer.json"
DOC_DTYPE = np.dtype("<u8")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "eval")


def token_dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_names(split: str, index: int) -> tuple[str, str]:
    return f"{split}-{index:05d}.tokens", f"{split}-{index:05d}.docs"


def to_eval(text: str, eval_fraction: float) -> bool:
    """The split rule (see the module docstring)."""
    if eval_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < eval_fraction * 2.0**64


# --------------------------------------------------------------------------- writing


class SplitWriter:
    """One split's shards: tokens are added in order; every ``shard_tokens`` of them make a shard.

    Memory holds at most one shard plus the last batch added (``pending``). The pending
    tokens can be saved as a tail (`save_tail`) so that a killed run resumes exactly.
    """

    def __init__(self, directory: str, split: str, *, dtype: str, shard_tokens: int):
        self.directory, self.split = directory, split
        self.dtype = TOKEN_DTYPES[dtype]
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0  # in finished shards
        self.documents = 0  # whose ends are in finished shards
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self._pending = 0
        self._ends: list[np.ndarray] = []  # uint64 ends beyond the finished shards

    @property
    def total_tokens(self) -> int:
        return self.tokens + self._pending

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> int:
        """Append documents (``tokens`` already holds each one's ids and EOS; ``lengths``
        counts both); writes every shard that fills up; returns how many it wrote."""
        if tokens.size:
            self._chunks.append(tokens.astype(self.dtype, copy=False))
            self._ends.append(self.total_tokens + np.cumsum(lengths, dtype=np.uint64))
            self._pending += int(tokens.size)
        written = 0
        while self._pending >= self.shard_tokens:
            self._write_shard(self._take(self.shard_tokens))
            written += 1
        return written

    def finish(self) -> None:
        """Write the pending tokens as the last, shorter shard."""
        if self._pending:
            self._write_shard(self._take(self._pending))

    def _take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=self.dtype)
        filled = 0
        while filled < n:
            chunk = self._chunks.popleft()
            use = min(n - filled, chunk.size)
            out[filled : filled + use] = chunk[:use]
            if use < chunk.size:
                self._chunks.appendleft(chunk[use:])
            filled += use
        self._pending -= n
        return out

    def _write_shard(self, tokens: np.ndarray) -> None:
        first, last = self.tokens, self.tokens + tokens.size
        ends = np.concatenate(self._ends) if self._ends else np.zeros(0, DOC_DTYPE)
        cut = int(np.searchsorted(ends, last, side="right"))
        mine, rest = ends[:cut].astype(DOC_DTYPE), ends[cut:]
        self._ends = [rest] if rest.size else []
        tokens_name, docs_name = shard_names(self.split, len(self.shards))
        token_bytes, doc_bytes = tokens.tobytes(), mine.tobytes()
        storage.write_atomic(storage.join(self.directory, tokens_name), token_bytes)
        storage.write_atomic(storage.join(self.directory, docs_name), doc_bytes)
        self.shards.append(
            {
                "tokens_file": tokens_name,
                "docs_file": docs_name,
                "tokens": int(tokens.size),
                "documents": int(mine.size),
                "first_token": int(first),
                "sha256": hashlib.sha256(token_bytes).hexdigest(),
                "docs_sha256": hashlib.sha256(doc_bytes).hexdigest(),
            }
        )
        self.tokens = last
        self.documents += int(mine.size)

    # Resume: a tail is the pending tokens and their document ends, as two files.

    def save_tail(self, prefix: str) -> dict:
        tokens = np.concatenate(list(self._chunks)) if self._chunks else np.zeros(0, self.dtype)
        ends = np.concatenate(self._ends) if self._ends else np.zeros(0, DOC_DTYPE)
        names = {"tokens_file": f"{prefix}.tokens", "docs_file": f"{prefix}.docs"}
        storage.write_atomic(storage.join(self.directory, names["tokens_file"]), tokens.tobytes())
        storage.write_atomic(
            storage.join(self.directory, names["docs_file"]), ends.astype(DOC_DTYPE).tobytes()
        )
        return {**names, "tokens": int(tokens.size), "documents": int(ends.size)}

    def state(self) -> dict:
        return {"shards": list(self.shards), "tokens": self.tokens, "documents": self.documents}

    def restore(self, state: dict, tail: dict) -> None:
        """Take up a saved state: finished shards (checked by size) and the tail's pending tokens."""
        for shard in state["shards"]:
            for key, itemsize, count in (
                ("tokens_file", self.dtype.itemsize, shard["tokens"]),
                ("docs_file", DOC_DTYPE.itemsize, shard["documents"]),
            ):
                path = storage.join(self.directory, shard[key])
                if not storage.is_file(path) or storage.file_size(path) != itemsize * count:
                    raise DataError(f"{path}: missing or not {itemsize * count} bytes; cannot resume")
        self.shards = list(state["shards"])
        self.tokens, self.documents = int(state["tokens"]), int(state["documents"])
        tokens = _read_array(storage.join(self.directory, tail["tokens_file"]), self.dtype, tail["tokens"])
        ends = _read_array(storage.join(self.directory, tail["docs_file"]), DOC_DTYPE, tail["documents"])
        self._chunks = collections.deque([tokens] if tokens.size else [])
        self._pending = int(tokens.size)
        self._ends = [ends] if ends.size else []

    def summary(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents, "shards": list(self.shards)}


def _read_array(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    if not storage.is_file(path) or storage.file_size(path) != dtype.itemsize * count:
        raise DataError(f"{path}: missing or not {dtype.itemsize * count} bytes; cannot resume")
    return np.frombuffer(storage.read_bytes(path), dtype=dtype).copy()


# --------------------------------------------------------------------------- reading


def read_manifest(directory: str) -> dict:
    """A token directory's manifest, checked; DataError names what is wrong."""
    path = storage.join(directory, MANIFEST)
    if not storage.is_file(path):
        hint = " (a tokenize run still in progress? rerun it to finish)" if storage.is_dir(directory) else ""
        raise DataError(
            f"data.paths: {directory!r} has no {MANIFEST}{hint}; expected a directory written by "
            "`jaxtrain tokenize`"
        )
    try:
        manifest = json.loads(storage.read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format={manifest.get('format')!r}; expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: version={manifest.get('version')!r}; this jaxtrain reads version {VERSION}")
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise DataError(f"{path}: dtype={manifest.get('dtype')!r}; expected one of {list(TOKEN_DTYPES)}")
    return manifest


class TokenShards:
    """Random access to one split of a token directory, local (memory-mapped) or remote (ranged reads).

    Only the manifest is read up front; a shard is opened when first touched, and at
    most ``max_open`` stay open (least recently used closed first), so neither memory
    nor file handles grow with the corpus.
    """

    def __init__(self, directory: str, split: str = "train", *, max_open: int = 64):
        self.directory = os.fspath(directory)
        self.manifest = read_manifest(self.directory)
        info = self.manifest.get("splits", {}).get(split)
        if not info or not info.get("tokens"):
            raise DataError(f"data.paths: {self.directory!r} has no {split!r} tokens")
        self.split = split
        self.dtype = TOKEN_DTYPES[self.manifest["dtype"]]
        self.shard_tokens = int(self.manifest["shard_tokens"])
        self.shards = info["shards"]
        self.num_tokens = int(info["tokens"])
        self.num_documents = int(info["documents"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.eos_id = int(self.manifest["tokenizer"]["eos_id"])
        expected = sum(s["tokens"] for s in self.shards)
        if expected != self.num_tokens or any(
            s["first_token"] != i * self.shard_tokens for i, s in enumerate(self.shards)
        ):
            raise DataError(
                f"{self.directory}/{MANIFEST}: {split} shards do not add up to {self.num_tokens} tokens"
            )
        self.local = storage.is_local(self.directory)
        self.max_open = max_open
        self._open: collections.OrderedDict[int, tuple] = collections.OrderedDict()

    def _shard(self, i: int) -> tuple:
        """(tokens reader, doc ends array) of shard ``i``."""
        entry = self._open.get(i)
        if entry is not None:
            self._open.move_to_end(i)
            return entry
        shard = self.shards[i]
        tokens_path = storage.join(self.directory, shard["tokens_file"])
        docs_path = storage.join(self.directory, shard["docs_file"])
        for path, size in ((tokens_path, shard["tokens"] * self.dtype.itemsize),
                           (docs_path, shard["documents"] * DOC_DTYPE.itemsize)):  # fmt: skip
            if not storage.is_file(path):
                raise DataError(f"{path}: missing (listed in {MANIFEST})")
            if storage.file_size(path) != size:
                raise DataError(f"{path}: {storage.file_size(path)} bytes; {MANIFEST} says {size}")
        if self.local:
            tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r") if shard["tokens"] else None
            ends = (
                np.memmap(docs_path, dtype=DOC_DTYPE, mode="r")
                if shard["documents"]
                else np.zeros(0, DOC_DTYPE)
            )
        else:
            tokens = storage.open_read(tokens_path, random_access=True)
            ends = np.frombuffer(storage.read_bytes(docs_path), dtype=DOC_DTYPE)
        if len(self._open) >= self.max_open:
            _, (old, _) = self._open.popitem(last=False)
            if hasattr(old, "close"):
                old.close()
        self._open[i] = (tokens, ends)
        return tokens, ends

    def _read_from_shard(self, i: int, lo: int, hi: int) -> np.ndarray:
        tokens, _ = self._shard(i)
        if self.local:
            return np.asarray(tokens[lo:hi])
        tokens.seek(lo * self.dtype.itemsize)
        data = tokens.read((hi - lo) * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, stop)`` of the split (int32, ``0 <= start < stop <= num_tokens``) and
        the ends of documents strictly inside it (``start < e < stop``), as int64."""
        if not 0 <= start < stop <= self.num_tokens:
            raise DataError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        S = self.shard_tokens
        pieces, ends = [], []
        for i in range(start // S, (stop - 1) // S + 1):
            lo, hi = max(start, i * S), min(stop, (i + 1) * S)
            pieces.append(self._read_from_shard(i, lo - i * S, hi - i * S))
            shard_ends = self._shard(i)[1]
            a = np.searchsorted(shard_ends, start, side="right")
            b = np.searchsorted(shard_ends, stop, side="left")
            ends.append(np.asarray(shard_ends[a:b], dtype=np.int64))
        tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return tokens.astype(np.int32), np.concatenate(ends)

    def read_rows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[start, start + length)`` of the split, zero-padded past its end: tokens and
        document numbers (1, 2, ... within each row; 0 for padding), both int32 ``[rows, length]``.

        Rows inside one memory-mapped shard are gathered in one indexing operation per shard;
        the others (across a shard boundary, past the end, or remote) are read one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        tokens = np.zeros((starts.size, length), dtype=np.int32)
        doc_ids = np.zeros((starts.size, length), dtype=np.int32)
        S, offsets = self.shard_tokens, np.arange(length, dtype=np.int64)
        first, last = starts // S, (starts + length - 1) // S
        simple = (first == last) & (starts + length <= self.num_tokens) & self.local
        for shard in np.unique(first[simple]):
            rows = np.flatnonzero(simple & (first == shard))
            mapped, ends = self._shard(int(shard))
            positions = starts[rows, None] + offsets  # split-wide
            tokens[rows] = mapped[positions - shard * S]
            # uint64 on both sides: mixed signedness would make searchsorted convert `ends` whole
            below = np.searchsorted(ends, starts[rows].astype(np.uint64), side="right")
            doc_ids[rows] = (
                1 + np.searchsorted(ends, positions.astype(np.uint64), side="right") - below[:, None]
            )
        for r in np.flatnonzero(~simple):
            start, stop = int(starts[r]), min(int(starts[r]) + length, self.num_tokens)
            read, ends = self.read(start, stop)
            tokens[r, : read.size] = read
            doc_ids[r, : read.size] = 1 + np.searchsorted(ends, np.arange(start, stop), side="right")
        return tokens, doc_ids

    def verify(self) -> None:
        """Check every shard against the manifest's sizes and SHA-256 (reads the whole split)."""
        for shard in self.shards:
            for key, digest in (("tokens_file", "sha256"), ("docs_file", "docs_sha256")):
                path = storage.join(self.directory, shard[key])
                if not storage.is_file(path):
                    raise DataError(f"{path}: missing (listed in {MANIFEST})")
                h = hashlib.sha256()
                with storage.open_read(path) as f:
                    for block in iter(lambda: f.read(1 << 24), b""):
                        h.update(block)
                if h.hexdigest() != shard[digest]:
                    raise DataError(f"{path}: SHA-256 differs from {MANIFEST}; the shard is corrupt")

    def close(self) -> None:
        while self._open:
            _, (tokens, _) = self._open.popitem()
            if hasattr(tokens, "close"):
                tokens.close()
