"""The ``text`` source: raw text files tokenized when the run starts, held in memory.

For small corpora and tests; for anything larger, ``jaxtrain tokenize`` once and
``data.source: tokens`` (jaxtrain/data/tokens.py).
"""

from __future__ import annotations

import os

import numpy as np

from . import storage
from .core import DataError, DataIterator, batch_from_windows, check_int
from .documents import DocumentReader
from .tokenizers import load_tokenizer


def expand_paths(paths: tuple[str, ...] | list[str]) -> list[str]:
    """Files and glob patterns -> sorted, de-duplicated file list; a miss raises DataError."""
    if isinstance(paths, str):
        paths = (paths,)
    if not paths:
        raise DataError("data.paths=(): the 'text' source needs at least one file or glob")
    files: set[str] = set()
    for pattern in map(os.fspath, paths):
        if storage.has_glob(pattern):
            matches = storage.glob_files(pattern)
            if not matches:
                raise DataError(f"data.paths: glob {pattern!r} matches no files")
            files.update(matches)
        elif storage.is_file(pattern):
            files.add(pattern)
        else:
            raise DataError(f"data.paths: {pattern!r} does not exist or is not a file")
    return sorted(files)


def read_documents(path: str) -> list[str]:
    """A file's documents (see jaxtrain/data/documents.py): one per ``.jsonl`` line's
    ``"text"`` field or parquet row, else the whole file."""
    docs = [text for _, text in DocumentReader(path)]
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
        slots = self.local_slots(check_int("batch index", k, minimum=0))
        epochs, within = np.divmod(slots, self.num_windows)
        windows = np.empty_like(slots)
        for e in np.unique(epochs):
            sel = epochs == e
            windows[sel] = self.epoch_order(int(e))[within[sel]]
        index = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return batch_from_windows(self._stream[index], self._doc_ids[index])
