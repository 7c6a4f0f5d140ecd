"""Exact attention over sequence chunks on one device: ring attention's blocks
(``blocks``) for every (q chunk, kv chunk) pair that is not fully masked,
merged through the log-sum-exp, with nothing travelling.

The TPU flash kernels keep one head's whole K/V sequence in VMEM, which caps
the sequence they take; chunking lifts that cap (e.g. after Ulysses'
all_to_all, or for a long sequence per device in ``sharded_flash_attention``).
``flash_attention_any_length`` is the entry point those paths use: the flash
kernels when the sequence fits, chunked attention when it does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxtrain.pallas_kernels.blocks import (
    BlockConfig,
    bwd_pairs,
    empty_output,
    flash_block_config,
    fwd_pairs,
    softmax_delta,
    with_sinks,
    zero_grads,
)
from jaxtrain.pallas_kernels.flash_attention import (
    BlockSizes,
    check_gpu_kernel,
    check_sinks,
    check_softcap,
    check_window,
    flash_attention,
    sink_grad,
)
from jaxtrain.pallas_kernels.mesh_utils import resolve_backend

__all__ = ["chunked_attention", "flash_attention_any_length", "flash_chunks_needed"]


@dataclasses.dataclass(frozen=True)
class _Chunked:
    chunks: int
    causal: bool
    block: BlockConfig


def _chunk_pairs(spec: _Chunked):
    """(q chunk, kv chunk, diagonal) pairs in sequence order; causal skips j > i, a window
    the pairs beyond its reach."""
    m = spec.chunks
    reach = spec.block.window_reach if spec.block.window is not None else m
    return [
        (i, j, spec.causal and i == j)
        for i in range(m)
        for j in range(m)
        if not (spec.causal and (j > i or i - j > reach))
    ]


def _distance(qi, ki):
    """Chunks in sequence order: kv chunk ki lies qi - ki chunks before q chunk qi."""
    return qi - ki


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(spec: _Chunked, q, k, v, seg, sinks):
    return _chunked_fwd_local(spec, q, k, v, seg, sinks)[0]


def _chunked_fwd_local(spec, q, k, v, seg, sinks):
    c = q.shape[1] // spec.chunks
    acc = empty_output(q, v.shape[-1])
    o, lse = with_sinks(
        *fwd_pairs(spec.block, _chunk_pairs(spec), c, q, seg, (k, v, seg), acc, _distance), sinks
    )
    return o.astype(q.dtype), lse


def _chunked_fwd(spec, q, k, v, seg, sinks):
    o, lse = _chunked_fwd_local(spec, q, k, v, seg, sinks)
    return o, (q, k, v, seg, sinks, o, lse)


def _chunked_bwd(spec, res, do):
    q, k, v, seg, sinks, o, lse = res
    c = q.shape[1] // spec.chunks
    delta = softmax_delta(o, do)
    dq, dk, dv = bwd_pairs(
        spec.block,
        _chunk_pairs(spec),
        c,
        q,
        seg,
        (k, v, seg),
        lse,
        do,
        delta,
        zero_grads(q, k, v),
        _distance,
    )
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def flash_chunks_needed(
    seq: int,
    head_dim: int,
    dtype,
    *,
    backend: str,
    block_sizes: BlockSizes | None = None,
    max_chunks: int = 64,
) -> int:
    """How many sequence chunks the flash kernels need on `backend`: 1 unless one
    head's whole K/V does not fit TPU VMEM (the kernels keep it there); then the
    smallest power of two whose chunk fits."""
    if backend != "tpu":
        return 1
    m = 1
    while m <= max_chunks:
        if seq % m == 0:
            spec = BlockConfig(
                backend=backend,
                scale=1.0,
                chunk=seq // m,
                q_heads=1,
                kv_heads=1,
                head_dim=head_dim,
                block_sizes=block_sizes,
                interpret=False,
                use_flash=True,
            )
            try:
                flash_block_config(spec, True, dtype)
                return m
            except ValueError:
                pass
        m *= 2
    raise ValueError(
        f"seq={seq}: no power-of-two chunking up to {max_chunks} fits the TPU flash "
        "kernels; shard the sequence over more devices"
    )


def chunked_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    chunks: int | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_impl: str | None = None,
    gpu_kernel: str = "triton",
    sinks=None,
):
    """Exact attention on one device's ``[batch, seq, heads, head_dim]`` arrays, the
    sequence cut into ``chunks`` pieces: the ring's per-block kernels for every
    (q chunk, kv chunk) pair that is not fully masked, merged through the
    log-sum-exp, with nothing travelling. It lets the TPU flash kernels (which
    keep one head's whole K/V in VMEM) run sequences of any length, e.g. after
    Ulysses' all_to_all. ``chunks=None``: as few as the kernels need
    (``flash_chunks_needed``). Sequence order, no permutation. ``softcap``, and
    ``sliding_window`` (causal only): as for ``flash_attention``; pairs of chunks the window
    cannot reach are skipped. ``gpu_kernel``: the flash blocks' family on GPU, as for
    ``ring_attention``. v's head dim may differ from q/k's; ``sinks`` ([heads]): as for
    ``flash_attention``, added once to the merged softmax.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), "
                f"got shape {getattr(x, 'shape', None)}"
            )
    batch, seq, q_heads, head_dim = q.shape
    if backend is None:
        backend = resolve_backend(q)
    if block_impl is None:
        block_impl = "pallas" if backend in ("tpu", "gpu") else "xla"
    if chunks is None:
        chunks = (
            flash_chunks_needed(seq, head_dim, q.dtype, backend=backend, block_sizes=block_sizes)
            if block_impl == "pallas"
            else 1
        )
    if chunks < 1 or seq % chunks:
        raise ValueError(f"seq={seq} must be a multiple of chunks={chunks}")
    if interpret is None:
        interpret = backend == "cpu"
    window = check_window(sliding_window, causal)
    sinks = check_sinks(sinks, q_heads)
    v_head_dim = v.shape[3]
    if block_impl == "pallas":
        check_gpu_kernel(
            gpu_kernel,
            backend=backend,
            head_dim=head_dim,
            dtype=q.dtype,
            softcap=softcap,
            v_head_dim=v_head_dim,
        )
    block = BlockConfig(
        backend=backend,
        scale=float(softmax_scale or 1.0 / math.sqrt(head_dim)),
        chunk=seq // chunks,
        q_heads=q_heads,
        kv_heads=k.shape[2],
        head_dim=head_dim,
        block_sizes=block_sizes,
        interpret=bool(interpret),
        use_flash=block_impl == "pallas",
        softcap=check_softcap(softcap),
        window=window,
        gpu_kernel=gpu_kernel,
        v_head_dim=None if v_head_dim == head_dim else v_head_dim,
    )
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return _chunked(_Chunked(chunks=chunks, causal=bool(causal), block=block), q, k, v, seg, sinks)


def flash_attention_any_length(q, k, v, *, backend=None, **kwargs):
    """``flash_attention``, or ``chunked_attention`` where one head's K/V would not fit
    the TPU kernels' VMEM. A non-causal sliding window always calls ``flash_attention``
    (chunked attention's windows are causal)."""
    resolved = backend or resolve_backend(q)
    window_ok = kwargs.get("sliding_window") is None or kwargs.get("causal", False)
    if resolved == "tpu" and window_ok and kwargs.get("gpu_kernel", "triton") == "triton":
        chunks = flash_chunks_needed(
            q.shape[1],
            max(q.shape[3], v.shape[3]),
            q.dtype,
            backend=resolved,
            block_sizes=kwargs.get("block_sizes"),
        )
        if chunks > 1:
            return chunked_attention(q, k, v, chunks=chunks, backend=resolved, block_impl="pallas", **kwargs)
    return flash_attention(q, k, v, backend=backend, **kwargs)
