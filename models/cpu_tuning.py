"""Program changes for XLA:CPU, on when `model.cpu_tuning` is true (jaxtrain resolves its
`auto` to true when the program runs on CPU: planning/resolve.py). Each computes the same
values as the portable program it replaces (tests/test_cpu_tuning.py); what differs is the
program XLA:CPU is given. A TPU or GPU program never contains them. Their measured benefit
is on the docs' CPU page.

- `einsum`, the weight matmuls' transpose-free gradient. Autodiff's weight gradient
  `dw = x^T @ dy` contracts the token dims, the *major* dims of both operands. XLA:CPU's dot
  kernels want the contracted dim minor on the left-hand side, so the compiler transposes
  one operand first, and it picks `dy` when `dy` comes out of an elementwise fusion
  (SwiGLU's backward, the softmax gradient): a strided [tokens, 1024] or [tokens, vocab]
  transpose that ran at under 1 GB/s and cost more than the matmul itself. Here the
  *smaller* of `x` and `dy` is moved (token dims last) behind an optimization barrier, so
  that XLA cannot fold the transpose back into the dot, and `dw` is a plain row-major matmul;
  `dx = dy @ w^T` is already in the kernels' layout. Float32 only by default: with bfloat16
  operands the step was slower this way, so bf16 keeps autodiff's program, except where a
  caller asks (`any_dtype`: the vocab-parallel output head, whose bf16 weight gradient
  autodiff leaves to XLA:CPU's slow Eigen dot).
- `attention`, XLA attention with its own VJP: the forward keeps q, k, v, the output and
  the log-sum-exp instead of the [b, heads, s, t] probabilities (the scanned layers stacked
  them for every layer, zero-filled and copied each step), and the backward recomputes them
  with one extra QK^T. A causal self-attention runs in query blocks that skip the keys after
  their last row (`causal_query_blocks`).
- `gathered_weight`: a layer's matmul weight constrained to its layout gathered over fsdp,
  so that under `model.remat: none` the backward pass reuses the forward's gathered copy
  instead of all-gathering it again (each collective is a rendezvous of every simulated
  device's thread on a CPU host). In bfloat16 only (`ModelConfig.gathers_weights_once`): in
  float32 the step was slower this way. The copies cost the layers' weights in the compute
  dtype per device, which planning/footprint.py counts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxtrain.models.masks import attention_mask, masked_scores
from jaxtrain.sharding import constrain


def einsum(eqn: str, x: jax.Array, w: jax.Array, *, any_dtype: bool = False) -> jax.Array:
    """`jnp.einsum(eqn, x, w)`; a weight matmul of the form `tokens + K, K + N -> tokens + N`
    (e.g. "bsd,dhk->bshk", "bshk,hkd->bsd", "...d,df->...f") in float32 (any dtype with
    `any_dtype`) takes the transpose-free gradient (module docstring)."""
    contract = _weight_matmul_contract(eqn)
    if contract is None or not (any_dtype or x.dtype == jnp.float32):
        return jnp.einsum(eqn, x, w)
    if x.shape[x.ndim - contract :] != w.shape[:contract]:
        raise ValueError(
            f"einsum {eqn!r}: x {x.shape} and w {w.shape} do not share their {contract} contracted dims"
        )
    return _dense(x, w, contract)


@functools.lru_cache(maxsize=64)
def _weight_matmul_contract(eqn: str) -> int | None:
    eqn = eqn.replace(" ", "")
    if "->" not in eqn or eqn.count(",") != 1:
        return None
    ins, out = eqn.split("->")
    xs, ws = ins.split(",")
    if "." in ws:
        return None
    k = [c for c in ws if c not in out]
    n = ws[len(k) :]
    if not k or ws[: len(k)] != "".join(k) or not xs.endswith("".join(k)):
        return None
    tokens = xs[: len(xs) - len(k)]
    if any(c in ws for c in tokens.replace(".", "")) or out != tokens + n:
        return None
    return len(k)


def _flat(x, w, contract):
    """(x as [T, K], w as [K, N])."""
    k = math.prod(w.shape[:contract])
    return x.reshape(-1, k), w.reshape(k, -1)


def _plain(x, w, contract):
    return jnp.tensordot(x, w, axes=contract)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense(x, w, contract):
    return _plain(x, w, contract)


def _dense_fwd(x, w, contract):
    return _plain(x, w, contract), (x, w)


def materialized_transpose(x: jax.Array, axes) -> jax.Array:
    """`jnp.transpose(x, axes)` as a real copy: the optimization barrier keeps XLA from
    folding the transpose back into the consumer dot (module docstring)."""
    return jax.lax.optimization_barrier(jnp.transpose(x, axes))


def _dense_bwd(contract, res, g):
    x, w = res
    x2, w2 = _flat(x, w, contract)
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    # dx = dy w^T as [T, N] x [K, N] contracting N (no transpose of w in the program, so the
    # forward's all-gathered weight serves here too)
    dx = jax.lax.dot_general(g2, w2, (((1,), (1,)), ((), ()))).astype(x.dtype).reshape(x.shape)
    if x2.shape[1] <= g2.shape[1]:
        dw = jnp.dot(materialized_transpose(x2, (1, 0)), g2)  # [K, T] x [T, N]
    else:
        dw = jnp.dot(
            materialized_transpose(g2, (1, 0)), x2
        ).T  # ([N, T] x [T, K])^T: a weight-sized transpose
    return dx, dw.astype(w.dtype).reshape(w.shape)


_dense.defvjp(_dense_fwd, _dense_bwd)


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
def _attention(q, k, v, segment_ids, causal, sliding_window, scale):
    return _attention_fwd(q, k, v, segment_ids, causal, sliding_window, scale)[0]


def _block_mask(segment_ids, rows, kv_end, causal, sliding_window):
    return attention_mask(
        segment_ids[:, rows],
        segment_ids[:, :kv_end],
        causal=causal,
        sliding_window=sliding_window,
        q_offset=rows.start,
    )


def _attention_fwd(q, k, v, segment_ids, causal, sliding_window, scale):
    b, s, h, d = q.shape
    kv = k.shape[2]
    outs, lses = [], []
    for rows, end in _blocks(q, k, causal):
        qg = q[:, rows].reshape(b, -1, kv, h // kv, d)
        mask = _block_mask(segment_ids, rows, end, causal, sliding_window)
        scores = masked_scores(qg, k[:, :end], mask, scale)
        lse = jax.nn.logsumexp(scores, axis=-1)  # [b, k, g, rows]
        probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
        outs.append(jnp.einsum("bkgst,btkd->bskgd", probs, v[:, :end]).reshape(b, -1, h, d))
        lses.append(lse)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=-1) if len(lses) > 1 else lses[0]
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(causal, sliding_window, scale, res, dout):
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
        probs = jnp.exp(masked_scores(qg, k_b, mask, scale) - lse[..., rows, None])  # recomputed, f32
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


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None):
    """models/attention.py `xla_attention` with its own VJP (module docstring). dK and dV take
    the transposed q / dO rather than transposing the [s, t] matrices."""
    b, s = q.shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    return _attention(q, k, v, segment_ids, causal, sliding_window, q.shape[-1] ** -0.5)


def gathered_weight(w: jax.Array, logical_axes) -> jax.Array:
    """A weight constrained to its layout gathered over fsdp (`embed` whole, the
    tensor-sharded dims kept): module docstring."""
    return constrain(w, tuple(None if name == "embed" else name for name in logical_axes))
