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

Sources (``data.source``): ``synthetic`` (core.py), ``text`` (raw files tokenized at
start, text.py) and ``tokens`` (token directories written by ``jaxtrain tokenize``,
memory-mapped or read by range, mixed by ``data.weights``: tokens.py, shards.py,
tokenize.py). Every file access goes through storage.py (local paths and ``gs://``).

This package is numpy-only: it never imports jax.
"""

from __future__ import annotations

from .core import DataError, DataIterator, SyntheticIterator
from .text import TextIterator, expand_paths, read_documents
from .tokenizers import BYTE_EOS_ID, EOS_TOKEN_CANDIDATES, ByteTokenizer, HFTokenizer, load_tokenizer
from .tokens import TokenIterator

__all__ = [
    "DataError",
    "DataIterator",
    "SyntheticIterator",
    "TextIterator",
    "TokenIterator",
    "make_data_iterator",
    "load_tokenizer",
    "expand_paths",
    "read_documents",
    "ByteTokenizer",
    "HFTokenizer",
    "BYTE_EOS_ID",
    "EOS_TOKEN_CANDIDATES",
    "SOURCES",
]

SOURCES = ("synthetic", "text", "tokens")


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
    """Build the iterator for ``data_cfg.source`` (``"synthetic"``, ``"text"`` or ``"tokens"``)."""
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
    if source == "tokens":
        return TokenIterator(data_cfg, **kwargs)
    raise DataError(f"data.source={source!r}: expected one of {', '.join(SOURCES)}")
