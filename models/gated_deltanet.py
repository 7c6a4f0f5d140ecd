"""The gated delta rule (gated DeltaNet: Qwen3.5 / Qwen3.6, Qwen3-Next), in plain jnp.

The math of the linear-attention layers of the Qwen hybrids, exactly as transformers 5.25
computes it (`torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
`causal_conv1d_fn` / `_update`, `Qwen3_5RMSNormGated`): the references the Pallas kernel and
the layer module will be held to. Per value head h, with the state S [dk, dv]:

    S_t = exp(g_t) S_{t-1}                     decay (g_t <= 0)
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T   delta rule: write the error of S's read of k_t
    o_t = S_t^T q_t                           q_t, k_t L2-normalised (eps 1e-6), q_t * dk ** -0.5

Two forms, equal up to rounding: `recurrent_gated_delta_rule` (a scan over tokens: decode and
the reference) and `chunked_gated_delta_rule` (64-token chunks as flash-linear-attention: the
WY/UT transform inside a chunk solved as one unit-lower-triangular system, the state carried
from chunk to chunk), whose work is matmuls. Both run in float32 whatever the inputs' dtype
(transformers casts too) and return the final state [batch, v_heads, dk, dv] for decode.

Packed documents: `segment_ids` [batch, seq] resets the state (and the conv window) where the
id changes, so a packed row equals each document run alone. A reset is the decay exp(g) = 0
at the document's first token; the chunked form cannot hold log 0, so it masks each product of
decays that crosses a reset instead. An `initial_state` / `conv_state` belongs to the row's
first document. (transformers' torch fallbacks ignore `cu_seqlens`; its fla kernels honour it.)

Key heads are grouped over value heads as transformers' `repeat_interleave`: value head h reads
key head h // (v_heads // k_heads), the convention of GQA elsewhere in jaxtrain.

Hugging Face layouts (D = hidden_size, hk/hv key/value heads, dk/dv their dims, r = hv // hk):
- Qwen3.5: in_proj_qkv [2 hk dk + hv dv, D] (rows: all q heads, all k heads, all v heads),
  in_proj_z [hv dv, D], in_proj_b [hv, D], in_proj_a [hv, D].
- Qwen3-Next: in_proj_qkvz [hk (2 dk + 2 r dv), D], rows per key head group: q (dk), k (dk),
  v (r dv), z (r dv); in_proj_ba [2 hv, D], rows per key head group: b (r), a (r).
  `qwen3_next_projections_as_qwen3_5` reorders them into the Qwen3.5 layout.
- Both: conv1d.weight [2 hk dk + hv dv, 1, kernel 4], no bias, over the q|k|v channels (not
  z), then split q | k | v; A_log, dt_bias [hv]; norm.weight [dv] plain (x * w, init 1), eps
  rms_norm_eps, shared by all value heads, gated by z's head; out_proj [D, hv dv].
  transformers' conv state is the last `kernel` inputs [batch, channels, kernel]; ours the
  last kernel - 1, [batch, kernel - 1, channels].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.pallas_kernels.gated_delta_inputs import CHUNK_SIZE  # shared with the Pallas kernel
from jaxtrain.pallas_kernels.gated_delta_inputs import continues as _continues
from jaxtrain.pallas_kernels.gated_delta_inputs import initial_state as _initial_state
from jaxtrain.pallas_kernels.gated_delta_inputs import prepare as _prepare

_HI = jax.lax.Precision.HIGHEST  # the reference is float32 throughout, as transformers'


def decay_and_beta(a, b, a_log, dt_bias):
    """Per value head, from the `in_proj_a` / `in_proj_b` outputs `a`, `b` [..., hv]: the log
    decay g = -exp(A_log) * softplus(a + dt_bias) in float32 (fp16 A would overflow to -inf)
    and beta = sigmoid(b) in b's dtype, as transformers."""
    g = -jnp.exp(jnp.asarray(a_log, jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    return g, jax.nn.sigmoid(b)


def gated_rms_norm(x, z, weight, eps: float = 1e-6):
    """`Qwen3_5RMSNormGated` / `Qwen3NextRMSNormGated` over the last axis (each head's dv):
    x normalised in float32, times the plain weight (init 1, no 1 + w) in x's dtype, times
    SiLU(z) in float32, back to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = weight * xf.astype(x.dtype)
    return (h * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def causal_conv1d(x, weight, *, segment_ids=None, conv_state=None):
    """Depthwise causal conv over the sequence, then SiLU (`causal_conv1d_fn` / `_update`).

    x [batch, seq, channels]; weight [channels, kernel] (HF's conv1d.weight [channels, 1,
    kernel] squeezed): out[t] = sum_j weight[:, j] * x[t - (kernel - 1) + j], so the last tap
    reads the current token. `conv_state` [batch, kernel - 1, channels]: the inputs before x
    (decode; zeros when None). `segment_ids`: taps reaching into another document read zero.
    Sums in float32. Returns (out in x's dtype, the new conv state: the last kernel - 1 inputs, those of an
    earlier document than the last token's zeroed)."""
    batch, seq, channels = x.shape
    if weight.ndim != 2 or weight.shape[0] != channels:
        raise ValueError(f"conv weight {weight.shape}: expected [channels={channels}, kernel]")
    width = weight.shape[1] - 1
    if conv_state is None:
        conv_state = jnp.zeros((batch, width, channels), x.dtype)
    elif conv_state.shape != (batch, width, channels):
        raise ValueError(f"conv_state {conv_state.shape}: expected {(batch, width, channels)}")
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq), jnp.int32)
    # The state's inputs belong to the row's first document.
    segp = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width, axis=1), segment_ids], axis=1)
    xf, wf = xp.astype(jnp.float32), weight.astype(jnp.float32)  # one rounding, as a conv kernel's
    out = jnp.zeros((batch, seq, channels), jnp.float32)
    for j in range(width + 1):
        same = (segp[:, j : j + seq] == segment_ids)[..., None]
        out = out + jnp.where(same, xf[:, j : j + seq], 0) * wf[:, j]
    new_state = jnp.where((segp[:, -width:] == segment_ids[:, -1:])[..., None], xp[:, -width:], 0)
    return jax.nn.silu(out).astype(x.dtype), new_state


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    segment_ids=None,
    *,
    use_qk_l2norm_in_kernel: bool = True,
):
    """The gated delta rule token by token (`torch_recurrent_gated_delta_rule`).

    q, k [batch, seq, k_heads, dk]; v [batch, seq, v_heads, dv]; g (log decay), beta
    [batch, seq, v_heads]; initial_state [batch, v_heads, dk, dv]; segment_ids [batch, seq].
    `use_qk_l2norm_in_kernel`: L2-normalise q and k here (True in both families' layers); q
    is always scaled by dk ** -0.5. Returns (out [batch, seq, v_heads, dv] in q's dtype, the
    final state [batch, v_heads, dk, dv] in float32)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    state = _initial_state(initial_state, q, v)
    keep = _continues(segment_ids, v.shape[:2])

    def step(state, xs):
        q_t, k_t, v_t, g_t, beta_t, keep_t = xs
        state = state * (jnp.exp(g_t) * keep_t[:, None])[..., None, None]
        read = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HI)
        delta = (v_t - read) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=_HI)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, keep))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), state


def chunked_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    segment_ids=None,
    *,
    chunk_size: int = CHUNK_SIZE,
    use_qk_l2norm_in_kernel: bool = True,
):
    """The gated delta rule by chunks (`torch_chunk_gated_delta_rule`); arguments and results
    as `recurrent_gated_delta_rule`. The sequence is padded to a multiple of `chunk_size` with
    tokens that neither decay nor write (g = beta = 0), so the final state is exact."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    state = _initial_state(initial_state, q, v)
    batch, seq, heads, _ = v.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq), jnp.int32)
    _continues(segment_ids, (batch, seq))  # validates the shape
    pad = -seq % chunk_size
    n, c = (seq + pad) // chunk_size, chunk_size

    def chunks(x):  # [b, s, h, ...] -> [b, h, n, c, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, n, c, *x.shape[2:]), 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    seg = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge").reshape(batch, 1, n, c)
    seg_before = jnp.concatenate([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], axis=2)  # [b, 1, n, 1]
    same = seg[..., :, None] == seg[..., None, :]  # [b, 1, n, c, c] (i, j): one document
    carried = (seg == seg_before).astype(jnp.float32)  # token i still in the incoming state's document
    to_end = (seg == seg[..., -1:]).astype(jnp.float32)  # token j in the chunk's last document

    cum = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start to i
    causal = jnp.tril(jnp.ones((c, c), bool))
    # decay[i, j]: product of the decays after j up to i (j <= i, one document), else 0; masked
    # before exp, where the upper triangle could overflow.
    decay = jnp.exp(jnp.where(causal & same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strictly_lower = jnp.tril(jnp.ones((c, c), jnp.float32), -1)
    strict = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=_HI) * decay * strictly_lower
    # WY representation: (I + strictly_lower(diag(beta) K K^T * decay)) U = the chunk's writes.
    system = strict + jnp.eye(c, dtype=jnp.float32)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(  # noqa: E731
        system, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    from_start = jnp.exp(cum) * carried
    new_values = solve(v * beta[..., None])
    k_cumdecay = solve(k_beta * from_start[..., None])
    intra = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=_HI) * decay
    q_decayed = q * from_start[..., None]
    k_decayed = k * (jnp.exp(cum[..., -1:] - cum) * to_end)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * carried[..., -1]  # [b, h, n]

    def step(state, xs):
        new_values, k_cumdecay, intra, q_decayed, k_decayed, chunk_decay = xs
        v_new = new_values - jnp.einsum("bhck,bhkv->bhcv", k_cumdecay, state, precision=_HI)
        out = jnp.einsum("bhck,bhkv->bhcv", q_decayed, state, precision=_HI)
        out = out + jnp.einsum("bhij,bhjv->bhiv", intra, v_new, precision=_HI)
        state = state * chunk_decay[..., None, None]
        state = state + jnp.einsum("bhck,bhcv->bhkv", k_decayed, v_new, precision=_HI)
        return state, out

    xs = (new_values, k_cumdecay, intra, q_decayed, k_decayed, chunk_decay)
    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in xs))
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, n * c, -1)[:, :, :seq]
    return jnp.swapaxes(out, 1, 2).astype(out_dtype), state


