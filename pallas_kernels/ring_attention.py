"""Ring attention over a ``context`` mesh axis (Ring / Blockwise Ring Attention),
load-balanced for causal masks (zig-zag layout, as Megatron Context Parallel).

Each of the n shards holds a slice of the sequence of q, k, v (and segment ids).
Inside ``shard_map`` the K/V slices travel around the ring with ``lax.ppermute``;
at every step a shard attends its queries to the K/V slice it holds, and the
partial results merge through the log-sum-exp. The next transfer is issued
before the current block's compute so XLA can overlap the two. The backward
(``custom_vjp``) runs the same ring again: dQ accumulates at home, dK/dV
accumulators travel with K/V and arrive home after n hops. No shard ever holds
the full K/V or an S x S block of scores.

Layout. ``load_balanced=True``: the global arrays are in zig-zag order (see
``sharding.context.zigzag_permutation``): shard i holds sequence chunks i and
2n-1-i of 2n. ``False``: shard i holds contiguous chunk i of n. The causal mask
is derived from this chunk layout, never from the array index, so callers
permute every per-token input (and RoPE positions) once, and un-permute
outputs if they need sequence order. Per ring step each shard then computes
only the chunk pairs that are not fully masked (the rest are skipped, not
computed and discarded); balanced, every shard computes the same number, and
the one pair that differs between "kv from an earlier shard" and "from a later
one" is chosen by a scalar chunk index, not a conditional, so the step's
kernels sit in the loop body where XLA can schedule them between the ring
transfer's start and done (benchmarks/context.py checks the compiled schedule).

Memory. Chunks are read with dynamic slices of the shard's buffers and results
accumulated with dynamic_update_slice, which XLA does in place: no
split/concatenate copies and no select over whole chunks. Per device the ring
holds a fixed number of shard-sized buffers (f32 dQ/dK/dV, the dK/dV and K/V
in flight), so its memory falls as 1/context from context 2 on.

Per-block compute: the Pallas flash kernel on GPU/TPU (its forward and backward
kernels with separate q and kv segment ids), an XLA block on CPU. Both return
the block's output and log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

# The module, not the function of the same name that the package exports.
fa = importlib.import_module("jaxtrain.pallas_kernels.flash_attention")
from jaxtrain.pallas_kernels.sharded import _axes_tuple, _has_explicit_axes, _mesh_platform  # noqa: E402

__all__ = ["ring_attention", "chunked_attention"]

_NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------
# Chunk-pair schedule: which (q chunk, kv chunk) pairs shard i computes at step s.
# ----------------------------------------------------------------------------


def _pairs(causal: bool, balanced: bool, relation: str):
    """Local (q_chunk, kv_chunk, diagonal) pairs. relation: 'self' (step 0),
    'before' (the kv shard j comes before i in the ring order), 'after'."""
    chunks = 2 if balanced else 1
    if not causal:
        return [(a, b, False) for a in range(chunks) for b in range(chunks)]
    if not balanced:
        return {"self": [(0, 0, True)], "before": [(0, 0, False)], "after": []}[relation]
    # Shard i holds chunks (i, 2n-1-i); kv shard j holds (j, 2n-1-j).
    return {
        "self": [(0, 0, True), (1, 0, False), (1, 1, True)],
        "before": [(0, 0, False), (1, 0, False)],  # j < i: both q chunks see kv chunk j
        "after": [(1, 0, False), (1, 1, False)],  # j > i: only q chunk 2n-1-i sees kv
    }[relation]


# ----------------------------------------------------------------------------
# Block compute: (q, k, v) chunk pair -> (out, lse) and its backward.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BlockSpec:
    backend: str  # cpu -> XLA block; tpu/gpu -> flash kernels
    scale: float
    chunk: int  # chunk length (q and kv)
    q_heads: int
    kv_heads: int
    head_dim: int
    block_sizes: fa.BlockSizes | None
    interpret: bool
    use_flash: bool  # False: XLA block (CPU default)


def _xla_scores(spec, q, k, q_seg, k_seg, diagonal):
    b, c, h, d = q.shape
    g = spec.q_heads // spec.kv_heads
    qg = q.reshape(b, c, spec.kv_heads, g, d)
    s = (
        jnp.einsum(
            "bqkgd,btkd->bkgqt", qg, k, preferred_element_type=jnp.float32, precision=fa._precision(q.dtype)
        )
        * spec.scale
    )
    mask = None
    if diagonal:
        mask = (jnp.arange(c)[:, None] >= jnp.arange(k.shape[1])[None, :])[None, None, None]
    if q_seg is not None:
        seg = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        mask = seg if mask is None else mask & seg
    return s if mask is None else jnp.where(mask, s, _NEG_INF)


def _xla_fwd(spec, q, k, v, q_seg, k_seg, diagonal):
    s = _xla_scores(spec, q, k, q_seg, k_seg, diagonal)  # [b, kv, g, q, t]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = (
        jnp.einsum("bkgqt,btkd->bqkgd", p, v.astype(jnp.float32), precision=fa._precision(q.dtype))
        / jnp.moveaxis(jnp.where(l > 0, l, 1.0), -2, 1)[..., 0][..., None]
    )
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)[..., 0]
    b, c = q.shape[:2]
    return o.reshape(q.shape), lse.reshape(b, spec.q_heads, c)


def _xla_bwd(spec, q, k, v, q_seg, k_seg, diagonal, lse, do, delta):
    b, c, h, d = q.shape
    g = spec.q_heads // spec.kv_heads
    prec = fa._precision(q.dtype)
    s = _xla_scores(spec, q, k, q_seg, k_seg, diagonal)
    lse_g = lse.reshape(b, spec.kv_heads, g, c)[..., None]
    p = jnp.exp(s - lse_g)  # [b, kv, g, q, t]
    dog = do.astype(jnp.float32).reshape(b, c, spec.kv_heads, g, d)
    dv = jnp.einsum("bkgqt,bqkgd->btkd", p, dog, precision=prec)
    dp = jnp.einsum("bqkgd,btkd->bkgqt", dog, v.astype(jnp.float32), precision=prec)
    ds = p * (dp - delta.reshape(b, spec.kv_heads, g, c)[..., None]) * spec.scale
    dq = jnp.einsum("bkgqt,btkd->bqkgd", ds, k.astype(jnp.float32), precision=prec)
    dk = jnp.einsum(
        "bkgqt,bqkgd->btkd", ds, q.astype(jnp.float32).reshape(b, c, spec.kv_heads, g, d), precision=prec
    )
    return dq.reshape(q.shape), dk, dv


def _flash_cfg(spec: _BlockSpec, diagonal: bool, dtype) -> fa._Config:
    blocks = fa._resolve_blocks(spec.block_sizes, spec.backend, spec.chunk, spec.head_dim, dtype)
    for b in blocks.as_tuple():
        if spec.chunk % b:
            raise ValueError(
                f"ring attention chunk length {spec.chunk} (seq / (context shards"
                f" * chunks per shard)) must be a multiple of the flash block {b}"
            )
    cfg = fa._Config(
        backend=spec.backend,
        interpret=spec.interpret,
        causal=diagonal,
        window=None,
        scale=spec.scale,
        seq_len=spec.chunk,
        seq_pad=spec.chunk,
        head_dim=spec.head_dim,
        q_heads=spec.q_heads,
        kv_heads=spec.kv_heads,
        blocks=blocks,
        head_major=spec.backend == "tpu",
        vmem_limit=None,
    )
    if spec.backend == "tpu":
        cfg = dataclasses.replace(cfg, vmem_limit=fa._check_tpu_vmem(cfg, dtype))
    return cfg


def _seg_operands(cfg, q_seg, k_seg, bq, bk, q_tiled):
    """Like flash_attention._segment_inputs, with separate q-side and kv-side ids."""
    if q_seg is None:
        return [], []
    specs, _ = fa._segment_inputs(cfg, q_seg, bq, bk, q_tiled=q_tiled)
    return specs, [fa._vectors(q_seg, bq), fa._vectors(k_seg, bk)]


def _flash_fwd(spec, q, k, v, q_seg, k_seg, diagonal):
    cfg = _flash_cfg(spec, diagonal, q.dtype)
    bq, bk = cfg.blocks.for_kernel("fwd")
    g = cfg.group
    qk, kk, vk = (fa._to_kernel_layout(x, cfg) for x in (q, k, v))
    seg_specs, seg_ops = _seg_operands(cfg, q_seg, k_seg, bq, bk, True)
    in_specs = [
        fa._tile_spec(cfg, bq, lambda h: h),
        fa._whole_spec(cfg, lambda h: h // g),
        fa._whole_spec(cfg, lambda h: h // g),
        *seg_specs,
    ]
    lse_shape = (q.shape[0], cfg.q_heads, cfg.seq_pad // bq, 1, bq)
    ok, lse = fa._call(
        cfg,
        "fwd",
        fa._fwd_kernel,
        tiles=cfg.seq_pad // bq,
        in_specs=in_specs,
        operands=[qk, kk, vk, *seg_ops],
        out_specs=[fa._tile_spec(cfg, bq, lambda h: h), fa._vector_tile_spec(bq, per_head=True)],
        out_shape=[jax.ShapeDtypeStruct(qk.shape, qk.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)],
        has_segments=q_seg is not None,
    )
    o = fa._from_kernel_layout(ok, cfg, cfg.q_heads)
    return o, lse.reshape(q.shape[0], cfg.q_heads, cfg.seq_pad)


def _flash_bwd(spec, q, k, v, q_seg, k_seg, diagonal, lse, do, delta):
    cfg = _flash_cfg(spec, diagonal, q.dtype)
    g = cfg.group
    batch = q.shape[0]
    qk, kk, vk, dok = (fa._to_kernel_layout(x, cfg) for x in (q, k, v, do.astype(q.dtype)))
    has_seg = q_seg is not None
    bq, bk = cfg.blocks.for_kernel("dq")
    seg_specs, seg_ops = _seg_operands(cfg, q_seg, k_seg, bq, bk, True)
    dq = fa._call(
        cfg,
        "dq",
        fa._dq_kernel,
        tiles=cfg.seq_pad // bq,
        in_specs=[
            fa._tile_spec(cfg, bq, lambda h: h),
            fa._whole_spec(cfg, lambda h: h // g),
            fa._whole_spec(cfg, lambda h: h // g),
            fa._tile_spec(cfg, bq, lambda h: h),
            fa._vector_tile_spec(bq, per_head=True),
            fa._vector_tile_spec(bq, per_head=True),
            *seg_specs,
        ],
        operands=[qk, kk, vk, dok, fa._vectors(lse, bq), fa._vectors(delta, bq), *seg_ops],
        out_specs=fa._tile_spec(cfg, bq, lambda h: h),
        out_shape=jax.ShapeDtypeStruct(qk.shape, jnp.float32),
        has_segments=has_seg,
    )
    bq, bk = cfg.blocks.for_kernel("dkv")
    seg_specs, seg_ops = _seg_operands(cfg, q_seg, k_seg, bq, bk, False)
    if cfg.head_major:
        shape = (batch, cfg.q_heads, cfg.seq_pad, cfg.head_dim)
    else:
        shape = (batch, cfg.seq_pad, cfg.q_heads * cfg.head_dim)
    out_spec = fa._tile_spec(cfg, bk, lambda h: h)
    dk, dv = fa._call(
        cfg,
        "dkv",
        fa._dkv_kernel,
        tiles=cfg.seq_pad // bk,
        in_specs=[
            fa._whole_spec(cfg, lambda h: h),
            fa._tile_spec(cfg, bk, lambda h: h // g),
            fa._tile_spec(cfg, bk, lambda h: h // g),
            fa._whole_spec(cfg, lambda h: h),
            fa._vector_rows_spec(cfg, bq, per_head=True),
            fa._vector_rows_spec(cfg, bq, per_head=True),
            *seg_specs,
        ],
        operands=[qk, kk, vk, dok, fa._vectors(lse, bq), fa._vectors(delta, bq), *seg_ops],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32)] * 2,
        has_segments=has_seg,
    )
    dq = fa._from_kernel_layout(dq, cfg, cfg.q_heads)
    dk = fa._from_kernel_layout(dk, cfg, cfg.q_heads)
    dv = fa._from_kernel_layout(dv, cfg, cfg.q_heads)
    if g > 1:
        dk = dk.reshape(batch, cfg.seq_pad, cfg.kv_heads, g, -1).sum(axis=3)
        dv = dv.reshape(batch, cfg.seq_pad, cfg.kv_heads, g, -1).sum(axis=3)
    return dq, dk, dv


def _block_fwd(spec, *args):
    return (_flash_fwd if spec.use_flash else _xla_fwd)(spec, *args)


def _block_bwd(spec, *args):
    return (_flash_bwd if spec.use_flash else _xla_bwd)(spec, *args)


def _merge(o, lse, o_b, lse_b):
    """Combine two normalised partial attentions over disjoint key sets."""
    new = jnp.logaddexp(lse, lse_b)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)
    w = lambda l: jnp.moveaxis(jnp.exp(l - ref), 1, 2)[..., None]  # [b, c, h, 1]
    return o * w(lse) + o_b.astype(jnp.float32) * w(lse_b), new


# ----------------------------------------------------------------------------
# The ring, per shard (inside shard_map).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    n: int
    causal: bool
    balanced: bool
    block: _BlockSpec

    @property
    def chunks(self) -> int:
        return 2 if self.balanced else 1


def _shift(ring: _Ring, xs):
    """Send to the next shard on the ring (i -> i+1)."""
    if ring.n == 1:
        return xs
    perm = [(i, (i + 1) % ring.n) for i in range(ring.n)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis, perm), xs)


# A pair is (q chunk index, kv chunk index, diagonal); an index is a Python int
# or, where the step's relation ("before"/"after" in the ring) decides it, a
# traced int32 scalar. Chunks are read with dynamic_slice and accumulated with
# dynamic_update_slice into whole-shard buffers, which XLA updates in place:
# no split/concatenate copies and no select over whole chunks, so per-device
# memory is a fixed number of shard-sized buffers at every context size.


def _chunk(x, idx, size, axis=1):
    if x is None:
        return None
    if isinstance(idx, int):
        return lax.slice_in_dim(x, idx * size, (idx + 1) * size, axis=axis)
    return lax.dynamic_slice_in_dim(x, idx * size, size, axis=axis)


def _put(acc, idx, size, val, axis=1):
    if isinstance(idx, int):
        idx = jnp.int32(idx)
    return lax.dynamic_update_slice_in_dim(acc, val.astype(acc.dtype), idx * size, axis=axis)


def _step_pairs(ring: _Ring, step):
    """The (q chunk, kv chunk, diagonal) pairs this shard computes at ``step``.

    Step 0 is the shard's own kv. Later steps depend on whether the kv came
    from an earlier or a later shard; where the two relations differ by one
    pair with the same diagonal flag (the balanced causal layout), the chunk
    indices of that pair are picked with a scalar select, so the step has no
    conditional around its kernels and XLA can overlap them with the ring
    transfer. Returns None where a ``lax.cond`` is needed instead (contiguous
    causal: the kv from a later shard is fully masked).
    """
    if isinstance(step, int) and step == 0:
        return _pairs(ring.causal, ring.balanced, "self")
    before = _pairs(ring.causal, ring.balanced, "before")
    after = _pairs(ring.causal, ring.balanced, "after")
    if before == after:
        return before
    only_b = [p for p in before if p not in after]
    only_a = [p for p in after if p not in before]
    if len(only_b) == len(only_a) == 1 and only_b[0][2] == only_a[0][2]:
        is_before = _is_before(ring, step)
        pick = lambda t, f: t if t == f else jnp.where(is_before, jnp.int32(t), jnp.int32(f))
        (bq, bk, diag), (aq, ak, _) = only_b[0], only_a[0]
        return [p for p in before if p in after] + [(pick(bq, aq), pick(bk, ak), diag)]
    return None


def _is_before(ring: _Ring, step):
    i = lax.axis_index(ring.axis)
    return (i - step) % ring.n < i


def _run_step(ring: _Ring, step, fn, state):
    """fn(pairs, state) for this step's pairs (a lax.cond where unavoidable)."""
    pairs = _step_pairs(ring, step)
    if pairs is not None:
        return fn(pairs, state)
    before = _pairs(ring.causal, ring.balanced, "before")
    after = _pairs(ring.causal, ring.balanced, "after")
    return lax.cond(_is_before(ring, step), lambda s: fn(before, s), lambda s: fn(after, s), state)


