"""Ring and Ulysses attention on 8 simulated CPU devices vs single-device reference attention.

Oracle: `pallas_kernels.reference.attention` (full score matrix, f32, HIGHEST
precision) on the unsharded, unpermuted arrays. Inputs are f32; tolerance
2e-5 absolute on outputs and gradients (observed errors are about 1e-6: the
ring only reorders the f32 softmax sums).

The parametrization covers each axis of the requirement (context 2/4/8, causal
and not, segment ids, GQA, load-balanced and contiguous, mesh data=2 x
context=4) without the full product, to keep compile time to a few minutes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxtrain.pallas_kernels import (
    BlockSizes,
    chunked_attention,
    reference,
    ring_attention,
    ulysses_attention,
)
from jaxtrain.sharding.context import (
    causal_block_pairs,
    chunk_of_shard,
    inverse_permutation,
    permute_batch,
    zigzag_permutation,
)

TOL = 2e-5
B, S, D = 2, 32, 8


def _mesh(data, context):
    devices = jax.devices()[: data * context]
    return jax.make_mesh(
        (data, context), ("data", "context"), axis_types=(AxisType.Auto,) * 2, devices=devices
    )


def _inputs(heads, kv_heads, with_segments, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, S, heads, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, S, kv_heads, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, S, kv_heads, D), jnp.float32)
    w = jax.random.normal(ks[3], (B, S, heads, D), jnp.float32)  # output cotangent
    seg = None
    if with_segments:
        # Packed documents of uneven lengths, one boundary inside a shard.
        seg = jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 4, (B, S)), axis=1), jnp.int32)
    return q, k, v, w, seg


def _check_against_reference(
    attn,
    *,
    context,
    data=1,
    causal,
    heads=4,
    kv_heads=4,
    with_segments,
    load_balanced,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    mesh = _mesh(data, context)
    q, k, v, w, seg = _inputs(heads, kv_heads, with_segments)
    perm = zigzag_permutation(S, context) if load_balanced else np.arange(S)
    inv = inverse_permutation(perm)
    batch_axes = ("data",) if data > 1 else ()

    def sharded(q, k, v):
        out = attn(
            q[:, perm],
            k[:, perm],
            v[:, perm],
            mesh=mesh,
            causal=causal,
            segment_ids=None if seg is None else seg[:, perm],
            load_balanced=load_balanced,
            batch_axes=batch_axes,
            **({"sliding_window": sliding_window} if sliding_window else {}),
            **({"softcap": softcap} if softcap else {}),
            **kwargs,
        )
        return out[:, inv]

    def ref(q, k, v):
        return reference.attention(
            q, k, v, causal=causal, segment_ids=seg, sliding_window=sliding_window, softcap=softcap
        )

    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    out, grads = jax.jit(lambda *a: (sharded(*a), jax.grad(loss(sharded), (0, 1, 2))(*a)))(q, k, v)
    out_ref = ref(q, k, v)
    grads_ref = jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, out_ref, atol=TOL, rtol=0)
    for name, g, gr in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, gr, atol=TOL, rtol=0, err_msg=f"d{name}")


CASES = [
    # impl, context, data, causal, heads, kv_heads, segments, load_balanced
    pytest.param("ring", 2, 1, True, 4, 2, True, True, id="ring-ctx2-causal-gqa-seg-balanced"),
    pytest.param("ring", 4, 1, True, 4, 4, False, True, id="ring-ctx4-causal-balanced"),
    pytest.param("ring", 4, 1, True, 4, 1, True, False, id="ring-ctx4-causal-mqa-seg-contiguous"),
    pytest.param("ring", 8, 1, False, 4, 2, True, False, id="ring-ctx8-noncausal-gqa-seg"),
    pytest.param(
        "ring", 8, 1, True, 4, 4, True, True, id="ring-ctx8-causal-seg-balanced", marks=pytest.mark.slow
    ),
    pytest.param("ring", 4, 2, True, 4, 2, True, True, id="ring-data2-ctx4-causal-gqa-seg-balanced"),
    pytest.param("ulysses", 2, 1, True, 4, 2, True, True, id="ulysses-ctx2-causal-gqa-seg-balanced"),
    pytest.param("ulysses", 4, 1, False, 4, 4, True, False, id="ulysses-ctx4-noncausal-seg"),
    pytest.param("ulysses", 8, 1, True, 8, 2, False, False, id="ulysses-ctx8-causal-gqa-repeat-kv"),
    pytest.param("ulysses", 4, 2, True, 4, 4, True, True, id="ulysses-data2-ctx4-causal-seg-balanced"),
]


@pytest.mark.parametrize("impl,context,data,causal,heads,kv_heads,segments,balanced", CASES)
def test_matches_reference(impl, context, data, causal, heads, kv_heads, segments, balanced):
    attn = {"ring": ring_attention, "ulysses": ulysses_attention}[impl]
    _check_against_reference(
        attn,
        context=context,
        data=data,
        causal=causal,
        heads=heads,
        kv_heads=kv_heads,
        with_segments=segments,
        load_balanced=balanced,
    )


@pytest.mark.parametrize("block_impl,softcap", [("xla", None), ("pallas", 2.0)])
def test_ulysses_sliding_window_matches_reference(block_impl, softcap):
    """Window 6 spans shard and zig-zag chunk boundaries (chunks of 4 tokens); the flash
    kernel's case with a logit softcap too."""
    _check_against_reference(
        ulysses_attention,
        context=4,
        causal=True,
        heads=4,
        kv_heads=2,
        with_segments=True,
        load_balanced=True,
        sliding_window=6,
        softcap=softcap,
        block_impl=block_impl,
    )


