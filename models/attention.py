"""The model's one attention entry point.

`attend` takes projected q/k/v `[batch, seq, heads, head_dim]` (k/v may have
fewer heads: GQA/MQA) and dispatches on `impl`, a resolved config value
(`model.attention_impl`; jaxtrain resolves `auto` per platform in planning/resolve.py,
and a model built directly with `auto` runs `xla`):
- "xla": plain jnp (scores materialised; fine at CPU/test sizes); with `cpu_tuned`
  (`model.cpu_tuning`) models/cpu_tuning.py's attention, which keeps the log-sum-exp,
  not the probabilities;
- "pallas": the Pallas flash kernel, run inside `shard_map` over the batch and
  head mesh axes (Mosaic/Triton kernels cannot be partitioned by XLA);
- "pallas_mosaic": the same, with the Hopper kernel written for Pallas' Mosaic GPU backend
  (pallas_kernels/flash_mgpu.py) in place of the Triton one;
- "cudnn": cuDNN's fused attention (GPU), split the same way; batches whose rows pack
  several documents run the Pallas kernel instead (pallas_kernels/cudnn_attention.py).
When the mesh in context has a `context` axis > 1 (the `seq` activations are
sharded over it), `context_impl` picks ring attention or DeepSpeed-Ulysses
instead, combined with the same batch/head sharding; `impl` then only picks the
per-block compute (flash kernel or XLA; cudnn and pallas_mosaic blocks run the Triton flash
kernel, whose log-sum-exp the ring combines). Sequences are then in zig-zag order
(`sharding.context`, applied to every batch by the trainer).

Every path but cuDNN takes v with a head dim of its own (MLA: q/k 192, v 128; the output has
v's) and `sinks`, one logit per query head in every softmax's denominator with no value
(GPT-OSS); cuDNN refuses both in one line, the Hopper kernel the value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import sharding
from jaxtrain.models import cpu_tuning
from jaxtrain.models.config import FLASH_ATTENTION_IMPLS
from jaxtrain.models.masks import attention_mask, masked_scores
from jaxtrain.pallas_kernels import ring_attention, sharded_flash_attention, ulysses_attention
from jaxtrain.pallas_kernels.cudnn_attention import cudnn_attention
from jaxtrain.pallas_kernels.remat_names import ATTENTION_RESIDUALS
from jaxtrain.pallas_kernels.sharded import shard_attention


def xla_attention(
    q,
    k,
    v,
    *,
    segment_ids=None,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    softcap=None,
    sinks=None,
):
    """Reference-quality attention in XLA ops: f32 softmax, GQA without repeating K/V.
    q, k `[b, s, heads or kv_heads, d_qk]`, v `[b, s, kv_heads, d_v]` -> `[b, s, heads, d_v]`
    (MLA's value head is narrower than its query/key head); `softcap`: the scores capped by
    softcap * tanh(scores / softcap) before the mask; `sinks`: `[heads]` logits, one per
    query head, that join every softmax's denominator and carry no value (GPT-OSS)."""
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    qg = q.reshape(b, s, kv_heads, groups, d)
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    mask = attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
    scores = masked_scores(qg, k, mask, scale, softcap)
    probs = sink_softmax(scores, sinks, kv_heads).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, v.shape[-1])


