"""Data pipeline: deterministic, resumable batches of packed token windows.

Determinism (Levanter-style): global batch ``k`` is a pure function of
``(seed, k)`` and the data, so an iterator's whole position is the integer
``k`` (``get_state() == {"source": ..., "batch": k}``) and ``set_state`` is
O(1): nothing is replayed. Every process computes only its own rows
``[p*B/P, (p+1)*B/P)`` of the same global batch, so the loss does not depend on
how many processes share it.

Each batch is a dict of numpy arrays, all ``[local_batch_size, seq_len]``:
``inputs``/``targets`` (int32, ``targets[:, t]`` is the token after
``inputs[:, t]``), ``segment_ids`` (int32, document within the row from 1,
0 = padding), ``positions`` (int32, restart at 0 at each segment start) and
``loss_mask`` (float32, 1 where the target is the next token of the same
document).

This module is numpy-only: it never imports jax.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

__all__ = [
    "DataError",
    "DataIterator",
    "SyntheticIterator",
    "TextIterator",
    "make_data_iterator",
    "load_tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "BYTE_EOS_ID",
    "EOS_TOKEN_CANDIDATES",
]

BYTE_EOS_ID = 256
EOS_TOKEN_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
SYNTHETIC_STRIDES = np.arange(1, 9)  # strides 1..8
_GLOB_CHARS = frozenset("*?[")


class DataError(ValueError):
    """Bad data or data arguments; the message names the path/key, value and expectation."""


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; EOS = 256."""

    name = "byte"
    eos_id = BYTE_EOS_ID

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file; special tokens (BOS etc.) are not added."""

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError as e:  # pragma: no cover - tokenizers is a dev dependency
            raise DataError(
                f"data.tokenizer={path!r} needs the `tokenizers` package; install it or use 'byte'"
            ) from e
        if not os.path.isfile(path):
            raise DataError(
                f"data.tokenizer={path!r}: no such file; expected 'byte' or a tokenizers JSON file"
            )
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise DataError(f"data.tokenizer={path!r}: not a tokenizers JSON file ({e})") from e
        self.name = path
        for token in EOS_TOKEN_CANDIDATES:
            eos = self._tok.token_to_id(token)
            if eos is not None:
                self.eos_id = int(eos)
                break
        else:
            raise DataError(
                f"data.tokenizer={path!r} has no end-of-text token; expected one of "
                f"{list(EOS_TOKEN_CANDIDATES)}"
            )

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def load_tokenizer(spec: str, *, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a path to a tokenizers JSON file; checks the EOS id fits the model."""
    if spec == "byte":
        if vocab_size < BYTE_EOS_ID + 1:
            raise DataError(
                f"model.vocab_size={vocab_size} is too small for data.tokenizer='byte'; "
                f"expected >= {BYTE_EOS_ID + 1} (256 bytes + EOS)"
            )
        return ByteTokenizer()
    tok = HFTokenizer(spec)
    if tok.eos_id >= vocab_size:
        raise DataError(f"data.tokenizer={spec!r}: EOS id {tok.eos_id} >= model.vocab_size={vocab_size}")
    return tok


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"{name}={value!r}: expected an int >= {minimum}")
    if value < minimum:
        raise DataError(f"{name}={value}: expected >= {minimum}")
    return int(value)


