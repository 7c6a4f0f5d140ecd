"""cuDNN's fused flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`)
behind the same interface as our kernels: `[batch, seq, heads, head_dim]`, GQA, causal,
a left sliding window, and `segment_ids`.

cuDNN expresses a row holding one document followed by padding (its PADDING masks, from
per-row lengths), but not several documents packed into one row. So `segment_ids` are read
at run time: when every row is one document then padding (the common case: synthetic data,
one document per row, a prompt and its answer), cuDNN runs; otherwise `fallback` (our
flash kernel, the caller's choice) runs the whole batch, through `lax.cond`. Both branches
are compiled; only one executes.

On the H200 of 2026-11-26 cuDNN ran causal GQA attention at 424 TFLOP/s fwd+bwd against our
Pallas/Triton kernel's 186 (planning/attention_speeds.py keeps the table). cuDNN has no
right window: a non-causal window always takes `fallback`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.pallas_kernels.remat_names import with_named_residuals

__all__ = ["cudnn_attention", "single_document_lengths"]


def single_document_lengths(segment_ids):
    """(lengths `[batch]` int32, ok): each row's count of non-padding tokens, and whether every
    row is exactly one document (a nonzero id) followed only by padding (id 0), none empty."""
    real = segment_ids != 0
    lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
    inside = jnp.arange(segment_ids.shape[1])[None, :] < lengths[:, None]
    expected = jnp.where(inside, segment_ids[:, :1], 0)
    ok = jnp.all(segment_ids == expected) & jnp.all(lengths > 0)
    return lengths, ok


def cudnn_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    segment_ids=None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    fallback=None,
):
    """Attention by cuDNN where it can express the mask (module docstring), else by
    `fallback(q, k, v, segment_ids)`. Without `fallback`, masks cuDNN cannot express raise."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if sliding_window is not None and not causal:
        if fallback is None:
            raise ValueError(
                "cuDNN attention has no right window: a non-causal sliding window needs a fallback"
            )
        return fallback(q, k, v, segment_ids)

    def cudnn(lengths):
        # the residuals (output, softmax statistics) named `context`: a remat policy that keeps
        # it does not run cuDNN's forward again in the backward pass (remat_names.py)
        if lengths is None:
            return with_named_residuals(lambda q, k, v: attention(q, k, v, None), q, k, v)
        return with_named_residuals(attention, q, k, v, lengths)  # no closed-over tracers

    def attention(q, k, v, lengths):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=causal,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            # ours: a query sees the last `sliding_window` keys, itself included
            local_window_size=None if sliding_window is None else (sliding_window - 1, 0),
            implementation="cudnn",
        )

    if segment_ids is None:
        return cudnn(None)
    lengths, ok = single_document_lengths(segment_ids)
    if fallback is None:
        return cudnn(lengths)  # the caller vouches for one document per row
    return lax.cond(ok, lambda: cudnn(lengths), lambda: fallback(q, k, v, segment_ids))
