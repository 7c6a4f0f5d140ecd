"""Token shards on disk: the format `jaxtrain tokenize` writes and `data.source: tokens` reads.

A token directory holds, per split (``train``, and ``eval`` when some documents were
held out)::

    manifest.json            written last: its presence means the directory is complete
    tokenizer.json           a copy of the tokenizer (HF tokenizers only)
    train-00000.tokens       token ids, little-endian uint16 (vocab <= 65536) or uint32, no header
    train-00000.docs         uint64 little-endian: split-wide token offsets where documents end
    train-00000.mask         chat directories only (`jaxtrain tokenize --chat`): uint8 0/1 per token
    train-00001.tokens ...

A split is one stream of tokens: every document's ids followed by EOS (EOS belongs to
the document it ends), documents in input order. The stream is cut into shards of
exactly ``shard_tokens`` tokens (the last one shorter), regardless of document
boundaries, so token ``t`` of the split is at offset ``t % shard_tokens`` of shard
``t // shard_tokens``. A document ends at offset ``e`` when its EOS is token ``e - 1``;
each ``.docs`` file lists, in order, the ends that fall in its shard
(``first_token < e <= first_token + tokens``). A chat directory's ``.mask`` files hold one
byte per token at the same offsets, 1 where the token is trained on (the assistant's turns,
jaxtrain/data/chat.py), so a mask is read at exactly the positions of its tokens.

``manifest.json``::

    format "jaxtrain-tokens", version 1 (2 when the directory has masks, so that a reader
                                         that knows no masks refuses it)
    tokenizer {name, sha256, vocab_size, eos_id}
    dtype "uint16" | "uint32", shard_tokens
    text_field, separator, eval_fraction          how the documents were read and split
    inputs [{path, bytes}]                         what was read, in order
    chat null | {tokenizer_config_sha256, template_sha256, mask}   conversations, masked by
                                         "generation" blocks or by "role"; then every shard has a mask
    preference (version 3 only) {format "pairs", sequences, files_sha256, mask}: documents 2i
                                         and 2i + 1 are pair i's chosen and rejected sequences,
                                         the mask 1 on their responses (jaxtrain/data/preference.py)
    splits {train|eval: {tokens, documents, shards: [{tokens_file, docs_file, tokens,
            documents, first_token, sha256, docs_sha256[, mask_file, mask_sha256]}]}}

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
MASK_VERSION = 2  # a directory with masks: older readers, which would ignore them, refuse it
PAIR_VERSION = 3  # preference pairs (`tokenize --preference`): older readers would take them as text
MANIFEST = "manifest.json"
TOKENIZER_COPY = "tokenizer.json"
DOC_DTYPE = np.dtype("<u8")
MASK_DTYPE = np.dtype("u1")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "eval")


def token_dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_names(split: str, index: int) -> tuple[str, str]:
    return f"{split}-{index:05d}.tokens", f"{split}-{index:05d}.docs"


def mask_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.mask"


def _take(chunks: collections.deque, n: int, dtype: np.dtype) -> np.ndarray:
    """The first ``n`` elements of a queue of arrays, removed from it."""
    out = np.empty(n, dtype=dtype)
    filled = 0
    while filled < n:
        chunk = chunks.popleft()
        use = min(n - filled, chunk.size)
        out[filled : filled + use] = chunk[:use]
        if use < chunk.size:
            chunks.appendleft(chunk[use:])
        filled += use
    return out


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
    ``masked``: every token comes with a mask byte, written alongside as ``.mask`` files.
    """

    def __init__(self, directory: str, split: str, *, dtype: str, shard_tokens: int, masked: bool = False):
        self.directory, self.split = directory, split
        self.dtype = TOKEN_DTYPES[dtype]
        self.shard_tokens = shard_tokens
        self.masked = masked
        self._masks: collections.deque[np.ndarray] = collections.deque()
        self.shards: list[dict] = []
        self.tokens = 0  # in finished shards
        self.documents = 0  # whose ends are in finished shards
        self._chunks: collections.deque[np.ndarray] = collections.deque()
        self._pending = 0
        self._ends: list[np.ndarray] = []  # uint64 ends beyond the finished shards

    @property
    def total_tokens(self) -> int:
        return self.tokens + self._pending

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> int:
        """Append documents (``tokens`` already holds each one's ids and EOS; ``lengths``
        counts both; ``mask`` one 0/1 per token when ``masked``); writes every shard that
        fills up; returns how many it wrote."""
        if (mask is not None) != self.masked or (mask is not None and mask.shape != tokens.shape):
            raise DataError(
                f"SplitWriter({self.split!r}, masked={self.masked}): got mask "
                f"{None if mask is None else mask.shape} for {tokens.size} tokens"
            )
        if tokens.size:
            self._chunks.append(tokens.astype(self.dtype, copy=False))
            if mask is not None:
                self._masks.append(mask.astype(MASK_DTYPE, copy=False))
            self._ends.append(self.total_tokens + np.cumsum(lengths, dtype=np.uint64))
            self._pending += int(tokens.size)
        written = 0
        while self._pending >= self.shard_tokens:
            self._flush(self.shard_tokens)
            written += 1
        return written

    def finish(self) -> None:
        """Write the pending tokens as the last, shorter shard."""
        if self._pending:
            self._flush(self._pending)

    def _flush(self, n: int) -> None:
        """Write the first ``n`` pending tokens (and their mask) as the next shard."""
        tokens = _take(self._chunks, n, self.dtype)
        self._pending -= n
        if self.masked:
            self._write_shard(tokens, _take(self._masks, n, MASK_DTYPE))
        else:
            self._write_shard(tokens)

    def _write_shard(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        first, last = self.tokens, self.tokens + tokens.size
        ends = np.concatenate(self._ends) if self._ends else np.zeros(0, DOC_DTYPE)
        cut = int(np.searchsorted(ends, last, side="right"))
        mine, rest = ends[:cut].astype(DOC_DTYPE), ends[cut:]
        self._ends = [rest] if rest.size else []
        tokens_name, docs_name = shard_names(self.split, len(self.shards))
        token_bytes, doc_bytes = tokens.tobytes(), mine.tobytes()
        storage.write_atomic(storage.join(self.directory, tokens_name), token_bytes)
        storage.write_atomic(storage.join(self.directory, docs_name), doc_bytes)
        entry = {
            "tokens_file": tokens_name,
            "docs_file": docs_name,
            "tokens": int(tokens.size),
            "documents": int(mine.size),
            "first_token": int(first),
            "sha256": hashlib.sha256(token_bytes).hexdigest(),
            "docs_sha256": hashlib.sha256(doc_bytes).hexdigest(),
        }
        if mask is not None:
            entry["mask_file"] = mask_name(self.split, len(self.shards))
            mask_bytes = mask.tobytes()
            storage.write_atomic(storage.join(self.directory, entry["mask_file"]), mask_bytes)
            entry["mask_sha256"] = hashlib.sha256(mask_bytes).hexdigest()
        self.shards.append(entry)
        self.tokens = last
        self.documents += int(mine.size)

    # Resume: a tail is the pending tokens and their document ends (and mask), as two (three) files.

    def save_tail(self, prefix: str) -> dict:
        tokens = np.concatenate(list(self._chunks)) if self._chunks else np.zeros(0, self.dtype)
        ends = np.concatenate(self._ends) if self._ends else np.zeros(0, DOC_DTYPE)
        names = {"tokens_file": f"{prefix}.tokens", "docs_file": f"{prefix}.docs"}
        storage.write_atomic(storage.join(self.directory, names["tokens_file"]), tokens.tobytes())
        storage.write_atomic(
            storage.join(self.directory, names["docs_file"]), ends.astype(DOC_DTYPE).tobytes()
        )
        if self.masked:
            names["mask_file"] = f"{prefix}.mask"
            mask = np.concatenate(list(self._masks)) if self._masks else np.zeros(0, MASK_DTYPE)
            storage.write_atomic(storage.join(self.directory, names["mask_file"]), mask.tobytes())
        return {**names, "tokens": int(tokens.size), "documents": int(ends.size)}

    def state(self) -> dict:
        return {"shards": list(self.shards), "tokens": self.tokens, "documents": self.documents}

    def restore(self, state: dict, tail: dict) -> None:
        """Take up a saved state: finished shards (checked by size) and the tail's pending tokens."""
        for shard in state["shards"]:
            files = [
                ("tokens_file", self.dtype.itemsize, shard["tokens"]),
                ("docs_file", DOC_DTYPE.itemsize, shard["documents"]),
            ]
            if self.masked:
                files.append(("mask_file", MASK_DTYPE.itemsize, shard["tokens"]))
            for key, itemsize, count in files:
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
        if self.masked:
            mask = _read_array(storage.join(self.directory, tail["mask_file"]), MASK_DTYPE, tail["tokens"])
            self._masks = collections.deque([mask] if mask.size else [])

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
    if manifest.get("version") not in (VERSION, MASK_VERSION, PAIR_VERSION):
        raise DataError(
            f"{path}: version={manifest.get('version')!r}; this jaxtrain reads versions "
            f"{VERSION}, {MASK_VERSION} and {PAIR_VERSION}"
        )
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise DataError(f"{path}: dtype={manifest.get('dtype')!r}; expected one of {list(TOKEN_DTYPES)}")
    return manifest


class TokenShards:
    """Random access to one split of a token directory, local (memory-mapped) or remote (ranged reads).

    Only the manifest is read up front; a shard is opened when first touched, and at
    most ``max_open`` stay open (least recently used closed first), so neither memory
    nor file handles grow with the corpus. ``masked``: the split has mask files (chat data).
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
        # preference pairs (`tokenize --preference`): documents 2i, 2i + 1 are pair i's sequences
        self.pairs = self.manifest.get("preference") is not None
        self.masked = self.manifest.get("chat") is not None or self.pairs
        if self.masked and any("mask_file" not in s for s in self.shards):
            raise DataError(
                f"{self.directory}/{MANIFEST}: a chat directory whose {split} shards lack mask_file"
            )
        self.local = storage.is_local(self.directory)
        self.max_open = max_open
        self._open: collections.OrderedDict[int, tuple] = collections.OrderedDict()

    def _shard(self, i: int) -> tuple:
        """(tokens reader, doc ends array, mask reader or None) of shard ``i``."""
        entry = self._open.get(i)
        if entry is not None:
            self._open.move_to_end(i)
            return entry
        shard = self.shards[i]
        tokens_path = storage.join(self.directory, shard["tokens_file"])
        docs_path = storage.join(self.directory, shard["docs_file"])
        mask_path = storage.join(self.directory, shard["mask_file"]) if self.masked else None
        files = [(tokens_path, shard["tokens"] * self.dtype.itemsize),
                 (docs_path, shard["documents"] * DOC_DTYPE.itemsize)]  # fmt: skip
        if mask_path is not None:
            files.append((mask_path, shard["tokens"] * MASK_DTYPE.itemsize))
        for path, size in files:
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
            mask = np.memmap(mask_path, dtype=MASK_DTYPE, mode="r") if mask_path and shard["tokens"] else None
        else:
            tokens = storage.open_read(tokens_path, random_access=True)
            ends = np.frombuffer(storage.read_bytes(docs_path), dtype=DOC_DTYPE)
            mask = storage.open_read(mask_path, random_access=True) if mask_path else None
        if len(self._open) >= self.max_open:
            _, old = self._open.popitem(last=False)
            _close(old)
        self._open[i] = (tokens, ends, mask)
        return tokens, ends, mask

    def _read_from_shard(self, i: int, lo: int, hi: int, *, mask: bool = False) -> np.ndarray:
        """Tokens (or, with ``mask``, mask bytes) ``[lo, hi)`` of shard ``i``."""
        tokens, _, mask_reader = self._shard(i)
        reader, dtype = (mask_reader, MASK_DTYPE) if mask else (tokens, self.dtype)
        if self.local:
            return np.asarray(reader[lo:hi])
        reader.seek(lo * dtype.itemsize)
        data = reader.read((hi - lo) * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)

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

    def document_ends(self) -> np.ndarray:
        """Every document's end offset in the split (int64, ascending), from the .docs files."""
        ends = [
            np.frombuffer(storage.read_bytes(storage.join(self.directory, s["docs_file"])), dtype=DOC_DTYPE)
            for s in self.shards
        ]
        out = np.concatenate(ends).astype(np.int64) if ends else np.zeros(0, np.int64)
        if out.size != self.num_documents:
            raise DataError(
                f"{self.directory}: {out.size} document ends in the {self.split} .docs files; "
                f"{MANIFEST} says {self.num_documents}"
            )
        return out

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """Mask bytes ``[start, stop)`` of the split (all 1 when it has no masks), as uint8."""
        if not self.masked:
            return np.ones(stop - start, dtype=MASK_DTYPE)
        S = self.shard_tokens
        pieces = [
            self._read_from_shard(i, max(start, i * S) - i * S, min(stop, (i + 1) * S) - i * S, mask=True)
            for i in range(start // S, (stop - 1) // S + 1)
        ]
        return np.concatenate(pieces).astype(MASK_DTYPE)

    def read_rows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[start, start + length)`` of the split, zero-padded past its end: tokens and
        document numbers (1, 2, ... within each row; 0 for padding), both int32 ``[rows, length]``,
        and the mask (uint8: the mask files' bytes, all 1 without them; 0 for padding).

        Rows inside one memory-mapped shard are gathered in one indexing operation per shard;
        the others (across a shard boundary, past the end, or remote) are read one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        tokens = np.zeros((starts.size, length), dtype=np.int32)
        doc_ids = np.zeros((starts.size, length), dtype=np.int32)
        mask = np.zeros((starts.size, length), dtype=MASK_DTYPE)
        S, offsets = self.shard_tokens, np.arange(length, dtype=np.int64)
        first, last = starts // S, (starts + length - 1) // S
        simple = (first == last) & (starts + length <= self.num_tokens) & self.local
        for shard in np.unique(first[simple]):
            rows = np.flatnonzero(simple & (first == shard))
            mapped, ends, mask_mapped = self._shard(int(shard))
            positions = starts[rows, None] + offsets  # split-wide
            tokens[rows] = mapped[positions - shard * S]
            mask[rows] = mask_mapped[positions - shard * S] if self.masked else 1
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
            mask[r, : read.size] = self.read_mask(start, stop)
        return tokens, doc_ids, mask

    def verify(self) -> None:
        """Check every shard against the manifest's sizes and SHA-256 (reads the whole split)."""
        files = [("tokens_file", "sha256"), ("docs_file", "docs_sha256")]
        if self.masked:
            files.append(("mask_file", "mask_sha256"))
        for shard in self.shards:
            for key, digest in files:
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
            _close(self._open.popitem()[1])


def _close(entry: tuple) -> None:
    """Close an open shard's readers (remote files; memory maps close when dropped)."""
    for reader in entry:
        if hasattr(reader, "close"):
            reader.close()
