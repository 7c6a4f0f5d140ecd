"""The ``tokens`` source: packed windows over token directories (`jaxtrain tokenize`),
optionally a weighted mixture of several.

Windows. Component ``c`` (one directory in ``data.paths``) is the ``train`` split's
token stream of ``N_c`` tokens (jaxtrain/data/shards.py). Its window ``i`` is tokens
``[i*L, i*L + L + 1)`` for ``L = seq_len`` (the last one zero-padded, padding outside
every document), for ``n_c = max(1, ceil((N_c - 1) / L))`` windows, exactly as the
``text`` source packs; segment ids and positions restart at every document start.

Order. Global batch ``k`` is global row slots ``s = k*B .. k*B + B - 1``; each process
reads only its rows ``[p*B/P, (p+1)*B/P)``, so the global batch is the same for any
process count. Slot ``s`` goes to component ``c`` as its ``j``-th visit (`Mixture`); visit
``j`` is position ``q = j mod n_c`` of epoch ``e = j // n_c``, and reads window
``feistel_permutation(q, n_c, round_keys(seed, c, e))`` (``q`` itself with
``data.shuffle: false``). A Feistel network is a bijection computed per index, so
shuffling needs no index in memory, and each epoch visits every window once in a fresh
order. Batch ``k`` is a pure function of ``(seed, k)`` and the data: the checkpointed
position is ``{"source": "tokens", "batch": k}`` and resuming reads nothing twice.

Chat directories (`jaxtrain tokenize --chat`) carry a mask per token at the same positions:
a target counts in the loss only where its mask is 1 (the assistant's tokens), read with the
window's tokens, so the position ``k`` covers masks too. A conversation is one document, so
packing gives it a segment of its own and attention never crosses into its neighbours.
Directories without masks mixed with chat ones count every target, as before.

Rows of whole documents (``data.packing``: ``documents``, or ``by_directory`` on a chat directory).
Windows would cut a conversation at every window edge, its second half trained without its
question; such a component's unit is instead a row of whole documents packed greedily in order
(jaxtrain/data/packing.py), ``n_c`` its number of rows. Rows are contiguous token ranges, read
as windows are and padded after their last document; shuffling, mixtures, processes and the
checkpointed ``k`` are the same with rows in place of windows.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .core import DataError, DataIterator, batch_from_windows, check_int
from .packing import PackedRows, pack_documents
from .shards import TokenShards

log = logging.getLogger(__name__)
PACKINGS = ("by_directory", "windows", "documents")  # data.packing (jaxtrain/config.py checks it too)

_FEISTEL_ROUNDS = 4
_MIX_BITS = 32  # mixture fractions are multiples of 2**-32


def round_keys(seed: int, component: int, epoch: int) -> np.ndarray:
    """The Feistel round keys of one component's epoch: 4 uint64 from NumPy's SeedSequence."""
    return np.random.SeedSequence([seed, component, epoch]).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _round_function(r: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    # SplitMix64's finalizer on (r xor key): a well-mixed 64-bit hash, cut to the half width.
    h = r ^ key
    h = (h ^ (h >> _S30)) * _M1
    h = (h ^ (h >> _S27)) * _M2
    return (h ^ (h >> _S31)) & mask


def feistel_permutation(index, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of ``[0, n)``, evaluated at ``index`` (an int or array of them).

    Balanced Feistel network over ``2h``-bit numbers, ``h = max(1, ceil(bits(n - 1) / 2))``:
    split ``x`` into high and low halves ``(l, r)``; each round ``(l, r) <- (r, l xor
    F(r, key))`` with ``F`` SplitMix64's finalizer of ``r xor key`` masked to ``h`` bits;
    rejoin. That permutes ``[0, 4**h)``; values ``>= n`` are encrypted again (cycle
    walking) until they land in ``[0, n)``, which makes it a permutation of ``[0, n)``
    (``4**h < 4n``, so fewer than 4 passes are expected).
    """
    n = check_int("n", n, minimum=1)
    x = np.asarray(index, dtype=np.uint64)
    if np.any(x >= n):
        raise DataError(f"feistel_permutation: index >= n={n}")
    if n == 1:
        return np.zeros(x.shape, dtype=np.int64)
    half = max(1, math.ceil((n - 1).bit_length() / 2))
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    keys = np.asarray(keys, dtype=np.uint64)

    def encrypt(v: np.ndarray) -> np.ndarray:
        l, r = v >> shift, v & mask
        for key in keys:
            l, r = r, l ^ _round_function(r, key, mask)
        return (l << shift) | r

    with np.errstate(over="ignore"):
        y = encrypt(x.reshape(-1))
        outside = y >= n
        while outside.any():
            y[outside] = encrypt(y[outside])
            outside = y >= n
    return y.astype(np.int64).reshape(x.shape)