def qwen3_next_projections_as_qwen3_5(w_qkvz, w_ba, *, k_heads, v_heads, head_k_dim, head_v_dim):
    """Qwen3-Next's `in_proj_qkvz` [hk (2 dk + 2 r dv), D] and `in_proj_ba` [2 hv, D] (rows
    grouped per key head: q, k, v, z and b, a) as Qwen3.5's (`in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`): the same rows in the order of transformers'
    `fix_query_key_value_ordering`. numpy in, numpy out (weights at conversion)."""
    r = v_heads // k_heads
    w_qkvz, w_ba = np.asarray(w_qkvz), np.asarray(w_ba)
    d = w_qkvz.shape[-1]
    if w_qkvz.shape[0] != k_heads * (2 * head_k_dim + 2 * r * head_v_dim) or w_ba.shape[0] != 2 * v_heads:
        raise ValueError(f"in_proj_qkvz {w_qkvz.shape} / in_proj_ba {w_ba.shape}: not this layer's shapes")
    groups = w_qkvz.reshape(k_heads, -1, d)
    q, k, v, z = np.split(groups, np.cumsum([head_k_dim, head_k_dim, r * head_v_dim]), axis=1)
    b, a = np.split(w_ba.reshape(k_heads, 2 * r, d), [r], axis=1)
    qkv = np.concatenate([x.reshape(-1, d) for x in (q, k, v)])
    return qkv, z.reshape(-1, d), b.reshape(-1, d), a.reshape(-1, d)