def sink_softmax(scores, sinks, kv_heads):
    """f32 softmax over the last axis of grouped scores `[b, kv_heads, groups, s, t]`; with
    `sinks` (`[heads]`, head `k * groups + g` at `[k, g]`) each head's sink logit joins the
    denominator as one more column that is then dropped (no value): a sink of 0 still adds
    exp(0 - max)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    groups = scores.shape[2]
    sink = jnp.asarray(sinks, jnp.float32).reshape(1, kv_heads, groups, 1, 1)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def attend(
    q,
    k,
    v,
    *,
    segment_ids=None,
    causal=True,
    impl="xla",
    sliding_window=None,
    context_impl="ring",
    cpu_tuned=False,
    softmax_scale=None,
    softcap=None,
    gpu_kernel="triton",
    sinks=None,
):
    """Dispatch to one attention implementation (see module docstring). `softmax_scale`:
    the query scale (None: q/k head_dim ** -0.5); `softcap`: the logit cap (every path but cuDNN);
    `sinks`: `[heads]` sink logits (`xla_attention`; every path but cuDNN); v's head dim may
    differ from q/k's (every path but cuDNN);
    `gpu_kernel`: which Pallas flash kernel runs on a GPU, "triton" or "mosaic" (Hopper), for
    `pallas`, cuDNN's fallback and the context-parallel blocks (`pallas_mosaic`: always mosaic).

    The output is the `context` activation checkpoint: the flash kernels (pallas, cudnn) name
    it inside their backward rules, with their softmax statistics, so that a policy keeping
    `context` runs no forward kernel again (pallas_kernels/remat_names.py); the other paths
    name their output here."""
    impl = "xla" if impl == "auto" else impl
    gpu_kernel = "mosaic" if impl == "pallas_mosaic" else gpu_kernel
    if softcap is not None and impl == "cudnn":
        raise ValueError(f"attention softcap {softcap}: cuDNN's attention takes none; use pallas or xla")
    context = _context_size() > 1
    _check_supported(impl, context, q, v, sinks)
    if context:
        return _named(
            _context_attention(
                q,
                k,
                v,
                segment_ids=segment_ids,
                causal=causal,
                impl=impl,
                sliding_window=sliding_window,
                context_impl=context_impl,
                softmax_scale=softmax_scale,
                softcap=softcap,
                gpu_kernel=gpu_kernel,
                sinks=sinks,
            )
        )
    if impl == "xla":
        plain = softmax_scale is None and softcap is None and sinks is None and _same_head_dims(q, v)
        if cpu_tuned and plain:  # the CPU-tuned VJP implements none of these
            return _named(
                cpu_tuning.attention(
                    q, k, v, segment_ids=segment_ids, causal=causal, sliding_window=sliding_window
                )
            )
        return _named(
            xla_attention(
                q,
                k,
                v,
                segment_ids=segment_ids,
                causal=causal,
                sliding_window=sliding_window,
                softmax_scale=softmax_scale,
                softcap=softcap,
                sinks=sinks,
            )
        )
    if impl in FLASH_ATTENTION_IMPLS:
        return _pallas_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=causal,
            sliding_window=sliding_window,
            scale=softmax_scale,
            softcap=softcap,
            gpu_kernel=gpu_kernel,
            sinks=sinks,
        )
    if impl == "cudnn":
        return _cudnn_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=causal,
            sliding_window=sliding_window,
            scale=softmax_scale,
            gpu_kernel=gpu_kernel,
        )
    raise ValueError(f"attention impl={impl!r}: expected one of auto, xla, pallas, pallas_mosaic, cudnn")


def _same_head_dims(q, v) -> bool:
    return q.shape[-1] == v.shape[-1]


def _check_supported(impl, context, q, v, sinks):
    """One-line errors for settings a path does not implement (never silently ignored): cuDNN
    (jax.nn.dot_product_attention) takes no sinks and wants v shaped like k. The Hopper
    kernel's own limits are named by `flash_attention.check_gpu_kernel`."""
    if impl != "cudnn" or context:  # context parallel: cudnn blocks run the flash kernel
        return
    if sinks is not None:
        raise ValueError("attention sinks: cuDNN's attention takes none; use impl=pallas or xla")
    if not _same_head_dims(q, v):
        raise ValueError(
            f"attention value head dim {v.shape[-1]} != query/key head dim {q.shape[-1]}: "
            "jax.nn.dot_product_attention (cuDNN) wants v shaped like k; use impl=pallas or xla"
        )


