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

Per-block compute (``blocks``): the Pallas flash kernels on GPU/TPU (on
Hopper with ``gpu_kernel='mosaic'``, the Mosaic GPU kernels of ``flash_mgpu``),
an XLA block on CPU. Both return the block's output and log-sum-exp. The same blocks
run without a ring, over sequence chunks on one device, in ``chunked``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.pallas_kernels.blocks import (
    BlockConfig,
    bwd_pairs,
    empty_output,
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
    sink_grad,
)
from jaxtrain.pallas_kernels.mesh_utils import (
    axes_tuple,
    check_context_inputs,
    mesh_backend,
    shard_over_sequence,
)

__all__ = ["ring_attention"]


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
# The ring, per shard (inside shard_map).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    n: int
    causal: bool
    balanced: bool
    block: BlockConfig

    @property
    def chunks(self) -> int:
        return 2 if self.balanced else 1


def _shift(ring: _Ring, xs):
    """Send to the next shard on the ring (i -> i+1)."""
    if ring.n == 1:
        return xs
    perm = [(i, (i + 1) % ring.n) for i in range(ring.n)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis, perm), xs)


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


def _distance(ring: _Ring, step):
    """(q chunk, kv chunk) -> how many chunks the kv chunk (held at ``step``, from shard
    i - step) lies before the q chunk in sequence order: what a sliding window reads."""
    i = lax.axis_index(ring.axis)
    j = (i - step) % ring.n

    def position(shard, local):  # the chunk's index in sequence order
        return shard if not ring.balanced else jnp.where(local == 0, shard, 2 * ring.n - 1 - shard)

    return lambda qi, ki: position(i, qi) - position(j, ki)


def _ring_fwd_local(ring: _Ring, q, k, v, seg, sinks):
    c = q.shape[1] // ring.chunks

    def step_fn(step, kv, acc):
        distance = _distance(ring, step)
        return _run_step(
            ring, step, lambda pairs, acc: fwd_pairs(ring.block, pairs, c, q, seg, kv, acc, distance), acc
        )

    o, lse = with_sinks(*_ring_loop(ring, (k, v, seg), empty_output(q, v.shape[-1]), step_fn), sinks)
    return o.astype(q.dtype), lse


def _ring_bwd_local(ring: _Ring, q, k, v, seg, lse, do, delta):
    c = q.shape[1] // ring.chunks

    def step_fn(step, kv, grads):
        distance = _distance(ring, step)
        return _run_step(
            ring,
            step,
            lambda pairs, grads: bwd_pairs(ring.block, pairs, c, q, seg, kv, lse, do, delta, grads, distance),
            grads,
        )

    def send_kv_grads(grads):
        # dK/dV accumulators travel with their K/V; after n hops they are home.
        dq, dk, dv = grads
        return (dq, *_shift(ring, (dk, dv)))

    dq, dk, dv = _ring_loop(ring, (k, v, seg), zero_grads(q, k, v), step_fn, send_kv_grads)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, seg, sinks):
    return _ring_fwd_local(ring, q, k, v, seg, sinks)[0]


def _ring_fwd(ring, q, k, v, seg, sinks):
    o, lse = _ring_fwd_local(ring, q, k, v, seg, sinks)
    return o, (q, k, v, seg, sinks, o, lse)


def _ring_bwd(ring, res, do):
    q, k, v, seg, sinks, o, lse = res
    delta = softmax_delta(o, do)
    dq, dk, dv = _ring_bwd_local(ring, q, k, v, seg, lse, do, delta)
    # this shard's queries' part; shard_map's transpose sums it over the sequence (and batch)
    # shards, which the sinks are replicated over
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return dq, dk, dv, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


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
    softcap: float | None = None,
    sliding_window: int | None = None,
    load_balanced: bool = True,
    batch_axes=(),
    head_axes=(),
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_impl: str | None = None,
    gpu_kernel: str = "triton",
    sinks=None,
):
    """Exact attention on global ``[batch, seq, heads, head_dim]`` arrays whose
    sequence dim is sharded over ``axis_name`` (output sharded the same way).

    Args:
      q: [batch, seq, q_heads, head_dim]; k: [batch, seq, kv_heads, head_dim], v:
        [batch, seq, kv_heads, v_head_dim] (GQA: q_heads % kv_heads == 0; MLA: v's head dim
        differs).
      mesh: a ``Mesh`` or the ``AbstractMesh`` in context; ``axis_name`` is the ring.
      causal: causal mask in *sequence* order, derived from the chunk layout.
      segment_ids: optional [batch, seq] ints, in the same (permuted) order as q.
      softcap: optional logit cap, as for ``flash_attention``.
      sliding_window: optional causal window (``flash_attention``'s semantics, in sequence
        order): chunk pairs the window cannot reach are skipped, the others computed with
        the window shifted by their distance (``blocks``).
      load_balanced: inputs are in zig-zag order (``sharding.context``): shard i
        holds chunks i and 2n-1-i; seq must be a multiple of 2n. False: shard i
        holds contiguous chunk i.
      batch_axes, head_axes: mesh axes that also split batch / heads (no
        collective needed for them); kv heads must divide by the head shards.
      block_sizes, backend, interpret: passed to the flash kernels (GPU/TPU);
        backend defaults to the mesh's platform.
      block_impl: 'pallas' (flash kernels; interpret mode on CPU) or 'xla';
        None picks pallas on GPU/TPU and xla on CPU.
      gpu_kernel: the flash blocks' family on GPU: 'triton', or 'mosaic' (the Hopper
        kernels of ``flash_mgpu``; the chunk must be a multiple of their tile, 128 at
        head_dim <= 256, and ``block_sizes`` does not apply).
      sinks: optional [q_heads] logits, as for ``flash_attention``: added once to each
        query's softmax after the ring has merged every block.
    """
    check_context_inputs(q, k, v, mesh=mesh, axis_name=axis_name)
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
    batch_axes = axes_tuple("batch_axes", batch_axes)
    head_axes = axes_tuple("head_axes", head_axes)
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
        backend = mesh_backend(mesh)
    if interpret is None:
        interpret = backend == "cpu"
    if block_impl is None:
        block_impl = "xla" if backend == "cpu" else "pallas"
    if block_impl not in ("xla", "pallas"):
        raise ValueError(f"block_impl={block_impl!r}: expected 'xla', 'pallas' or None")
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
        scale=float(softmax_scale),
        chunk=seq // (n * chunks),
        q_heads=q_heads // n_head,
        kv_heads=kv_heads // n_head,
        head_dim=head_dim,
        block_sizes=block_sizes,
        interpret=bool(interpret),
        use_flash=block_impl == "pallas",
        softcap=check_softcap(softcap),
        window=check_window(sliding_window, causal),
        gpu_kernel=gpu_kernel,
        v_head_dim=None if v_head_dim == head_dim else v_head_dim,
    )
    ring = _Ring(axis=axis_name, n=n, causal=bool(causal), balanced=chunks == 2, block=block)

    return shard_over_sequence(
        lambda q, k, v, seg, sinks=None: _ring(ring, q, k, v, seg, sinks),
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
