"""Attention with a value head dim unlike the query/key one (MLA: 192 and 128) and with sink
logits (GPT-OSS: one per query head, in every softmax's denominator, no value): the XLA path
(`xla_attention`, `attend`) and the KV-cache decode (`generation._cached_attention`) against
a plain-jnp reference written here (explicit max / exp / sum, K and V repeated per query head)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import generation
from jaxtrain.models.attention import attend, xla_attention

HI = jax.lax.Precision.HIGHEST


def reference(q, k, v, visible, *, scale=None, sinks=None):
    """q [b, s, h, dqk], k [b, t, kvh, dqk], v [b, t, kvh, dv], visible bool [b, s, t] ->
    [b, s, h, dv]: o = sum_t exp(x_t - m) v_t / (sum_t exp(x_t - m) + exp(sink - m)), with
    m the row's max over the visible scores and the sink (no sink: no extra term)."""
    h, kvh = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kf = jnp.repeat(k.astype(jnp.float32), h // kvh, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), h // kvh, axis=2)
    x = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), kf, precision=HI) * scale
    vis = visible[:, None]
    m = jnp.max(jnp.where(vis, x, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, jnp.float32)[None, :, None, None]
        m = jnp.maximum(m, sink)
    e = jnp.where(vis, jnp.exp(x - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    return jnp.einsum("bhst,bthd->bshd", e / denom, vf, precision=HI).astype(q.dtype)


def visible_mask(segment_ids, *, causal=True, window=None):
    """[b, s, s]: same document, causal, and (q - k < window)."""
    s = segment_ids.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None]
    keep = np.ones((s, s), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
        if not causal:
            keep &= j - i < window
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & keep[None]


def inputs(*, b=2, s=16, h=4, kvh=2, dqk=24, dv=16, seed=0):
    rq, rk, rv, rs = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(rq, (b, s, h, dqk), jnp.float32)
    k = jax.random.normal(rk, (b, s, kvh, dqk), jnp.float32)
    v = jax.random.normal(rv, (b, s, kvh, dv), jnp.float32)
    sinks = jax.random.normal(rs, (h,), jnp.float32)
    return q, k, v, sinks


SEGMENTS = np.array([[1] * 7 + [2] * 9, [1] * 16], np.int32)

CASES = {
    "dv<dqk gqa": dict(),
    "dv<dqk window segments": dict(window=5, segment_ids=SEGMENTS),
    "sinks": dict(sinks=True),
    "sinks window segments mqa": dict(sinks=True, window=4, segment_ids=SEGMENTS, kvh=1),
    "sinks non-causal scaled": dict(sinks=True, causal=False, scale=0.3),
}


def _case(case):
    c = dict(CASES[case])
    q, k, v, sinks = inputs(kvh=c.pop("kvh", 2))
    seg = c.pop("segment_ids", np.ones(q.shape[:2], np.int32))
    sinks = sinks if c.pop("sinks", False) else None
    causal, window, scale = c.pop("causal", True), c.pop("window", None), c.pop("scale", None)
    visible = visible_mask(seg, causal=causal, window=window)
    kw = dict(segment_ids=jnp.asarray(seg), causal=causal, sliding_window=window, softmax_scale=scale)
    return (q, k, v, sinks), visible, scale, kw


@pytest.mark.parametrize("case", CASES)
def test_xla_attention_forward_and_grads_equal_the_reference(case):
    (q, k, v, sinks), visible, scale, kw = _case(case)
    w = jax.random.normal(jax.random.key(9), (*q.shape[:3], v.shape[-1]))
    ours = lambda q, k, v, s: jnp.sum(w * xla_attention(q, k, v, sinks=s, **kw))
    ref = lambda q, k, v, s: jnp.sum(w * reference(q, k, v, visible, scale=scale, sinks=s))
    out = xla_attention(q, k, v, sinks=sinks, **kw)
    assert out.shape == (*q.shape[:3], v.shape[-1])
    # f32 against f32 at HIGHEST precision: summation order only
    np.testing.assert_allclose(out, reference(q, k, v, visible, scale=scale, sinks=sinks), atol=2e-5)
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    got = jax.grad(ours, argnums)(q, k, v, sinks)
    want = jax.grad(ref, argnums)(q, k, v, sinks)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, atol=5e-5)


def test_a_zero_sink_is_not_no_sink():
    q, k, v, _ = inputs()
    visible = visible_mask(np.ones(q.shape[:2], np.int32))
    zero = jnp.zeros(q.shape[2])
    with_zero = xla_attention(q, k, v, sinks=zero)
    np.testing.assert_allclose(with_zero, reference(q, k, v, visible, sinks=zero), atol=2e-5)
    # the first query sees one key: exp(x)/(exp(x) + exp(0)) of v, not all of v
    assert np.abs(np.asarray(with_zero - xla_attention(q, k, v))).max() > 1e-2


@pytest.mark.parametrize("case", ["dv<dqk gqa", "sinks"])
def test_attend_bypasses_the_cpu_tuned_path(case):
    (q, k, v, sinks), visible, _, kw = _case(case)
    out = attend(q, k, v, sinks=sinks, cpu_tuned=True, segment_ids=kw["segment_ids"])
    np.testing.assert_allclose(out, reference(q, k, v, visible, sinks=sinks), atol=2e-5)


@pytest.mark.parametrize(
    "impl, sinks, dv, match",
    [
        ("cudnn", True, 24, "attention sinks: not supported by attention impl='cudnn'"),
    ],
)
def test_unsupported_settings_are_refused(impl, sinks, dv, match):
    q, k, v, s = inputs(dv=dv)
    with pytest.raises(ValueError, match=match):
        attend(q, k, v, impl=impl, sinks=s if sinks else None)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_cached_decode_equals_the_reference(window, sinks):
    """One query per row over a ring of 6 slots: slots holding later, empty (-1) or
    out-of-window positions are invisible."""
    q, _, _, s = inputs(b=2, s=1, h=4, kvh=2)
    _, k, v, _ = inputs(b=2, s=6, seed=1)
    q_positions = np.array([7, 3], np.int32)
    kv_positions = np.array([[6, 7, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]], np.int32)
    visible = (kv_positions >= 0) & (kv_positions <= q_positions[:, None])
    if window is not None:
        visible &= q_positions[:, None] - kv_positions < window
    sinks = s if sinks else None
    out = generation._cached_attention(
        q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_positions, kv_positions, window, sinks=sinks
    )
    assert out.shape == (2, 1, 4, v.shape[-1])
    np.testing.assert_allclose(out, reference(q, k, v, visible[:, None], sinks=sinks), atol=2e-5)
