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

Chat data: ``encode_chat(messages, tokenizer_dir)`` renders a Hugging Face chat template and
returns ``(ids, mask)``, mask 1 on the assistant's tokens (chat.py); ``jaxtrain tokenize --chat``
writes such conversations as token directories with a mask, and the ``tokens`` source then
counts the loss only where the mask is 1.

Preference pairs (train.objective=dpo): ``jaxtrain tokenize --preference`` writes
``{"prompt", "chosen", "rejected"}`` rows as two sequences each (preference.py), and
``make_data_iterator(..., pairs=True)`` yields one pair per row, every field ``[local_batch_size,
2, seq_len]`` (index 0 chosen), ``loss_mask`` 1 on the response tokens (pairs.py).

Sources (``data.source``): ``synthetic`` (core.py), ``text`` (raw files tokenized at
start, text.py) and ``tokens`` (token directories written by ``jaxtrain tokenize``,
memory-mapped or read by range, mixed by ``data.weights``: tokens.py, shards.py,
tokenize.py). Every file access goes through storage.py (local paths and ``gs://``).

This package is numpy-only: it never imports jax.
"""

from __future__ import annotations

import types

from .chat import ChatEncoder, encode_chat
from .core import DataError, DataIterator, SyntheticIterator
from .pairs import PairIterator
from .text import TextIterator, expand_paths, read_documents
from .tokenizers import BYTE_EOS_ID, EOS_TOKEN_CANDIDATES, ByteTokenizer, HFTokenizer, load_tokenizer
from .tokens import TokenIterator

__all__ = [
    "ChatEncoder",
    "DataError",
    "DataIterator",
    "encode_chat",
    "SyntheticIterator",
    "TextIterator",
    "TokenIterator",
    "PairIterator",
    "make_data_iterator",
    "make_eval_iterator",
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
    pairs: bool = False,
) -> DataIterator:
    """Build the iterator for ``data_cfg.source`` (``"synthetic"``, ``"text"`` or ``"tokens"``);
    ``pairs``: preference pairs (train.objective=dpo), from ``tokens`` directories only."""
    kwargs = dict(
        vocab_size=vocab_size,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    source = getattr(data_cfg, "source", None)
    if pairs:
        if source != "tokens":
            raise DataError(
                f"data.source={source!r}: preference pairs come from data.source=tokens (directories "
                "written by `jaxtrain tokenize --preference`)"
            )
        return PairIterator(data_cfg, **kwargs)
    if source == "synthetic":
        return SyntheticIterator(**kwargs)
    if source == "text":
        return TextIterator(data_cfg, **kwargs)
    if source == "tokens":
        return TokenIterator(data_cfg, **kwargs)
    raise DataError(f"data.source={source!r}: expected one of {', '.join(SOURCES)}")


def _has_split(directory: str, split: str) -> bool:
    from .shards import read_manifest

    info = read_manifest(directory).get("splits", {}).get(split) or {}
    return bool(info.get("tokens"))


def make_eval_iterator(
    data_cfg,
    eval_paths=(),
    *,
    vocab_size: int,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> DataIterator:
    """The held-out data of ``eval.*``: batch ``k`` is a pure function of ``(seed, k)`` and the
    data, so batches ``0 .. eval.batches - 1`` are the same at every evaluation.

    - ``tokens``: ``eval_paths`` (token directories: each one's ``eval`` split if it has one,
      else its ``train`` split, e.g. a held-out corpus tokenized with no ``--eval-fraction``),
      or, with none, the ``eval`` split of every ``data.paths`` directory, mixed by
      ``data.weights`` as for training;
    - ``text``: the held-out files ``eval_paths`` (required: text has no split);
    - ``synthetic``: stream 1 of the generator (training reads stream 0); no paths.
    """
    kwargs = dict(
        vocab_size=vocab_size,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    eval_paths = (eval_paths,) if isinstance(eval_paths, str) else tuple(eval_paths)
    source = getattr(data_cfg, "source", None)
    if source == "synthetic":
        if eval_paths:
            raise DataError(
                f"eval.paths={list(eval_paths)}: data.source=synthetic evaluates on a held-out "
                "synthetic stream; eval.paths is for the text and tokens sources"
            )
        return SyntheticIterator(stream=1, **kwargs)
    if source == "text":
        if not eval_paths:
            raise DataError(
                "eval.paths=[]: data.source=text has no eval split; give held-out text files in "
                "eval.paths (or `jaxtrain tokenize --eval-fraction F` and data.source=tokens)"
            )
        return TextIterator(_with_paths(data_cfg, eval_paths), **kwargs)
    if source == "tokens":
        return _eval_tokens(data_cfg, eval_paths, kwargs)
    raise DataError(f"data.source={source!r}: expected one of {', '.join(SOURCES)}")


def _with_paths(data_cfg, paths, weights=()):
    """data_cfg's settings with other paths (and mixture weights)."""
    return types.SimpleNamespace(
        source=getattr(data_cfg, "source", None),
        paths=tuple(paths),
        tokenizer=getattr(data_cfg, "tokenizer", "byte"),
        shuffle=bool(getattr(data_cfg, "shuffle", True)),
        weights=tuple(weights),
        packing=getattr(data_cfg, "packing", "by_directory"),
    )


def _eval_tokens(data_cfg, eval_paths: tuple, kwargs: dict) -> DataIterator:
    """Token directories' eval data (make_eval_iterator's `tokens` case)."""
    if eval_paths:
        splits = tuple("eval" if _has_split(p, "eval") else "train" for p in eval_paths)
        return TokenIterator(_with_paths(data_cfg, eval_paths), split=splits, **kwargs)
    paths = tuple(data_cfg.paths) if not isinstance(data_cfg.paths, str) else (data_cfg.paths,)
    for p in paths:
        if not _has_split(p, "eval"):
            raise DataError(
                f"eval: data.paths {p!r} has no eval split (tokenized with --eval-fraction 0); "
                "rerun `jaxtrain tokenize` with --eval-fraction F, or set eval.paths to "
                "held-out token directories"
            )
    weights = getattr(data_cfg, "weights", ()) or ()
    return TokenIterator(_with_paths(data_cfg, paths, weights), split="eval", **kwargs)