def _ring_loop(ring: _Ring, kv, state, step_fn, after_step=None):
    """Run step_fn(step, kv, state) for steps 0..n-1, the kv slice moving one
    shard along the ring per step.

    Step 0 (the shard's own kv) and the last step are outside the loop; steps
    1..n-2 are a ``fori_loop``, so the program size does not grow with n. The
    transfer of the next kv slice is issued before the step's compute, which
    does not depend on it, so XLA can overlap the two. ``after_step`` (e.g.
    sending gradient accumulators on) runs after every step's compute.
    """
    after_step = after_step or (lambda st: st)
    nxt = _shift(ring, kv) if ring.n > 1 else None
    state = after_step(step_fn(0, kv, state))
    if ring.n == 1:
        return state

    def body(step, carry):
        state, kv = carry
        nxt = _shift(ring, kv)
        return after_step(step_fn(step, kv, state)), nxt

    state, kv = lax.fori_loop(1, ring.n - 1, body, (state, nxt))
    return after_step(step_fn(ring.n - 1, kv, state))


def _fwd_pairs(block: _BlockSpec, pairs, c, q, seg, kv, acc):
    """Attend q's chunks to kv = (k, v, kv segment ids)'s chunks for each (q chunk,
    kv chunk, diagonal) pair, merging into acc = (o f32, lse) in place."""
    ks, vs, ksegs = kv
    o, lse = acc
    for qi, ki, diagonal in pairs:
        o_b, lse_b = _block_fwd(
            block,
            _chunk(q, qi, c),
            _chunk(ks, ki, c),
            _chunk(vs, ki, c),
            _chunk(seg, qi, c),
            _chunk(ksegs, ki, c),
            diagonal,
        )
        o_a, lse_a = _merge(_chunk(o, qi, c), _chunk(lse, qi, c, axis=2), o_b, lse_b)
        o, lse = _put(o, qi, c, o_a), _put(lse, qi, c, lse_a, axis=2)
    return o, lse


