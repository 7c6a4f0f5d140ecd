"""Preference pairs for train.objective=dpo: batches of ``[pairs, 2, seq_len]`` from token
directories written by ``jaxtrain tokenize --preference`` (jaxtrain/data/preference.py).

Pair ``i`` of a directory is its documents ``2i`` (chosen) and ``2i + 1`` (rejected). A batch
row is one pair, never packed with another: each field is ``[local pairs, 2, seq_len]``,
index 0 the chosen sequence and 1 the rejected one, each as the ``tokens`` source lays out a
window holding a single document (``inputs`` / ``targets`` shifted by one, ``segment_ids`` 1
on the sequence and 0 on the padding after it, ``positions`` from 0), and ``loss_mask`` 1
exactly where the target is a response token. One pair per row keeps the log-probability of
each sequence a plain sum over its row and needs no per-segment bookkeeping; the price is the
padding of short pairs, which preference data (a long shared prompt, two responses) makes
modest. A sequence longer than ``seq_len + 1`` tokens is cut at the end (its first
``seq_len + 1`` tokens are kept: prompt first, as TRL's ``truncation_mode="keep_start"``);
a pair whose response was cut off entirely then has no response token and the loss leaves
it out (trainer/dpo.py).

Order, mixtures and resuming are the ``tokens`` source's (jaxtrain/data/tokens.py), with
pairs in place of windows: slot ``s`` of global batch ``k`` reads a pair chosen by the
mixture and the seeded Feistel permutation of each directory's pairs, so batch ``k`` is a
pure function of ``(seed, k)`` and the data, and the checkpointed position is ``k``.
"""

from __future__ import annotations

import numpy as np

from .core import DataError, batch_from_windows
from .tokens import Mixture, TokenIterator


class PairIterator(TokenIterator):
    """Batches of preference pairs (module docstring) over ``data.paths`` mixed by ``data.weights``
    (default: each directory's number of pairs)."""

    source = "tokens"

    def __init__(self, data_cfg, **kwargs):
        super().__init__(data_cfg, **kwargs)
        self.ends = [c.document_ends() for c in self.components]
        for comp, ends in zip(self.components, self.ends):
            if ends.size % 2:
                raise DataError(f"data.paths: {comp.directory!r} has an odd number of documents for pairs")
        self.num_windows = [max(1, ends.size // 2) for ends in self.ends]  # pairs: the unit of order
        if not tuple(getattr(data_cfg, "weights", ()) or ()):
            self.mixture = Mixture(self.num_windows)

    def _check_kind(self) -> None:
        for comp in self.components:
            if not comp.pairs:
                raise DataError(
                    f"data.paths: {comp.directory!r} holds no preference pairs; train.objective=dpo reads "
                    "directories written by `jaxtrain tokenize --preference`"
                )

    def _sequences(self, component: int, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Documents of one directory as windows of ``seq_len + 1`` tokens: (tokens, doc ids:
        1 on the document and 0 after it, mask), each ``[len(documents), seq_len + 1]``."""
        comp, ends, width = self.components[component], self.ends[component], self.seq_len + 1
        tokens = np.zeros((documents.size, width), np.int32)
        doc_ids = np.zeros((documents.size, width), np.int32)
        mask = np.zeros((documents.size, width), np.uint8)
        for r, d in enumerate(documents):
            start = int(ends[d - 1]) if d > 0 else 0
            stop = min(int(ends[d]), start + width)
            n = stop - start
            tokens[r, :n] = comp.read(start, stop)[0]
            doc_ids[r, :n] = 1
            mask[r, :n] = comp.read_mask(start, stop)
        return tokens, doc_ids, mask

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        components, pairs = self.windows(self.local_slots(k))
        width = self.seq_len + 1
        out = [
            (np.zeros((pairs.size, width), np.int32), np.zeros((pairs.size, width), np.int32),
             np.zeros((pairs.size, width), np.uint8))
            for _ in range(2)
        ]  # fmt: skip
        for c in np.unique(components):
            rows = np.flatnonzero(components == c)
            for which in range(2):  # 0 chosen, 1 rejected
                got = self._sequences(int(c), 2 * pairs[rows] + which)
                for field, value in zip(out[which], got):
                    field[rows] = value
        chosen, rejected = (batch_from_windows(*fields) for fields in out)
        return {key: np.stack([chosen[key], rejected[key]], axis=1) for key in chosen}
