"""Sequence layouts for context parallelism (imports only numpy).

With a causal mask, splitting the sequence into n contiguous shards gives the
last device n times the attention work of the first. The zig-zag layout (as in
Megatron Context Parallel) cuts the sequence into 2n chunks and gives device i
chunks i and 2n-1-i, so every device does the same work. The layout is a
permutation of the sequence positions, applied once to every per-token batch
field (tokens, targets, positions, segment ids, loss mask): RoPE positions and
segment ids travel with their tokens, a masked-sum loss is unchanged, and ring
attention derives the causal mask from the chunk layout instead of the array
index.

    perm = zigzag_permutation(seq_len, n)    # new[..., t] = old[..., perm[t]]
    batch = permute_batch(batch, n)          # numpy batch dict, every [B, S] field
    x = x[:, inverse_permutation(perm)]      # back to sequence order
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "zigzag_permutation",
    "inverse_permutation",
    "permute_batch",
    "causal_block_pairs",
    "chunk_of_shard",
]


def _check(seq_len: int, n: int) -> None:
    if n < 1:
        raise ValueError(f"context size n={n}: expected a positive integer")
    if seq_len < 1 or seq_len % (2 * n):
        raise ValueError(f"seq_len={seq_len}: the zig-zag layout needs a multiple of 2 * context = {2 * n}")


def chunk_of_shard(i: int, n: int, load_balanced: bool = True) -> tuple[int, ...]:
    """Which sequence chunks shard i holds: (i, 2n-1-i) of 2n chunks, or (i,) of n."""
    return (i, 2 * n - 1 - i) if load_balanced else (i,)


def zigzag_permutation(seq_len: int, n: int) -> np.ndarray:
    """Index array p with ``permuted[t] = original[p[t]]``: shard i (of n equal
    contiguous shards of the permuted sequence) holds chunks i and 2n-1-i."""
    _check(seq_len, n)
    c = seq_len // (2 * n)
    chunks = np.arange(seq_len).reshape(2 * n, c)
    order = [j for i in range(n) for j in chunk_of_shard(i, n)]
    return chunks[order].reshape(-1)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """q with ``q[perm[t]] = t``: ``x[..., perm][..., q] == x``."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def permute_batch(batch: Mapping[str, np.ndarray], n: int, *, axis: int = 1) -> dict:
    """Every array field of a batch put into zig-zag order along ``axis`` (n = context size).

    n == 1 returns the batch unchanged. Arrays whose ``axis`` is not the
    sequence length of the first field are rejected, so no field is silently skipped.
    """
    if n == 1:
        return dict(batch)
    seq_len = next(iter(batch.values())).shape[axis]
    perm = zigzag_permutation(seq_len, n)
    out = {}
    for key, x in batch.items():
        if x.shape[axis] != seq_len:
            raise ValueError(
                f"batch[{key!r}] has shape {x.shape}; expected length "
                f"{seq_len} on axis {axis} like the other fields"
            )
        out[key] = np.take(x, perm, axis=axis)
    return out


def causal_block_pairs(n: int, *, load_balanced: bool) -> list[int]:
    """Per shard: how many (query chunk, key chunk) pairs of the 2n chunks of
    S/(2n) tokens hold at least one causally allowed (query, key) pair.

    Balanced: shard i holds chunks (i, 2n-1-i); contiguous: chunks (2i, 2i+1).
    Diagonal pairs (half masked) count as one. The sums over shards are equal.
    """

    def held(i):
        return chunk_of_shard(i, n) if load_balanced else (2 * i, 2 * i + 1)

    return [sum(1 for qc in held(i) for kc in range(2 * n) if kc <= qc) for i in range(n)]
