"""Each attention head's largest pre-softmax logit in a forward pass, recorded when asked
(QK-clip, `optimizer.qk_clip`: jaxtrain/trainer/qk_clip.py scales the heads whose logits grew
past tau).

Two trace-time switches, as models/lora.py's: `recording()` (the trainer, around the forward
pass) turns the recording on; the layer loop (models/transformer.py) opens `collecting()`
around each scanned layer, so what the layer's attention modules `record` comes back as that
layer's scan output (`attention_max_logit`: {path of the Attention module in the layer: [heads]}),
stacked over layers like MoE's router statistics. Off, nothing is computed.

The logit is the one the softmax sees before any softcap: scale x q.k of the query and key
the attention uses (RoPE and QK-norm applied), over the pairs the mask lets through (causal,
same segment, within the sliding window). Computed here from q and k in float32, apart from
the attention kernel, whose implementations (flash, cuDNN, ring) keep no such statistic: it
forms the [batch, heads, seq, seq] scores once more (no gradient flows through it), which is
the cost of the switch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxtrain.models.masks import attention_mask

KEY = "attention_max_logit"  # the layer loop's output, and the model's aux entry

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("record_max_logits", default=False)
_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("max_logit_sink", default=None)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Inside, attention layers record their heads' largest logits (trace-time)."""
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """A list that receives (module, [heads] max logits) for every attention module that
    records inside (the layer loop's, per scanned layer)."""
    sink: list = []
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def record(module, max_logits: jax.Array) -> None:
    sink = _SINK.get()
    if sink is not None:
        sink.append((module, max_logits))


def max_logits(q, k, *, scale: float, segment_ids=None, window: int | None = None) -> jax.Array:
    """[heads] float32: the largest scale x q.k per query head over the causal pairs (same
    segment, within `window` when given). q [b, s, heads, d], k [b, s, kv_heads, d]; query head
    h reads key head h // (heads / kv_heads), as the attention does."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = jax.lax.stop_gradient(q).astype(jnp.float32).reshape(b, s, kv, h // kv, d)
    k = jax.lax.stop_gradient(k).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", q, k) * scale
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    mask = attention_mask(segment_ids, segment_ids, causal=True, sliding_window=window)  # [b, q, t]
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    return jnp.max(logits, axis=(0, 3, 4)).reshape(h)


def layer_output(stats: dict | None, seen: list, layer) -> dict | None:
    """A scanned layer's statistics with what its attention modules recorded added under KEY,
    keyed by each module's path inside `layer` ("attn", "layer_0/attn", "moe/attn", ...)."""
    if not seen:
        return stats
    from flax import nnx

    paths = {id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(layer)}
    return {**(stats or {}), KEY: {paths[id(m)]: v for m, v in seen}}