class Mixture:
    """Which component row slot ``s`` reads, and which visit of it that is: deterministic,
    stateless, O(number of components) per slot.

    Components are split off one at a time (stride scheduling, as Bresenham's line): with
    weights normalized to ``w``, level ``c`` receives the fraction ``f_c = w_c / (w_c +
    ... + w_last)`` of the slots that reach it, as the integer ``p_c = round(f_c * 2**32)``.
    Slot ``r`` (numbered among the slots reaching level ``c``) belongs to ``c`` when
    ``floor((r+1) p_c / 2**32) > floor(r p_c / 2**32)``; it is then visit
    ``floor(r p_c / 2**32)`` of ``c``, else slot ``r - floor(r p_c / 2**32)`` of level
    ``c + 1``. So among the first ``n`` slots component 0 gets exactly
    ``floor(n p_0 / 2**32)``, and every component's count is within ``c + 1`` slots of
    ``n * w_c`` (plus ``n * 2**-32`` rounding); each component's visits are numbered
    0, 1, 2, ... with no gap or repeat.
    """

    def __init__(self, weights: list[float] | tuple[float, ...]):
        w = [float(x) for x in weights]
        if not w or any(not math.isfinite(x) or x <= 0 for x in w):
            raise DataError(f"data.weights={list(weights)}: expected positive, finite numbers")
        self.weights = [x / sum(w) for x in w]
        self._p = []
        for c in range(len(w) - 1):
            fraction = w[c] / sum(w[c:])
            self._p.append(min(max(1, round(fraction * 2**_MIX_BITS)), 2**_MIX_BITS))

    def assign(self, slot: int) -> tuple[int, int]:
        """``(component, visit)`` of global row slot ``slot``."""
        r = int(slot)
        for c, p in enumerate(self._p):
            before, after = (r * p) >> _MIX_BITS, ((r + 1) * p) >> _MIX_BITS
            if after > before:
                return c, before
            r -= before
        return len(self._p), r


