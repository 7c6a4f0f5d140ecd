"""`train.loss_chunk: auto`: whether the cross-entropy runs in chunks of positions, and how big.

The plain loss forms the microbatch's `[tokens, vocab]` logits in f32 at once, with the
softmax and its gradient beside them in the backward. Chunked (jaxtrain/chunked_loss.py,
fused backward, no recompute) only one chunk of them is live. Measured (README, *Chunked
cross-entropy*), four chunks were faster than the plain loss as well as smaller:
- bench-peer on 8 simulated CPU devices (62.5 MiB of f32 logits per device): bf16 step
  2.10 -> 1.82 s, f32 2.98 -> 2.77 s, temp 194 -> 113 MiB (bf16);
- Llama-3-8B on TPU v5p-64, batch 32 x 2048 (1 GiB of logits per device), deviceless
  compile: estimated step and temp memory in the README table.
Two chunks gained less on CPU, eight no more. So `auto` takes four chunks (seq_len / 4
positions each) once the logits reach `AUTO_MIN_MIB` per device, and the plain loss below
that (a small model's logits are not worth the scan: the tiny config's are 2 MiB).

Jax-free: the planner's analytic pass (jaxtrain/footprint.py) resolves it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxtrain.config import Config

AUTO_CHUNKS = 4
AUTO_MIN_MIB = 16


def logits_mib_per_device(cfg: Config, mesh_shape: Mapping[str, int]) -> float:
    """MiB of one microbatch's f32 logits on one device: the microbatch's tokens x vocab,
    spread over every axis that splits the batch or the vocabulary (the same count whether
    the head is FSDP- or vocab-parallel: mesh.head_sharding moves rows, not their number)."""
    t = cfg.train
    tokens = t.global_batch_size * t.seq_len // max(1, t.microbatches)
    split = 1
    for axis in ("data", "fsdp", "expert", "context", "tensor"):
        split *= mesh_shape.get(axis, 1)
    return 4 * tokens * cfg.model.vocab_size / split / 2**20


def resolve(cfg: Config, mesh_shape: Mapping[str, int]) -> tuple[int, str]:
    """(positions per chunk, 0 for the plain loss; why) for `cfg.train.loss_chunk` on a
    mesh of these axis sizes (ICI x DCN)."""
    chunk = cfg.train.loss_chunk
    if chunk != "auto":
        return chunk, "as configured"
    seq = cfg.train.seq_len
    mib = logits_mib_per_device(cfg, mesh_shape)
    if mib < AUTO_MIN_MIB:
        return 0, f"the plain loss: {mib:.1f} MiB of f32 logits per device, under {AUTO_MIN_MIB} MiB"
    if seq % AUTO_CHUNKS:
        return 0, f"the plain loss: train.seq_len={seq} does not split into {AUTO_CHUNKS} chunks"
    return seq // AUTO_CHUNKS, (
        f"{AUTO_CHUNKS} chunks of {seq // AUTO_CHUNKS} positions: {mib:.1f} MiB of f32 logits "
        f"per device at once otherwise"
    )


def resolved(cfg: Config, mesh_shape: Mapping[str, int]) -> Config:
    """`cfg` with `train.loss_chunk` resolved to a number of positions (0: plain)."""
    chunk = resolve(cfg, mesh_shape)[0]
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk=chunk))


def note(cfg: Config, mesh_shape: Mapping[str, int]) -> str:
    """The log line saying what `train.loss_chunk` resolved to and why."""
    chunk, why = resolve(cfg, mesh_shape)
    return f"train.loss_chunk={cfg.train.loss_chunk} -> {chunk}: {why}"
