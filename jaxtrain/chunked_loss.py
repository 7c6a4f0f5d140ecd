"""Cross-entropy over the vocabulary in chunks of sequence positions (`train.loss_chunk`).

The plain loss materialises the `[tokens, vocab]` logits in f32 (and the softmax and its
cotangent alongside them in the backward pass): with a 32k-128k vocabulary that is the
largest temporary of a small model's step. Here the output projection, log-softmax and
its gradient run one chunk of positions at a time inside a `lax.scan`, so only
`[batch, chunk, vocab]` of them is ever live.

The backward is fused into the forward (a custom VJP, as in Liger's fused linear
cross-entropy): the gradient of a sum of token losses with respect to the logits does not
depend on the incoming cotangent except by a scalar factor, so each chunk computes its
loss, `d loss / d x` and its share of `d loss / d head` while its logits are live; the
backward pass only multiplies them by the cotangent. That is three matmuls of the head's
size per token, as in the plain loss, with no recompute. Without differentiation (eval)
the scan computes the losses alone.

Chunk m holds positions m, m + n, m + 2n, ... (n chunks), so a sequence dimension sharded
contiguously over devices (context parallelism) stays sharded the same way in every chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.sharding import constrain

_F32 = jnp.float32
_CHUNK_AXES = ("head_batch", "seq")  # the head's rows (sharding.vocab_parallel_head)
_HEAD_AXES = ("head_embed", "head_vocab")  # the head as [d_model, vocab], as lm_head (embedding.T if tied)


def chunked_cross_entropy(
    x: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array, *, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token losses, number of counted tokens), both f32, of the
    logits `x @ head` without ever forming them all at once.

    `x` [batch, seq, d_model]: the final-normed activations; the matmuls run in its dtype
    (the compute dtype) with f32 accumulation, float16 excepted (its backward matmuls run
    in f32, since the unscaled logit gradients would underflow). `head` [d_model, vocab]
    (param dtype). `chunk`: positions per chunk; must divide seq.
    """
    seq = x.shape[1]
    if chunk < 1 or seq % chunk:
        raise ValueError(f"chunked_cross_entropy: chunk={chunk} must divide seq={seq}")
    mask = mask.astype(_F32)
    total = _ce_sum(x, head, targets, mask, seq // chunk)
    return total, jnp.sum(mask)


def _split(a: jax.Array, n: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S/n, ...]; chunk m = positions m, m + n, ... (see module doc)."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // n, n, *a.shape[2:]), 2, 0)


def _unsplit(a: jax.Array) -> jax.Array:
    """Inverse of `_split`."""
    n, b, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(b, c * n, *a.shape[3:])


def _chunk_logits(x_c, head_c):
    logits = jnp.einsum("bsd,dv->bsv", x_c, head_c, preferred_element_type=_F32)
    return constrain(logits, (*_CHUNK_AXES, "act_vocab"))


def _chunk_loss(logits, t_c, m_c):
    """(masked loss sum, row max, log-sum-exp relative to it) of one chunk's f32 logits.

    Every [batch, chunk, vocab] pass reads all the logits (and on CPU a reduction makes
    XLA write its input out first), so there are as few as the maths allows: the row max,
    the sum of exp(logits - max), and in the backward the gradient. Nothing reads a
    shifted copy of the logits (it would be written out for its readers), and the
    target's logit is gathered, not picked out by a [tokens, vocab] select and summed;
    both partition over a sharded vocabulary (a masked local gather and a sum over the
    shards, as in optax's softmax_cross_entropy_with_integer_labels)."""
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    logsum = jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
    label = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    return jnp.sum((logsum - (label - peak)) * m_c), peak, logsum


def _inputs(x, head, targets, mask, n):
    head_c = constrain(head.astype(x.dtype), (None, "act_vocab"))  # gathered once, outside the scan
    x_chunks = constrain(_split(x, n), (None, *_CHUNK_AXES, None))
    return head_c, (x_chunks, _split(targets, n), _split(mask, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ce_sum(x, head, targets, mask, n):
    head_c, chunks = _inputs(x, head, targets, mask, n)

    def body(total, c):
        x_c, t_c, m_c = c
        loss, *_ = _chunk_loss(_chunk_logits(x_c, head_c), t_c, m_c)
        return total + loss, None

    total, _ = jax.lax.scan(body, jnp.zeros((), _F32), chunks)
    return total


def _ce_sum_fwd(x, head, targets, mask, n):
    head_c, chunks = _inputs(x, head, targets, mask, n)
    grad_dtype = _F32 if x.dtype == jnp.float16 else x.dtype
    head_g = head_c.astype(grad_dtype)

    def body(carry, c):
        total, dhead = carry
        x_c, t_c, m_c = c
        logits = _chunk_logits(x_c, head_c)
        loss, peak, logsum = _chunk_loss(logits, t_c, m_c)
        # softmax - one-hot in one pass over the logits. Not exp((logits - peak) - logsum):
        # XLA would share `logits - peak` with the sum above and write it out for both.
        # (The iota compare partitions over a sharded vocabulary.)
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t_c[..., None]
        dlogits = (jnp.exp((logits - logsum[..., None]) - peak[..., None]) - onehot) * m_c[..., None]
        dlogits = dlogits.astype(grad_dtype)
        dx_c = jnp.einsum("bsv,dv->bsd", dlogits, head_g, preferred_element_type=_F32)
        dhead_c = jnp.einsum("bsd,bsv->dv", x_c.astype(grad_dtype), dlogits, preferred_element_type=_F32)
        dhead = constrain(dhead + dhead_c, _HEAD_AXES)
        return (total + loss, dhead), constrain(dx_c, (*_CHUNK_AXES, None))

    zero_dhead = constrain(jnp.zeros(head.shape, _F32), _HEAD_AXES)
    (total, dhead), dx = jax.lax.scan(body, (jnp.zeros((), _F32), zero_dhead), chunks)
    # zero-size arrays carry the primal dtypes to the backward pass (residuals are arrays)
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), head.dtype))
    return total, (_unsplit(dx), dhead, dtypes)


def _ce_sum_bwd(n, res, g):
    dx, dhead, (x_like, head_like) = res
    return (g * dx).astype(x_like.dtype), (g * dhead).astype(head_like.dtype), None, None


_ce_sum.defvjp(_ce_sum_fwd, _ce_sum_bwd)