class TokenIterator(DataIterator):
    """Batches over token directories ``data.paths`` mixed by ``data.weights`` (module docstring).

    Without weights, each directory weighs its number of tokens (as if they were one corpus).
    """

    source = "tokens"

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
        split: str | tuple[str, ...] = "train",
    ):
        super().__init__(
            vocab_size=vocab_size,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )
        paths = tuple(data_cfg.paths) if not isinstance(data_cfg.paths, str) else (data_cfg.paths,)
        if not paths:
            raise DataError("data.paths=(): data.source=tokens needs at least one token directory")
        self.shuffle = bool(data_cfg.shuffle)
        # One split for every directory, or one per directory (eval.paths: see make_eval_iterator).
        splits = (split,) * len(paths) if isinstance(split, str) else tuple(split)
        if len(splits) != len(paths):
            raise DataError(f"split={split!r}: expected one split per data.paths entry ({len(paths)})")
        self.components = [TokenShards(p, s) for p, s in zip(paths, splits)]
        first = self.components[0]
        for comp in self.components:
            tok = comp.manifest["tokenizer"]
            if tok["sha256"] != first.manifest["tokenizer"]["sha256"]:
                raise DataError(
                    f"data.paths: {comp.directory!r} was tokenized with {tok['name']!r}, "
                    f"{first.directory!r} with {first.manifest['tokenizer']['name']!r}; "
                    "expected one tokenizer for all"
                )
            if comp.vocab_size > self.vocab_size:
                raise DataError(
                    f"data.paths: {comp.directory!r} has tokenizer vocab size {comp.vocab_size} > "
                    f"model.vocab_size={self.vocab_size}; expected ids < model.vocab_size"
                )
        self._check_kind()
        self.eos_id = first.eos_id
        self.masked = any(c.masked for c in self.components)  # chat data: loss on masked-in targets only
        weights = tuple(getattr(data_cfg, "weights", ()) or ())
        if weights and len(weights) != len(paths):
            raise DataError(
                f"data.weights has {len(weights)} entries for {len(paths)} data.paths; expected one per path"
            )
        self.mixture = Mixture(weights or [c.num_tokens for c in self.components])
        self.num_windows = [max(1, -(-(c.num_tokens - 1) // self.seq_len)) for c in self.components]
        self._keys: dict[tuple[int, int], np.ndarray] = {}
        self.packing = str(getattr(data_cfg, "packing", "by_directory") or "by_directory")
        if self.packing not in PACKINGS:
            raise DataError(f"data.packing={self.packing!r}: expected one of {', '.join(PACKINGS)}")
        # per component: PackedRows (rows of whole documents) or None (fixed windows)
        self.packed: list[PackedRows | None] = [None] * len(self.components)
        for c, comp in enumerate(self.components):
            if comp.pairs or not (
                self.packing == "documents" or (self.packing == "by_directory" and comp.manifest.get("chat"))
            ):
                continue  # preference pairs: one pair per row (jaxtrain/data/pairs.py)
            rows = self.packed[c] = pack_documents(comp.document_ends(), self.seq_len + 1)
            self.num_windows[c] = max(1, rows.num_rows)
            if rows.truncated:
                log.warning(
                    "data.paths: %r (%s): %d of %d documents are longer than train.seq_len + 1 = %d "
                    "tokens and were cut to their first %d (%d tokens not trained on)",
                    comp.directory, comp.split, rows.truncated, rows.documents, self.seq_len + 1,
                    self.seq_len + 1, rows.dropped_tokens,
                )  # fmt: skip

    def _check_kind(self) -> None:
        """Text and chat directories only: preference pairs are read by the pairs iterator."""
        for comp in self.components:
            if comp.pairs:
                raise DataError(
                    f"data.paths: {comp.directory!r} holds preference pairs (`jaxtrain tokenize "
                    "--preference`); they train with train.objective=dpo"
                )

    def _keys_for(self, component: int, epoch: int) -> np.ndarray:
        keys = self._keys.get((component, epoch))
        if keys is None:
            if len(self._keys) > 4 * len(self.components):
                self._keys.clear()
            keys = self._keys[(component, epoch)] = round_keys(self.seed, component, epoch)
        return keys

    def windows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(components, windows)`` that global row slots ``slots`` read."""
        assigned = [self.mixture.assign(int(s)) for s in slots]
        components = np.array([c for c, _ in assigned], dtype=np.int64)
        visits = np.array([v for _, v in assigned], dtype=np.int64)
        windows = np.empty_like(visits)
        for c in np.unique(components):
            sel = components == c
            epochs, q = np.divmod(visits[sel], self.num_windows[c])
            if not self.shuffle:
                windows[sel] = q
                continue
            out = np.empty_like(q)
            for e in np.unique(epochs):
                at = epochs == e
                out[at] = feistel_permutation(q[at], self.num_windows[c], self._keys_for(int(c), int(e)))
            windows[sel] = out
        return components, windows

    def window(self, slot: int) -> tuple[int, int]:
        """``(component, window)`` that global row slot ``slot`` reads."""
        components, windows = self.windows(np.array([slot]))
        return int(components[0]), int(windows[0])

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        components, windows = self.windows(self.local_slots(k))
        tokens = np.empty((windows.size, self.seq_len + 1), dtype=np.int32)
        doc_ids = np.empty_like(tokens)
        mask = np.empty(tokens.shape, dtype=np.uint8)
        for c in np.unique(components):
            rows = np.flatnonzero(components == c)
            packed = self.packed[c]
            starts = windows[rows] * self.seq_len if packed is None else packed.starts[windows[rows]]
            tokens[rows], doc_ids[rows], mask[rows] = self.components[c].read_rows(starts, self.seq_len + 1)
            if packed is not None:  # a row of whole documents: what follows its last one is padding
                pad = np.arange(self.seq_len + 1) >= packed.lengths[windows[rows], None]
                for field in (tokens, doc_ids, mask):
                    field[rows] = np.where(pad, 0, field[rows])
        return batch_from_windows(tokens, doc_ids, mask if self.masked else None)

    def close(self) -> None:
        for comp in self.components:
            comp.close()