def _bwd_pairs(block: _BlockSpec, pairs, c, q, seg, kv, lse, do, delta, grads):
    """The backward of _fwd_pairs: adds each pair's dQ to its q chunk and dK/dV to its
    kv chunk of grads = (dq, dk, dv) f32, in place."""
    ks, vs, ksegs = kv
    dq, dk, dv = grads
    for qi, ki, diagonal in pairs:
        gq, gk, gv = _block_bwd(
            block,
            _chunk(q, qi, c),
            _chunk(ks, ki, c),
            _chunk(vs, ki, c),
            _chunk(seg, qi, c),
            _chunk(ksegs, ki, c),
            diagonal,
            _chunk(lse, qi, c, axis=2),
            _chunk(do, qi, c),
            _chunk(delta, qi, c, axis=2),
        )
        dq = _put(dq, qi, c, _chunk(dq, qi, c) + gq)
        dk = _put(dk, ki, c, _chunk(dk, ki, c) + gk)
        dv = _put(dv, ki, c, _chunk(dv, ki, c) + gv)
    return dq, dk, dv


def _empty_output(q):
    """(o, lse) accumulators before any key: zeros and -inf."""
    b, L, h, d = q.shape
    return jnp.zeros((b, L, h, d), jnp.float32), jnp.full((b, h, L), _NEG_INF, jnp.float32)


