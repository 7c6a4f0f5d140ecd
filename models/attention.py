"""The model's one attention entry point.

`attend` takes projected q/k/v `[batch, seq, heads, head_dim]` (k/v may have
fewer heads: GQA/MQA) and dispatches on `impl`:
- "xla": plain jnp (scores materialised; fine at CPU/test sizes); on CPU with its
  own VJP (`cpu_attention`: keeps the log-sum-exp, not the probabilities),
- "pallas": the Pallas flash kernel, run inside `shard_map` over the batch and
  head mesh axes (Mosaic/Triton kernels cannot be partitioned by XLA).
When the mesh in context has a `context` axis > 1 (the `seq` activations are
sharded over it), `context_impl` picks ring attention or DeepSpeed-Ulysses
instead, combined with the same batch/head sharding; `impl` then only picks the
per-block compute (flash kernel or XLA). Sequences are then in zig-zag order
(`sharding.context`, applied to every batch by the trainer).
`resolve_impl("auto")` picks pallas on GPU/TPU and xla on CPU by backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain import sharding
from jaxtrain.models.dense import materialized_transpose, on_cpu


def resolve_impl(impl: str, platform: str | None = None) -> str:
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"


def attention_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    causal: bool,
    sliding_window: int | None = None,
    q_offset: int = 0,
) -> jax.Array:
    """Boolean `[batch, q_len, kv_len]`: same segment (and causal / in window). The
    queries sit at positions `q_offset ..` of the sequence, the keys at `0 ..`."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    q_pos = q_offset + jnp.arange(q_segment_ids.shape[1])[:, None]
    k_pos = jnp.arange(kv_segment_ids.shape[1])[None, :]
    if causal:
        mask &= (k_pos <= q_pos)[None]
    if sliding_window is not None:
        mask &= (q_pos - k_pos < sliding_window)[None]
        if not causal:
            mask &= (k_pos - q_pos < sliding_window)[None]
    return mask


def _scores(qg, k, mask, scale):
    """Masked f32 scores [b, kv_heads, groups, s, t] of grouped q [b, s, kv_heads, groups, d]."""
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)


def xla_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None, softmax_scale=None):
    """Reference-quality attention in XLA ops: f32 softmax, GQA without repeating K/V."""
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    qg = q.reshape(b, s, kv_heads, groups, d)
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    mask = attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
    scores = _scores(qg, k, mask, scale)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


QUERY_BLOCK_ROWS = 128  # the causal CPU attention's query block size, about (see below)


