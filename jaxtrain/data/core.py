"""What every data source shares: the error type, argument checks, the iterator base
(batch ``k`` is a pure function of ``(seed, k)``), packing windows into a batch, and
the synthetic source."""

from __future__ import annotations

from typing import Any

import numpy as np

SYNTHETIC_STRIDES = np.arange(1, 9)  # strides 1..8


class DataError(ValueError):
    """Bad data or data arguments; the message names the path/key, value and expectation."""


def check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"{name}={value!r}: expected an int >= {minimum}")
    if value < minimum:
        raise DataError(f"{name}={value}: expected >= {minimum}")
    return int(value)


def batch_from_windows(
    tokens: np.ndarray, doc_ids: np.ndarray, mask: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Windows of ``seq_len + 1`` tokens -> a batch.

    ``doc_ids`` has the same shape as ``tokens``: a non-decreasing document number per
    token, 0 for padding (padding only at a row's end). A target counts (loss_mask 1)
    when its token belongs to the same document as the input token and, given ``mask``
    (same shape, 0/1 per token: chat data's assistant tokens), when the target's mask is 1.
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
        "loss_mask": (real & (in_docs == tgt_docs) & (True if mask is None else mask[:, 1:] > 0)).astype(
            np.float32
        ),
    }


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
        self.vocab_size = check_int("model.vocab_size", vocab_size, minimum=2)
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        self.global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        # default_rng rejects negative seed entries.
        self.seed = check_int("seed", seed, minimum=0)
        self.process_count = check_int("process_count", process_count, minimum=1)
        self.process_index = check_int("process_index", process_index, minimum=0)
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

    def local_slots(self, k: int) -> np.ndarray:
        """The global row slots ``k*B + row_start + [0, B/P)`` this process reads for batch ``k``."""
        k = check_int("batch index", k, minimum=0)
        first = k * self.global_batch_size + self.row_start
        return np.arange(first, first + self.local_batch_size, dtype=np.int64)

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
        self._batch = check_int("data state 'batch'", state["batch"], minimum=0)


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

    def __init__(self, *, stream: int = 0, **kwargs):
        super().__init__(**kwargs)
        # stream > 0: another sequence of batches from the same seed (held-out eval data).
        self.stream = check_int("stream", stream, minimum=0)

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        k = check_int("batch index", k, minimum=0)
        rng = np.random.default_rng([self.seed, k] if self.stream == 0 else [self.seed, k, self.stream])
        # Draw the whole global batch so row r is the same for any process count.
        starts = rng.integers(0, self.vocab_size, size=self.global_batch_size, dtype=np.int64)
        strides = rng.choice(SYNTHETIC_STRIDES, size=self.global_batch_size)
        rows = slice(self.row_start, self.row_start + self.local_batch_size)
        t = np.arange(self.seq_len + 1, dtype=np.int64)
        tokens = (starts[rows, None] + strides[rows, None] * t) % self.vocab_size
        return batch_from_windows(tokens, np.ones_like(tokens, dtype=np.int32))