def _zero_grads(q, k, v):
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))


def _delta(o, do):
    """rowsum(dO * O) per query, [b, h, L] f32: the softmax backward's correction term."""
    return jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))


def _ring_fwd_local(ring: _Ring, q, k, v, seg):
    c = q.shape[1] // ring.chunks

    def step_fn(step, kv, acc):
        return _run_step(
            ring, step, lambda pairs, acc: _fwd_pairs(ring.block, pairs, c, q, seg, kv, acc), acc
        )

    o, lse = _ring_loop(ring, (k, v, seg), _empty_output(q), step_fn)
    return o.astype(q.dtype), lse


def _ring_bwd_local(ring: _Ring, q, k, v, seg, o, lse, do):
    c = q.shape[1] // ring.chunks
    delta = _delta(o, do)

    def step_fn(step, kv, grads):
        return _run_step(
            ring,
            step,
            lambda pairs, grads: _bwd_pairs(ring.block, pairs, c, q, seg, kv, lse, do, delta, grads),
            grads,
        )

    def send_kv_grads(grads):
        # dK/dV accumulators travel with their K/V; after n hops they are home.
        dq, dk, dv = grads
        return (dq, *_shift(ring, (dk, dv)))

    dq, dk, dv = _ring_loop(ring, (k, v, seg), _zero_grads(q, k, v), step_fn, send_kv_grads)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, seg):
    return _ring_fwd_local(ring, q, k, v, seg)[0]