def _batch_from_windows(tokens: np.ndarray, doc_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Windows of ``seq_len + 1`` tokens -> a batch.

    ``doc_ids`` has the same shape as ``tokens``: a non-decreasing document number per
    token, 0 for padding (padding only at a row's end). A target counts (loss_mask 1)
    when its token belongs to the same document as the input token.
    """
    in_docs, tgt_docs = doc_ids[:, :-1], doc_ids[:, 1:]
    seq_len = in_docs.shape[1]
    real = in_docs > 0
    starts = np.ones_like(real)
    starts[:, 1:] = in_docs[:, 1:] != in_docs[:, :-1]
    t = np.arange(seq_len, dtype=np.int32)
    start_index = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "segment_ids": np.where(real, np.cumsum(starts, axis=1), 0).astype(np.int32),
        "positions": np.where(real, t - start_index, 0).astype(np.int32),
        "loss_mask": (real & (in_docs == tgt_docs)).astype(np.float32),
    }


# --------------------------------------------------------------------------- iterators


class DataIterator:
    """Base: tracks the global batch index ``k``; subclasses build batch ``k``'s local rows."""

    source = "base"

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.vocab_size = _check_int("model.vocab_size", vocab_size, minimum=2)
        self.seq_len = _check_int("seq_len", seq_len, minimum=1)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, minimum=1)
        # default_rng rejects negative seed entries.
        self.seed = _check_int("seed", seed, minimum=0)
        self.process_count = _check_int("process_count", process_count, minimum=1)
        self.process_index = _check_int("process_index", process_index, minimum=0)
        if self.process_index >= self.process_count:
            raise DataError(f"process_index={process_index}: expected < process_count={process_count}")
        if self.global_batch_size % self.process_count:
            raise DataError(
                f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}"
            )
        self.local_batch_size = self.global_batch_size // self.process_count
        self.row_start = self.process_index * self.local_batch_size
        self._batch = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self._batch)
        self._batch += 1
        return batch

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``k``, without moving the iterator."""
        raise NotImplementedError

    def get_state(self) -> dict:
        return {"source": self.source, "batch": self._batch}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "batch" not in state:
            raise DataError(f"data state={state!r}: expected a dict with key 'batch'")
        unknown = set(state) - {"source", "batch"}
        if unknown:
            raise DataError(f"data state has unknown keys {sorted(unknown)}; expected only 'source', 'batch'")
        if state.get("source", self.source) != self.source:
            raise DataError(
                f"data state source={state['source']!r} does not match this iterator's "
                f"data.source={self.source!r}"
            )
        self._batch = _check_int("data state 'batch'", state["batch"], minimum=0)


class SyntheticIterator(DataIterator):
    """Rows are arithmetic progressions mod ``vocab_size``.

    Global batch ``k`` draws, with ``np.random.default_rng([seed, k])``, a start
    uniform in ``[0, vocab_size)`` and a stride uniform in ``{1, ..., 8}`` for each of
    its ``global_batch_size`` rows; row tokens are ``(start + stride * t) % vocab_size``
    for ``t = 0..seq_len``. The next token is determined by the previous two, so a tiny
    model's loss falls quickly from ``log(vocab_size)``. One document per row:
    ``segment_ids`` all 1, ``positions`` ``0..seq_len-1``, ``loss_mask`` all 1.
    """

    source = "synthetic"

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        k = _check_int("batch index", k, minimum=0)
        rng = np.random.default_rng([self.seed, k])
        # Draw the whole global batch so row r is the same for any process count.
        starts = rng.integers(0, self.vocab_size, size=self.global_batch_size, dtype=np.int64)
        strides = rng.choice(SYNTHETIC_STRIDES, size=self.global_batch_size)
        rows = slice(self.row_start, self.row_start + self.local_batch_size)
        t = np.arange(self.seq_len + 1, dtype=np.int64)
        tokens = (starts[rows, None] + strides[rows, None] * t) % self.vocab_size
        return _batch_from_windows(tokens, np.ones_like(tokens, dtype=np.int32))


def expand_paths(paths: tuple[str, ...] | list[str]) -> list[str]:
    """Files and glob patterns -> sorted, de-duplicated file list; a miss raises DataError."""
    if isinstance(paths, str):
        paths = (paths,)
    if not paths:
        raise DataError("data.paths=(): the 'text' source needs at least one file or glob")
    files: set[str] = set()
    for pattern in map(os.fspath, paths):
        if _GLOB_CHARS & set(pattern):
            matches = [m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise DataError(f"data.paths: glob {pattern!r} matches no files")
            files.update(matches)
        elif os.path.isfile(pattern):
            files.add(pattern)
        else:
            raise DataError(f"data.paths: {pattern!r} does not exist or is not a file")
    return sorted(files)


def read_documents(path: str) -> list[str]:
    """One document per file, or one per line's ``"text"`` field in a ``.jsonl`` file."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:  # keep \r as is
        content = f.read()
    if path.endswith(".jsonl"):
        docs = []
        for lineno, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string 'text' field")
            if record["text"]:
                docs.append(record["text"])
    else:
        docs = [content] if content else []
    if not docs:
        raise DataError(f"data.paths: {path!r} is empty; expected at least one non-empty document")
    return docs