@pytest.mark.parametrize(
    "context,balanced,window,softcap,segments,block_impl",
    [
        (4, True, 6, None, False, "xla"),  # zig-zag chunks of 4 tokens: the window reaches 2 back
        (4, False, 3, 2.0, True, "xla"),  # contiguous chunks of 8: it reaches 1; a logit softcap
        (2, True, 11, 2.0, False, "pallas"),  # the flash kernels' blocks (q_offset), chunks of 8
    ],
)
def test_ring_sliding_window_and_softcap_match_reference(
    context, balanced, window, softcap, segments, block_impl
):
    """Gemma's local layers over a ring: the window crosses shard and chunk boundaries, every
    pair is taken at its distance in sequence order (a lax.switch in the ring), the pairs
    the window cannot reach are skipped. (Mostly without segments: packed documents would
    mask much of what a window reaches across chunks.)"""
    _check_against_reference(
        ring_attention,
        context=context,
        causal=True,
        heads=4,
        kv_heads=2,
        with_segments=segments,
        load_balanced=balanced,
        sliding_window=window,
        softcap=softcap,
        block_impl=block_impl,
    )


@pytest.mark.parametrize("block_impl", ["xla", "pallas"])
def test_chunked_attention_with_window_and_softcap_matches_reference(block_impl):
    """Chunks of 8, window 11: pairs two chunks apart are computed shifted, three apart skipped."""
    q, k, v, w, seg = _inputs(4, 2, False)
    kwargs = dict(causal=True, segment_ids=seg, sliding_window=11, softcap=2.0)
    attn = lambda q, k, v: chunked_attention(q, k, v, chunks=4, block_impl=block_impl, **kwargs)
    ref = lambda q, k, v: reference.attention(q, k, v, **kwargs)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    np.testing.assert_allclose(attn(q, k, v), ref(q, k, v), atol=TOL, rtol=0)
    for name, g, gr in zip(
        "qkv", jax.grad(loss(attn), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    ):
        np.testing.assert_allclose(g, gr, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_chunked_and_ring_windows_are_causal_only():
    q, k, v, _, _ = _inputs(4, 2, False)
    with pytest.raises(ValueError, match="sliding_window=4 without causal"):
        chunked_attention(q, k, v, causal=False, sliding_window=4, chunks=4)
    with pytest.raises(ValueError, match="sliding_window=4 without causal"):
        ring_attention(q, k, v, mesh=_mesh(1, 2), causal=False, sliding_window=4, load_balanced=False)


@pytest.mark.parametrize(
    "causal,block_impl,fused_bwd",
    [(True, "xla", None), (True, "pallas", None), (False, "pallas", None), (True, "pallas", False)],
)
def test_chunked_attention_matches_reference(causal, block_impl, fused_bwd):
    """One device, the sequence in 4 chunks (what Ulysses and the flash path do on TPU
    when one head's K/V exceeds VMEM): GQA, packed segments, outputs and gradients.
    The flash blocks' backward is fused by default on CPU; fused_bwd=False is the split one."""
    q, k, v, w, seg = _inputs(4, 2, True)
    blocks = None if fused_bwd is None else BlockSizes(128, 128, fused_bwd=fused_bwd)
    attn = lambda q, k, v: chunked_attention(
        q, k, v, causal=causal, segment_ids=seg, chunks=4, block_impl=block_impl, block_sizes=blocks
    )
    ref = lambda q, k, v: reference.attention(q, k, v, causal=causal, segment_ids=seg)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    np.testing.assert_allclose(attn(q, k, v), ref(q, k, v), atol=TOL, rtol=0)
    for name, g, gr in zip(
        "qkv", jax.grad(loss(attn), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    ):
        np.testing.assert_allclose(g, gr, atol=TOL, rtol=0, err_msg=f"d{name}")


@pytest.mark.slow
def test_ring_with_flash_blocks_matches_reference():
    """The GPU/TPU per-block path (Pallas flash kernels, interpret mode here),
    with separate q/kv segment ids and GQA. Chunks of 8 tokens -> blocks of 8."""
    _check_against_reference(
        ring_attention,
        context=2,
        causal=True,
        heads=4,
        kv_heads=2,
        with_segments=True,
        load_balanced=True,
        block_impl="pallas",
    )


def test_ulysses_rejects_heads_not_divisible_by_context():
    q, k, v, _, _ = _inputs(4, 4, False)
    with pytest.raises(ValueError, match="q heads divisible"):
        ulysses_attention(q, k, v, mesh=_mesh(1, 8))


def test_ring_rejects_seq_not_divisible():
    q, k, v, _, _ = _inputs(4, 4, False)
    with pytest.raises(ValueError, match="multiple of 2"):
        ring_attention(q[:, :24], k[:, :24], v[:, :24], mesh=_mesh(1, 8))


# --- layout and balance ------------------------------------------------------------


def test_zigzag_permutation_layout_and_inverse():
    perm = zigzag_permutation(16, 4)  # 8 chunks of 2
    np.testing.assert_array_equal(perm, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    x = np.arange(32).reshape(2, 16) * 10
    np.testing.assert_array_equal(x[:, perm][:, inverse_permutation(perm)], x)
    batch = permute_batch({"inputs": x, "positions": x // 10}, 4)
    np.testing.assert_array_equal(batch["positions"][0], perm)  # positions travel with tokens
    with pytest.raises(ValueError, match="multiple of 2 \\* context"):
        zigzag_permutation(12, 4)


def test_ulysses_layout_matches_sharding_context():
    from jaxtrain.pallas_kernels.ulysses import _zigzag

    for n in (1, 2, 4, 8):
        np.testing.assert_array_equal(_zigzag(64, n), zigzag_permutation(64, n))


def _pairs_from_schedule(n, balanced):
    """Unmasked chunk pairs each shard computes, counted from the ring's own schedule."""
    from jaxtrain.pallas_kernels.ring_attention import _pairs

    counts = []
    for i in range(n):
        total = 0
        for step in range(n):
            j = (i - step) % n
            rel = "self" if step == 0 else ("before" if j < i else "after")
            pairs = _pairs(True, balanced, rel)
            # Every pair the schedule computes really holds an allowed (q, k) pair.
            for a, c, _ in pairs:
                assert chunk_of_shard(j, n, balanced)[c] <= chunk_of_shard(i, n, balanced)[a]
            total += len(pairs)
        counts.append(total)
    return counts


@pytest.mark.parametrize("n", [2, 4, 8])
def test_causal_balance(n):
    balanced = causal_block_pairs(n, load_balanced=True)
    contiguous = causal_block_pairs(n, load_balanced=False)
    print(
        f"context={n}: unmasked (q chunk, k chunk) pairs of S/{2 * n} tokens per device: "
        f"balanced {balanced}; contiguous {contiguous}"
    )
    assert max(balanced) - min(balanced) <= 1
    assert sum(balanced) == sum(contiguous) == n * (2 * n + 1)
    assert contiguous == [4 * i + 3 for i in range(n)]  # the last device: ~(4n-1)/3 x the first
    # The ring's own schedule computes exactly these pairs (in its chunk units).
    assert _pairs_from_schedule(n, True) == balanced
    assert _pairs_from_schedule(n, False) == list(range(1, n + 1))