def _ring_fwd(ring, q, k, v, seg):
    o, lse = _ring_fwd_local(ring, q, k, v, seg)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(ring, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _ring_bwd_local(ring, q, k, v, seg, o, lse, do)
    return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------
# The same blocks on one device: attention over sequence chunks (no ring).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunked:
    chunks: int
    causal: bool
    block: _BlockSpec


def _chunk_pairs(spec: _Chunked):
    """(q chunk, kv chunk, diagonal) pairs in sequence order; causal skips j > i."""
    m = spec.chunks
    return [(i, j, spec.causal and i == j) for i in range(m) for j in range(m) if not (spec.causal and j > i)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(spec: _Chunked, q, k, v, seg):
    return _chunked_fwd_local(spec, q, k, v, seg)[0]


def _chunked_fwd_local(spec, q, k, v, seg):
    c = q.shape[1] // spec.chunks
    o, lse = _fwd_pairs(spec.block, _chunk_pairs(spec), c, q, seg, (k, v, seg), _empty_output(q))
    return o.astype(q.dtype), lse


def _chunked_fwd(spec, q, k, v, seg):
    o, lse = _chunked_fwd_local(spec, q, k, v, seg)
    return o, (q, k, v, seg, o, lse)


def _chunked_bwd(spec, res, do):
    q, k, v, seg, o, lse = res
    c = q.shape[1] // spec.chunks
    dq, dk, dv = _bwd_pairs(
        spec.block, _chunk_pairs(spec), c, q, seg, (k, v, seg), lse, do, _delta(o, do), _zero_grads(q, k, v)
    )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def flash_chunks_needed(
    seq: int,
    head_dim: int,
    dtype,
    *,
    backend: str,
    block_sizes: fa.BlockSizes | None = None,
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
            spec = _BlockSpec(
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
                _flash_cfg(spec, True, dtype)
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
    chunks: int | None = None,
    block_sizes: fa.BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_impl: str | None = None,
):
    """Exact attention on one device's ``[batch, seq, heads, head_dim]`` arrays, the
    sequence cut into ``chunks`` pieces: the ring's per-block kernels for every
    (q chunk, kv chunk) pair that is not fully masked, merged through the
    log-sum-exp, with nothing travelling. It lets the TPU flash kernels (which
    keep one head's whole K/V in VMEM) run sequences of any length, e.g. after
    Ulysses' all_to_all. ``chunks=None``: as few as the kernels need
    (``flash_chunks_needed``). Sequence order, no permutation.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), "
                f"got shape {getattr(x, 'shape', None)}"
            )
    batch, seq, q_heads, head_dim = q.shape
    if backend is None:
        backend = fa.resolve_backend(q)
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
    block = _BlockSpec(
        backend=backend,
        scale=float(softmax_scale or 1.0 / math.sqrt(head_dim)),
        chunk=seq // chunks,
        q_heads=q_heads,
        kv_heads=k.shape[2],
        head_dim=head_dim,
        block_sizes=block_sizes,
        interpret=bool(interpret),
        use_flash=block_impl == "pallas",
    )
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return _chunked(_Chunked(chunks=chunks, causal=bool(causal), block=block), q, k, v, seg)


# ----------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------


def ring_attention(
    q,
    k,
    v,
    *,
    mesh,
    axis_name: str = "context",
    causal: bool = True,
    segment_ids=None,
    softmax_scale: float | None = None,
    load_balanced: bool = True,
    batch_axes=(),
    head_axes=(),
    block_sizes: fa.BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_impl: str | None = None,
):
    """Exact attention on global ``[batch, seq, heads, head_dim]`` arrays whose
    sequence dim is sharded over ``axis_name`` (output sharded the same way).

    Args:
      q: [batch, seq, q_heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]
        (GQA: q_heads % kv_heads == 0).
      mesh: a ``Mesh`` or the ``AbstractMesh`` in context; ``axis_name`` is the ring.
      causal: causal mask in *sequence* order, derived from the chunk layout.
      segment_ids: optional [batch, seq] ints, in the same (permuted) order as q.
      load_balanced: inputs are in zig-zag order (``sharding.context``): shard i
        holds chunks i and 2n-1-i; seq must be a multiple of 2n. False: shard i
        holds contiguous chunk i.
      batch_axes, head_axes: mesh axes that also split batch / heads (no
        collective needed for them); kv heads must divide by the head shards.
      block_sizes, backend, interpret: passed to the flash kernels (GPU/TPU);
        backend defaults to the mesh's platform.
      block_impl: 'pallas' (flash kernels; interpret mode on CPU) or 'xla';
        None picks pallas on GPU/TPU and xla on CPU.
    """
    check_inputs(q, k, v, mesh=mesh, axis_name=axis_name)
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n = sizes[axis_name]
    chunks = 2 if (load_balanced and causal) else 1
    if seq % (n * chunks):
        raise ValueError(
            f"seq={seq} must be a multiple of {chunks} * {axis_name} size {n}"
            + (" (load-balanced causal layout)" if chunks == 2 else "")
        )
    if segment_ids is not None and tuple(segment_ids.shape) != (batch, seq):
        raise ValueError(f"segment_ids must have shape {(batch, seq)}, got {segment_ids.shape}")
    batch_axes = _axes_tuple("batch_axes", batch_axes)
    head_axes = _axes_tuple("head_axes", head_axes)
    for a in (*batch_axes, *head_axes):
        if a not in sizes or a == axis_name:
            raise ValueError(f"batch/head axis {a!r} must be a mesh axis other than {axis_name!r}")
    n_batch = math.prod(sizes[a] for a in batch_axes)
    n_head = math.prod(sizes[a] for a in head_axes)
    if batch % n_batch or q_heads % n_head or kv_heads % n_head:
        raise ValueError(
            f"batch {batch}, q heads {q_heads}, kv heads {kv_heads} must divide by "
            f"the batch shards {n_batch} / head shards {n_head}"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if backend is None:
        backend = _mesh_platform(mesh)
        backend = backend if backend in ("tpu", "gpu") else "cpu"
    if interpret is None:
        interpret = backend == "cpu"
    if block_impl is None:
        block_impl = "xla" if backend == "cpu" else "pallas"
    if block_impl not in ("xla", "pallas"):
        raise ValueError(f"block_impl={block_impl!r}: expected 'xla', 'pallas' or None")
    block = _BlockSpec(
        backend=backend,
        scale=float(softmax_scale),
        chunk=seq // (n * chunks),
        q_heads=q_heads // n_head,
        kv_heads=kv_heads // n_head,
        head_dim=head_dim,
        block_sizes=block_sizes,
        interpret=bool(interpret),
        use_flash=block_impl == "pallas",
    )
    ring = _Ring(axis=axis_name, n=n, causal=bool(causal), balanced=chunks == 2, block=block)

    return shard_over_sequence(
        lambda q, k, v, seg: _ring(ring, q, k, v, seg),
        q,
        k,
        v,
        segment_ids,
        mesh=mesh,
        axis_name=axis_name,
        batch_axes=batch_axes,
        head_axes=head_axes,
    )


def check_inputs(q, k, v, *, mesh, axis_name):
    """ValueError unless q, k, v are [batch, seq, heads, head_dim] (GQA allowed)
    and ``axis_name`` is a mesh axis."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([batch, seq, heads, head_dim]), "
                f"got shape {getattr(x, 'shape', None)}"
            )
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis (mesh axes: {mesh.axis_names})")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k and v must be [batch, seq, kv_heads, head_dim] like q: q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")


def shard_over_sequence(local, q, k, v, segment_ids, *, mesh, axis_name, batch_axes, head_axes):
    """Run ``local(q, k, v, seg)`` per shard: sequence split over ``axis_name``,
    batch over ``batch_axes``, heads over ``head_axes``; output laid out like q."""
    x_spec = P(batch_axes or None, axis_name, head_axes or None, None)
    seg_spec = P(batch_axes or None, axis_name)
    if segment_ids is None:
        fn_local = lambda q, k, v: local(q, k, v, None)
        in_specs, args = (x_spec,) * 3, (q, k, v)
    else:
        fn_local = lambda q, k, v, s: local(q, k, v, s.astype(jnp.int32))
        in_specs, args = (x_spec,) * 3 + (seg_spec,), (q, k, v, segment_ids)
    # check_vma=False: the Pallas kernels' out_shapes carry no manual-axis types
    # and interpret mode fails the varying-axes check (JAX_NOTES, Pallas).
    fn = jax.shard_map(fn_local, mesh=mesh, in_specs=in_specs, out_specs=x_spec, check_vma=False)
    if _has_explicit_axes(mesh):
        # Explicit axes: shard_map wants inputs laid out as in_specs already.
        abstract = isinstance(mesh, jax.sharding.AbstractMesh)
        args = tuple(
            jax.reshard(x, s if abstract else jax.NamedSharding(mesh, s)) for x, s in zip(args, in_specs)
        )
    return fn(*args)