class TextIterator(DataIterator):
    """Packed windows over local text files.

    The files' documents (see ``read_documents``) are tokenized once, each followed by
    EOS, and joined into one stream; EOS belongs to the document it ends. Window ``i``
    is ``stream[i*seq_len : i*seq_len + seq_len + 1]`` (the last one zero-padded), for
    ``n_windows = max(1, ceil((len(stream) - 1) / seq_len))``. Epoch ``e`` visits
    windows in the order ``default_rng([seed, e]).permutation(n_windows)`` (identity
    without shuffle); global batch ``k`` takes slots ``[k*B, (k+1)*B)`` of the epochs'
    orders laid end to end, so batches cross epoch boundaries seamlessly.

    A document that continues from the previous window restarts ``positions`` at 0
    (positions count within the row's segment, which is all attention can see).
    """

    source = "text"

    def __init__(
        self,
        data_cfg,
        *,
        vocab_size: int,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        super().__init__(
            vocab_size=vocab_size,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )
        self.shuffle = bool(data_cfg.shuffle)
        self.tokenizer = load_tokenizer(data_cfg.tokenizer, vocab_size=self.vocab_size)
        self.paths = expand_paths(data_cfg.paths)

        pieces, doc_pieces = [], []
        eos = np.array([self.tokenizer.eos_id], dtype=np.int32)
        n_docs = 0
        for path in self.paths:
            for ids in self.tokenizer.encode_batch(read_documents(path)):
                if ids.size and ids.max() >= self.vocab_size:
                    raise DataError(
                        f"data.tokenizer={self.tokenizer.name!r} produced token id {int(ids.max())} "
                        f"in {path!r}; expected ids < model.vocab_size={self.vocab_size}"
                    )
                n_docs += 1
                pieces += [ids.astype(np.int32), eos]
                doc_pieces.append(np.full(ids.size + 1, n_docs, dtype=np.int32))
        self.num_documents = n_docs
        stream, doc_ids = np.concatenate(pieces), np.concatenate(doc_pieces)
        self.num_tokens = int(stream.size)
        self.num_windows = max(1, -(-(stream.size - 1) // self.seq_len))
        # Pad so every window slice is in bounds; padding has doc id 0.
        padded = self.num_windows * self.seq_len + 1
        self._stream = np.zeros(padded, dtype=np.int32)
        self._stream[: stream.size] = stream
        self._doc_ids = np.zeros(padded, dtype=np.int32)
        self._doc_ids[: doc_ids.size] = doc_ids
        self._epoch_orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Window indices in the order epoch ``epoch`` visits them."""
        order = self._epoch_orders.get(epoch)
        if order is None:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                order = np.arange(self.num_windows)
            if len(self._epoch_orders) >= 2:  # a batch spans at most a few epochs in practice
                self._epoch_orders.pop(next(iter(self._epoch_orders)))
            self._epoch_orders[epoch] = order
        return order

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        k = _check_int("batch index", k, minimum=0)
        first = k * self.global_batch_size + self.row_start
        slots = np.arange(first, first + self.local_batch_size)
        epochs, within = np.divmod(slots, self.num_windows)
        windows = np.empty_like(slots)
        for e in np.unique(epochs):
            sel = epochs == e
            windows[sel] = self.epoch_order(int(e))[within[sel]]
        index = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return _batch_from_windows(self._stream[index], self._doc_ids[index])


def make_data_iterator(
    data_cfg,
    *,
    vocab_size: int,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> DataIterator:
    """Build the iterator for ``data_cfg.source`` (``"synthetic"`` or ``"text"``)."""
    kwargs = dict(
        vocab_size=vocab_size,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    source = getattr(data_cfg, "source", None)
    if source == "synthetic":
        return SyntheticIterator(**kwargs)
    if source == "text":
        return TextIterator(data_cfg, **kwargs)
    raise DataError(f"data.source={source!r}: expected 'synthetic' or 'text'")
