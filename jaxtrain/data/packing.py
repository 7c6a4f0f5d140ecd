"""Rows of whole documents (``data.packing: documents``): which token range of a split each row reads.

Fixed windows of the stream cut a document wherever a window edge falls, so a conversation
that straddles an edge trains its second half without its question. Packing whole documents
instead (as MaxText, Levanter and torchtitan do for SFT) makes every row a run of consecutive
documents that fits ``width = seq_len + 1`` tokens, padded after the last one.

Greedy, in the split's order: a row takes documents while the next one still fits, then the
next row starts with the document that did not. A document longer than ``width`` gets a row of
its own holding its first ``width`` tokens (the rest is not trained on: counted in ``truncated``
and ``dropped_tokens``). Because the documents of a row are consecutive in the stream, a row is
one contiguous token range ``[start, start + length)``, ``length <= width``, read like a window.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedRows:
    starts: np.ndarray  # int64 [rows]: split-wide offset of the row's first token
    lengths: np.ndarray  # int64 [rows]: tokens in the row (<= width); the rest is padding
    documents: int  # documents packed
    truncated: int  # documents longer than width, cut to their first width tokens
    dropped_tokens: int  # tokens of those documents past their first width

    @property
    def num_rows(self) -> int:
        return int(self.starts.size)


def pack_documents(ends: np.ndarray, width: int) -> PackedRows:
    """Greedy rows of whole documents from the documents' end offsets (ascending, as in ``.docs``)."""
    ends = np.asarray(ends, dtype=np.int64)
    lengths = np.diff(ends, prepend=0).tolist()
    starts, sizes = [], []
    row_start, used, truncated, dropped, at = 0, 0, 0, 0, 0
    for n in lengths:
        if used and used + n > width:  # does not fit: close the row, this document opens the next
            starts.append(row_start)
            sizes.append(used)
            used = 0
        if not used:
            row_start = at
        if n > width:  # over-long: its head fills a row of its own
            starts.append(at)
            sizes.append(width)
            truncated, dropped, used = truncated + 1, dropped + n - width, 0
        else:
            used += n
        at += n
    if used:
        starts.append(row_start)
        sizes.append(used)
    return PackedRows(
        starts=np.asarray(starts, dtype=np.int64),
        lengths=np.asarray(sizes, dtype=np.int64),
        documents=len(lengths),
        truncated=truncated,
        dropped_tokens=dropped,
    )
