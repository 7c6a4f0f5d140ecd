"""Flash attention on sharded global arrays: the kernel inside ``jax.shard_map``.

Mosaic and Triton kernels cannot be partitioned by XLA (it would gather full
inputs onto every device), so a sharded model calls the kernel per shard. The
batch is split over ``batch_axes`` and heads over ``head_axes``; attention never
mixes batch rows or heads, so no collective is needed in either direction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.pallas_kernels.chunked import flash_attention_any_length
from jaxtrain.pallas_kernels.flash_attention import BlockSizes
from jaxtrain.pallas_kernels.mesh_utils import check_shard_axes, mesh_backend, reshard_to_specs

__all__ = ["shard_attention", "sharded_flash_attention"]


def sharded_flash_attention(
    q,
    k,
    v,
    *,
    mesh,
    batch_axes: Sequence[str] | str | None,
    head_axes: Sequence[str] | str | None,
    causal: bool,
    segment_ids=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    gpu_kernel: str = "triton",
    sinks=None,
):
    """``flash_attention`` over global ``[batch, seq, heads, head_dim]`` arrays on ``mesh``
    (``shard_attention`` says how it is split); ``sinks`` [heads] split with the heads. The
    backend follows the mesh's devices (CPU -> interpret mode). ``mesh`` may be a ``Mesh`` or
    the ``AbstractMesh`` of the context (``jax.get_abstract_mesh()`` under ``jax.set_mesh``).
    """
    kwargs = dict(
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        softcap=softcap,
        block_sizes=block_sizes,
        interpret=interpret,
        backend=None if mesh is None else mesh_backend(mesh),
        gpu_kernel=gpu_kernel,
    )
    kernel = lambda q, k, v, seg, sinks=None: flash_attention_any_length(
        q, k, v, segment_ids=seg, sinks=sinks, **kwargs
    )
    return shard_attention(
        kernel, q, k, v, segment_ids, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes, sinks=sinks
    )


def shard_attention(
    kernel,
    q,
    k,
    v,
    segment_ids,
    *,
    mesh,
    batch_axes: Sequence[str] | str | None,
    head_axes: Sequence[str] | str | None,
    sinks=None,
):
    """``kernel(q, k, v, segment_ids)`` per shard of global ``[batch, seq, heads, head_dim]``
    arrays (v's head dim may differ): batch split over ``batch_axes`` (possibly empty), q
    heads over ``head_axes``; kv heads too when divisible, else k/v stay replicated over
    ``head_axes`` and each shard picks the kv heads its q heads read. Mesh axes named in
    neither are replicated (the kernel runs redundantly on them). With ``mesh`` None or of one
    device the kernel is called directly. ``sinks`` ([q heads] or None): split with the q
    heads and passed on as ``kernel(..., sinks=)`` when given. Any attention kernel XLA cannot
    partition (Pallas, cuDNN) goes through here.
    """
    call = lambda q, k, v, seg, sinks: (
        kernel(q, k, v, seg) if sinks is None else kernel(q, k, v, seg, sinks=sinks)
    )
    if mesh is None or math.prod(mesh.axis_sizes) == 1:
        return call(q, k, v, segment_ids, sinks)
    batch_axes, head_axes = check_shard_axes(mesh, batch_axes, head_axes)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), "
                f"got shape {getattr(x, 'shape', None)}"
            )
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n_batch = math.prod(sizes[a] for a in batch_axes)
    n_head = math.prod(sizes[a] for a in head_axes)
    batch, _, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    if batch % n_batch:
        raise ValueError(f"batch {batch} is not divisible by the {n_batch} shards of batch_axes {batch_axes}")
    if q_heads % n_head:
        raise ValueError(
            f"q heads {q_heads} are not divisible by the {n_head} shards of head_axes {head_axes}"
        )
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads ({kv_heads})")

    b_spec = batch_axes if batch_axes else None
    h_spec = head_axes if head_axes else None
    shard_kv = kv_heads % n_head == 0
    q_spec = P(b_spec, None, h_spec, None)
    kv_spec = q_spec if shard_kv else P(b_spec, None, None, None)
    group = q_heads // kv_heads
    local_q_heads = q_heads // n_head

    def local(q, k, v, seg, sinks=None):
        if not shard_kv:
            # k/v hold every kv head; keep those this shard's q heads read.
            shard = lax.axis_index(head_axes)
            first_q_head = shard * local_q_heads
            if n_head % kv_heads == 0:
                # All local q heads read one kv head (e.g. MQA, or more shards than kv heads).
                kv = first_q_head // group
                k = lax.dynamic_slice_in_dim(k, kv, 1, axis=2)
                v = lax.dynamic_slice_in_dim(v, kv, 1, axis=2)
            else:
                idx = (first_q_head + jnp.arange(local_q_heads)) // group
                k = jnp.take(k, idx, axis=2)
                v = jnp.take(v, idx, axis=2)
        return call(q, k, v, seg, sinks)

    seg_spec = P(b_spec, None)
    in_specs = (q_spec, kv_spec, kv_spec, None if segment_ids is None else seg_spec)
    args = (q, k, v, segment_ids)
    if sinks is not None:  # one logit per q head: split as the q heads are
        in_specs, args = (*in_specs, P(h_spec)), (*args, sinks)
    # check_vma=False: the kernels' out_shapes carry no manual-axis types, and
    # interpret mode fails the varying-axes check (JAX_NOTES, Pallas).
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)
    return fn(*reshard_to_specs(mesh, args, in_specs))