def causal_query_blocks(q_len: int, kv_len: int, causal: bool) -> int:
    """How many query blocks `cpu_attention` splits a causal self-attention into. Block i
    (rows i*c .. (i+1)*c - 1, c = q_len / n) sees only keys 0 .. (i+1)*c - 1, so the
    [s, t] work is (n + 1) / 2n of the full square: blocks of about 128 rows, at most 8
    (4 at seq 512: 62.5%). The bench-peer attention forward and backward (8 devices,
    [8, 512, 4, 64] bf16) went from 58 to 34 ms with 4 blocks (2 blocks: 41 ms, 8: 35 ms)."""
    if not causal or q_len != kv_len:
        return 1
    n = min(8, q_len // QUERY_BLOCK_ROWS)
    while n > 1 and q_len % n:
        n -= 1
    return max(n, 1)


def _blocks(q, k, causal):
    """(rows, kv_end) of each query block: the keys past kv_end are all masked out."""
    s, t = q.shape[1], k.shape[1]
    n = causal_query_blocks(s, t, causal)
    c = s // n
    return [(slice(i * c, (i + 1) * c), (i + 1) * c if n > 1 else t) for i in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _cpu_attention(q, k, v, segment_ids, causal, sliding_window, scale):
    return _cpu_attention_fwd(q, k, v, segment_ids, causal, sliding_window, scale)[0]


def _block_mask(segment_ids, rows, kv_end, causal, sliding_window):
    return attention_mask(
        segment_ids[:, rows],
        segment_ids[:, :kv_end],
        causal=causal,
        sliding_window=sliding_window,
        q_offset=rows.start,
    )


def _cpu_attention_fwd(q, k, v, segment_ids, causal, sliding_window, scale):
    b, s, h, d = q.shape
    kv = k.shape[2]
    outs, lses = [], []
    for rows, end in _blocks(q, k, causal):
        qg = q[:, rows].reshape(b, -1, kv, h // kv, d)
        mask = _block_mask(segment_ids, rows, end, causal, sliding_window)
        scores = _scores(qg, k[:, :end], mask, scale)
        lse = jax.nn.logsumexp(scores, axis=-1)  # [b, k, g, rows]
        probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
        outs.append(jnp.einsum("bkgst,btkd->bskgd", probs, v[:, :end]).reshape(b, -1, h, d))
        lses.append(lse)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=-1) if len(lses) > 1 else lses[0]
    return out, (q, k, v, segment_ids, out, lse)


def _cpu_attention_bwd(causal, sliding_window, scale, res, dout):
    q, k, v, segment_ids, out, lse = res
    b, s, h, d = q.shape
    kv = k.shape[2]
    f32 = jnp.float32
    dqs, dk, dv = [], None, None
    for rows, end in _blocks(q, k, causal):
        qg = q[:, rows].reshape(b, -1, kv, h // kv, d)
        dog = dout[:, rows].reshape(qg.shape)
        k_b, v_b = k[:, :end], v[:, :end]
        mask = _block_mask(segment_ids, rows, end, causal, sliding_window)
        probs = jnp.exp(_scores(qg, k_b, mask, scale) - lse[..., rows, None])  # recomputed, f32
        dprobs = jnp.einsum("bskgd,btkd->bkgst", dog, v_b, preferred_element_type=f32)
        # rowsum(dP * P) = rowsum(dO * O) (flash attention's delta)
        delta = jnp.einsum("bskgd,bskgd->bkgs", dog.astype(f32), out[:, rows].reshape(qg.shape).astype(f32))
        dscores = probs * (dprobs - delta[..., None]) * scale
        dqs.append(jnp.einsum("bkgst,btkd->bskgd", dscores.astype(q.dtype), k_b).reshape(b, -1, h, d))
        # dK and dV contract the query positions s, major in dscores / probs: move the small
        # q and dO ([.., d, s]) instead of the [s, t] matrices.
        q_t = materialized_transpose(qg, (0, 2, 3, 4, 1))  # [b, k, g, d, s]
        do_t = materialized_transpose(dog, (0, 2, 3, 4, 1))
        dk_b = jnp.einsum("bkgds,bkgst->btkd", q_t, dscores.astype(q.dtype), preferred_element_type=f32)
        dv_b = jnp.einsum("bkgds,bkgst->btkd", do_t, probs.astype(v.dtype), preferred_element_type=f32)
        pad = ((0, 0), (0, k.shape[1] - end), (0, 0), (0, 0))  # keys past this block's end: 0
        dk = jnp.pad(dk_b, pad) if dk is None else dk + jnp.pad(dk_b, pad)
        dv = jnp.pad(dv_b, pad) if dv is None else dv + jnp.pad(dv_b, pad)
    dq = jnp.concatenate(dqs, axis=1) if len(dqs) > 1 else dqs[0]
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_cpu_attention.defvjp(_cpu_attention_fwd, _cpu_attention_bwd)


def cpu_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None):
    """`xla_attention` with its own VJP, for CPU: the forward keeps q, k, v, the output and
    the log-sum-exp instead of the [b, heads, s, t] probabilities (the scanned layers
    stacked them for every layer, zero-filled and copied each step), and the backward
    recomputes them with one extra QK^T. dK and dV take the transposed q / dO rather than
    transposing the [s, t] matrices. A causal self-attention runs in query blocks that
    skip the keys after their last row (`causal_query_blocks`). Equal to autodiff of
    `xla_attention` (tests/test_attention_dispatch.py)."""
    b, s = q.shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    return _cpu_attention(q, k, v, segment_ids, causal, sliding_window, q.shape[-1] ** -0.5)


def attend(q, k, v, *, segment_ids=None, causal=True, impl="xla", sliding_window=None, context_impl="ring"):
    """Dispatch to one attention implementation (see module docstring)."""
    impl = resolve_impl(impl)
    if _context_size() > 1:
        return _context_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            causal=causal,
            impl=impl,
            sliding_window=sliding_window,
            context_impl=context_impl,
        )
    if impl == "xla":
        if on_cpu():
            return cpu_attention(
                q, k, v, segment_ids=segment_ids, causal=causal, sliding_window=sliding_window
            )
        return xla_attention(q, k, v, segment_ids=segment_ids, causal=causal, sliding_window=sliding_window)
    if impl == "pallas":
        return _pallas_attention(
            q, k, v, segment_ids=segment_ids, causal=causal, sliding_window=sliding_window
        )
    raise ValueError(f"attention impl={impl!r}: expected one of auto, xla, pallas")


def _batch_and_head_axes(q, rules, mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes the active rules give the `batch` and `act_heads` dims of `q`."""

    def axes(logical, dim):
        spec = sharding.logical_to_spec((logical,), rules, mesh, shape=q.shape[dim : dim + 1])
        return sharding.axes_tuple(spec[0] if spec else None)

    return axes("batch", 0), axes("act_heads", 2)


def _pallas_attention(q, k, v, *, segment_ids, causal, sliding_window):
    """The flash kernel per shard: batch and heads split as the active rules split
    the `batch` / `act_heads` activations, so no collective is needed around it."""
    from jaxtrain.pallas_kernels import sharded_flash_attention

    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.current_rules()
    if mesh.empty or rules is None:
        return sharded_flash_attention(
            q,
            k,
            v,
            mesh=None,
            batch_axes=(),
            head_axes=(),
            causal=causal,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
        )
    batch_axes, head_axes = _batch_and_head_axes(q, rules, mesh)
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
    )


def _context_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "context" not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))["context"]


def _context_attention(q, k, v, *, segment_ids, causal, impl, sliding_window, context_impl):
    """Ring or Ulysses attention over the `context` mesh axis; batch and heads split
    as the active rules split the `batch` / `act_heads` activations. Inputs are in
    zig-zag order (load balanced)."""
    from jaxtrain.pallas_kernels import ring_attention, ulysses_attention

    if sliding_window is not None and context_impl != "ulysses":
        raise ValueError(
            f"model.sliding_window={sliding_window} with mesh.context > 1 needs "
            f"model.context_impl=ulysses (the ring has no windowed chunk schedule)"
        )
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
        block_impl=impl,
    )
    if context_impl == "ring":
        return ring_attention(q, k, v, **kwargs)
    if context_impl == "ulysses":
        return ulysses_attention(q, k, v, sliding_window=sliding_window, **kwargs)
    raise ValueError(f"context_impl={context_impl!r}: expected ring or ulysses")