def _named(out):
    """Attention's output as the `context` checkpoint (paths without a kernel that names it)."""
    return checkpoint_name(out, ATTENTION_RESIDUALS)


def _batch_and_head_axes(q, rules, mesh, heads="act_heads") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes the active rules give the `batch` and `heads` (logical) dims of `q`."""

    def axes(logical, dim):
        spec = sharding.logical_to_spec((logical,), rules, mesh, shape=q.shape[dim : dim + 1])
        return sharding.axes_tuple(spec[0] if spec else None)

    return axes("batch", 0), axes(heads, 2)


def kernel_shards(q, heads: str = "act_heads"):
    """(mesh or None, batch axes, head axes) for a kernel run per shard: batch and heads split
    as the active rules split the `batch` / `heads` activations (the gated DeltaNet layers':
    `act_kv_heads`), so no collective is needed around it."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.current_rules()
    if mesh.empty or rules is None:
        return None, (), ()
    return mesh, *_batch_and_head_axes(q, rules, mesh, heads)


def _cudnn_attention(q, k, v, *, segment_ids, causal, sliding_window, scale=None, gpu_kernel="triton"):
    """cuDNN per shard; the flash kernel (`gpu_kernel`) for rows packing several documents."""
    mesh, batch_axes, head_axes = kernel_shards(q)
    flash = dict(
        mesh=None,
        batch_axes=(),
        head_axes=(),
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=scale,
        gpu_kernel=gpu_kernel,
    )

    def kernel(q, k, v, seg):
        fallback = lambda q, k, v, seg: sharded_flash_attention(q, k, v, segment_ids=seg, **flash)
        return cudnn_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=seg,
            sliding_window=sliding_window,
            softmax_scale=scale,
            fallback=fallback,
        )

    return shard_attention(
        kernel, q, k, v, segment_ids, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes
    )


def _pallas_attention(
    q, k, v, *, segment_ids, causal, sliding_window, scale=None, softcap=None, gpu_kernel="triton", sinks=None
):
    """The flash kernel per shard (`kernel_shards`)."""
    mesh, batch_axes, head_axes = kernel_shards(q)
    return sharded_flash_attention(
        q,
        k,
        v,
        mesh=mesh,
        batch_axes=batch_axes,
        head_axes=head_axes,
        causal=causal,
        segment_ids=segment_ids,
        sliding_window=sliding_window,
        softmax_scale=scale,
        softcap=softcap,
        gpu_kernel=gpu_kernel,
        sinks=sinks,
    )


def _context_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "context" not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))["context"]


def _context_attention(
    q,
    k,
    v,
    *,
    segment_ids,
    causal,
    impl,
    sliding_window,
    context_impl,
    softmax_scale,
    softcap,
    gpu_kernel,
    sinks=None,
):
    """Ring or Ulysses attention over the `context` mesh axis; batch and heads split
    as the active rules split the `batch` / `act_heads` activations. Inputs are in
    zig-zag order (load balanced)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.current_rules()
    if rules is None:
        raise ValueError(
            "context parallel attention needs the logical axis rules in context (sharding.axis_rules)"
        )
    batch_axes, head_axes = _batch_and_head_axes(q, rules, mesh)
    batch_axes = tuple(a for a in batch_axes if a != "context")
    head_axes = tuple(a for a in head_axes if a != "context")
    kwargs = dict(
        mesh=mesh,
        axis_name="context",
        causal=causal,
        segment_ids=segment_ids,
        load_balanced=True,
        batch_axes=batch_axes,
        head_axes=head_axes,
        block_impl="pallas" if impl in ("cudnn", "pallas_mosaic") else impl,
        gpu_kernel=gpu_kernel,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        softcap=softcap,
        sinks=sinks,
    )
    if context_impl == "ring":
        return ring_attention(q, k, v, **kwargs)
    if context_impl == "ulysses":
        return ulysses_attention(q, k, v, **kwargs)
    raise ValueError(f"context_impl={context_impl!r}: expected ring or ulysses")
