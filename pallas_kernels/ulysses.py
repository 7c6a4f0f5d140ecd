"""DeepSpeed-Ulysses attention over a ``context`` mesh axis.

The sequence is sharded over ``axis_name`` (n shards). Inside ``shard_map`` an
``all_to_all`` re-shards q, k, v from sequence to heads (each shard gets the
whole sequence for heads/n of the heads), ordinary attention runs per shard
(the flash kernel on GPU/TPU, an XLA block on CPU), and a second
``all_to_all`` shards the output back to sequence. Work is balanced whatever
the mask; the degree is capped by the number of heads: q heads must divide by
n. K/V heads that do not divide by n (GQA) are repeated up to the q heads first.
Where one head's whole sequence does not fit the TPU flash kernels' VMEM, the
local attention runs over sequence chunks (``chunked_attention``: the ring's
blocks merged through the log-sum-exp, nothing travelling).

With ``load_balanced=True`` the inputs are in zig-zag order (as for
``ring_attention``); after the all_to_all each shard holds the whole sequence
in that order and puts it back in sequence order (a local gather) before the
causal kernel, so the model can use one data layout for both context impls.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtrain.pallas_kernels import reference
from jaxtrain.pallas_kernels.chunked import flash_attention_any_length
from jaxtrain.pallas_kernels.flash_attention import check_gpu_kernel, check_sinks
from jaxtrain.pallas_kernels.mesh_utils import (
    axes_tuple,
    check_context_inputs,
    mesh_backend,
    shard_over_sequence,
)

__all__ = ["ulysses_attention"]


def _zigzag(seq_len: int, n: int) -> np.ndarray:
    # Same layout as sharding.context.zigzag_permutation (pallas_kernels does not
    # import sharding; tests check the two agree).
    c = seq_len // (2 * n)
    order = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.arange(seq_len).reshape(2 * n, c)[order].reshape(-1)


def ulysses_attention(
    q,
    k,
    v,
    *,
    mesh,
    axis_name: str = "context",
    causal: bool = True,
    segment_ids=None,
    softmax_scale: float | None = None,
    load_balanced: bool = False,
    batch_axes=(),
    head_axes=(),
    block_impl: str | None = None,
    gpu_kernel: str = "triton",
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """Attention on ``[batch, seq, heads, head_dim]`` arrays sharded on seq over
    ``axis_name``; output sharded the same way. See the module docstring.

    block_impl: 'pallas' (flash kernel; interpret mode on CPU) or 'xla'
    (materialised scores: test sizes only); None picks by the mesh's platform.
    sliding_window: as for ``flash_attention`` (in sequence order: each shard
    sees the whole sequence, so the window needs nothing from the ring).
    softcap: optional logit cap, as for ``flash_attention``.
    gpu_kernel: the flash kernel's family on GPU ('triton' or 'mosaic'), as for
    ``flash_attention``; each shard runs it over the whole sequence of its heads.
    v's head dim may differ from q/k's (MLA); ``sinks`` ([q_heads]): as for
    ``flash_attention``, each shard's slice going with its heads.
    """
    check_context_inputs(q, k, v, mesh=mesh, axis_name=axis_name)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n = sizes[axis_name]
    batch, seq, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    batch_axes = axes_tuple("batch_axes", batch_axes)
    head_axes = axes_tuple("head_axes", head_axes)
    n_batch = math.prod(sizes[a] for a in batch_axes)
    n_head = math.prod(sizes[a] for a in head_axes)
    if q_heads % (n * n_head):
        raise ValueError(
            f"Ulysses needs q heads divisible by the {axis_name} size times the head "
            f"shards: q heads {q_heads}, {axis_name}={n}, head shards {n_head}; "
            f"use context_impl=ring instead"
        )
    if seq % (2 * n if load_balanced else n):
        raise ValueError(f"seq={seq} must be a multiple of {2 * n if load_balanced else n}")
    if batch % n_batch:
        raise ValueError(f"batch {batch} must divide by the batch shards {n_batch}")
    if kv_heads % (n * n_head):
        # Repeat kv heads up to the q heads so every shard gets whole groups.
        k = jnp.repeat(k, q_heads // kv_heads, axis=2)
        v = jnp.repeat(v, q_heads // kv_heads, axis=2)
    backend = mesh_backend(mesh)
    if block_impl is None:
        block_impl = "xla" if backend == "cpu" else "pallas"
    if block_impl not in ("xla", "pallas"):
        raise ValueError(f"block_impl={block_impl!r}: expected 'xla', 'pallas' or None")
    sinks = check_sinks(sinks, q_heads)
    if block_impl == "pallas":
        check_gpu_kernel(
            gpu_kernel,
            backend=backend,
            head_dim=q.shape[3],
            dtype=q.dtype,
            softcap=softcap,
            v_head_dim=v.shape[3],
        )
    perm = _zigzag(seq, n) if load_balanced else None
    inv = None if perm is None else np.argsort(perm)

    def seq_to_heads(x):  # [b, S/n, h, d] -> [b, S, h/n, d]
        return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    def heads_to_seq(x):
        return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)

    def local(q, k, v, seg, sinks=None):
        if sinks is not None:  # the all_to_all hands shard i the i-th slice of the local heads
            per = sinks.shape[0] // n
            sinks = lax.dynamic_slice_in_dim(sinks, lax.axis_index(axis_name) * per, per)
        q, k, v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
        if seg is not None:
            seg = lax.all_gather(seg, axis_name, axis=1, tiled=True)
        if inv is not None:
            q, k, v = (x[:, inv] for x in (q, k, v))
            seg = None if seg is None else seg[:, inv]
        if block_impl == "pallas":
            # The flash kernels, over sequence chunks where one head's whole sequence
            # does not fit the TPU kernels' VMEM (as sharded_flash_attention).
            o = flash_attention_any_length(
                q,
                k,
                v,
                causal=causal,
                segment_ids=seg,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                softcap=softcap,
                backend=backend,
                gpu_kernel=gpu_kernel,
                sinks=sinks,
            )
        else:
            o = reference.attention(
                q,
                k,
                v,
                causal=causal,
                segment_ids=seg,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                softcap=softcap,
                sinks=sinks,
            )
        if perm is not None:
            o = o[:, perm]
        return heads_to_seq(o)

    return shard_over_sequence(
        local,
        q,
        k,
        v,
        segment_ids,
        mesh=mesh,
        axis_name=axis_name,
        batch_axes=batch_axes,
        head_axes=head_axes,
        sinks=sinks,
    )
