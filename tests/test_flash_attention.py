"""Pallas flash attention vs the plain-jnp reference, on CPU (Pallas interpret mode).

Oracle: ``pallas_kernels.reference.attention`` (materialises seq x seq in f32,
HIGHEST precision), forward and VJP (dq, dk, dv) with a random cotangent.

Error metric: ``max|kernel - reference| / max|reference|`` per output (the
error relative to the output's scale). Tolerances:
  * float32: 1e-5 for the output and all three gradients. On CPU the
    interpreter runs true f32 matmuls; observed errors are ~1e-6 (the blockwise
    online softmax only reorders f32 sums).
  * bfloat16: 2e-2. The kernel feeds the MXU-style bf16 probabilities to the
    P @ V and dS @ K/Q matmuls (f32 accumulation), as FlashAttention does;
    observed ~5e-3, i.e. about one bf16 ulp (2^-8) of relative rounding.
"""

from __future__ import annotations

import os

# 8 simulated CPU devices for the sharded test, unless the caller (conftest,
# Makefile) already chose a device count. Must happen before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxtrain.pallas_kernels import BlockSizes, flash_attention, reference, sharded_flash_attention  # noqa: E402
from jaxtrain.pallas_kernels.flash_attention import declared_costs, flash_config, resolve_block_sizes  # noqa: E402

F32_TOL = 1e-5
BF16_TOL = 2e-2


def _tol(dtype):
    return F32_TOL if jnp.dtype(dtype) == jnp.float32 else BF16_TOL


def _inputs(batch, seq, q_heads, kv_heads, head_dim, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, seq, q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (batch, seq, q_heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v, do


def _packed_segments(batch, seq, seed=1):
    """Packed documents: sorted segment ids with random boundaries (one row per batch)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def _rel_err(x, ref):
    x = np.asarray(x, np.float32)
    ref = np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _check_fwd_bwd(q, k, v, do, *, tol, **kwargs):
    kernel_kwargs = {n: kwargs.pop(n) for n in ("block_sizes", "backend", "interpret") if n in kwargs}
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kwargs, **kernel_kwargs), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, **kwargs), q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    errors = {"out": _rel_err(out, ref)}
    for name, g, rg in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(do)):
        assert g.shape == rg.shape and g.dtype == rg.dtype, name
        errors[name] = _rel_err(g, rg)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errors})"


# A covering set, not the Cartesian product: every value of every dimension
# appears at least once (batch 1-2; seq 128/384/1024 and 200, which no block
# size divides; MHA 4/4, GQA 8/2, MQA 8/1; head_dim 64/128; causal on/off;
# segments on/off; window none/some; f32/bf16).
GRID = [
    # batch, seq, q_heads, kv_heads, head_dim, causal, segments, window, dtype
    (1, 128, 4, 4, 64, False, False, None, jnp.float32),
    (2, 384, 8, 2, 128, True, False, None, jnp.float32),
    (1, 1024, 8, 1, 64, True, True, None, jnp.bfloat16),
    (2, 200, 4, 4, 128, True, True, 64, jnp.float32),
    (1, 200, 8, 2, 64, False, False, 50, jnp.bfloat16),
    (2, 384, 8, 1, 128, False, True, 100, jnp.float32),
    (1, 1024, 4, 4, 128, True, False, 256, jnp.float32),
    (2, 128, 8, 2, 64, False, True, None, jnp.bfloat16),
    (1, 200, 8, 1, 64, True, True, 2, jnp.float32),  # the key itself and one before
]


@pytest.mark.parametrize(
    "batch,seq,q_heads,kv_heads,head_dim,causal,segments,window,dtype",
    GRID,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_matches_reference(batch, seq, q_heads, kv_heads, head_dim, causal, segments, window, dtype):
    q, k, v, do = _inputs(batch, seq, q_heads, kv_heads, head_dim, dtype)
    seg = _packed_segments(batch, seq) if segments else None
    _check_fwd_bwd(q, k, v, do, tol=_tol(dtype), causal=causal, segment_ids=seg, sliding_window=window)


def test_window_one_is_identity_on_values():
    """sliding_window=1: each query sees only its own key, so out[h] = v[h // group] and the
    softmax is constant (dq = dk = 0 up to rounding, dv = sum of dO over the group)."""
    q, k, v, do = _inputs(1, 200, 8, 2, 64, jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=False, sliding_window=1), q, k, v)
    np.testing.assert_allclose(out, jnp.repeat(v, 4, axis=2), rtol=0, atol=1e-6)
    dq, dk, dv = vjp(do)
    assert float(jnp.max(jnp.abs(dq))) < 1e-5 and float(jnp.max(jnp.abs(dk))) < 1e-5
    np.testing.assert_allclose(dv, do.reshape(1, 200, 2, 4, 64).sum(3), rtol=1e-6, atol=1e-5)


def test_tpu_configuration_in_interpreter():
    """TPU plumbing ([B, H, S, D] views, 128-multiple blocks, head_dim 64) in the interpreter."""
    q, k, v, do = _inputs(1, 384, 8, 2, 64, jnp.float32)
    _check_fwd_bwd(
        q,
        k,
        v,
        do,
        tol=F32_TOL,
        causal=True,
        segment_ids=_packed_segments(1, 384),
        sliding_window=130,
        backend="tpu",
        interpret=True,
        block_sizes=BlockSizes(128, 256),
    )


def test_gpu_configuration_in_interpreter():
    """Triton plumbing (power-of-two blocks, head_dim 96 padded to 128) in the interpreter."""
    q, k, v, do = _inputs(1, 200, 4, 2, 96, jnp.float32)
    _check_fwd_bwd(q, k, v, do, tol=F32_TOL, causal=True, backend="gpu", interpret=True)


def test_uneven_blocks_and_custom_scale():
    """Different tiles per kernel (seq padded to their lcm) and a non-default softmax scale."""
    q, k, v, do = _inputs(1, 200, 4, 4, 64, jnp.float32)
    blocks = BlockSizes(
        block_q=64, block_kv=32, block_q_dkv=16, block_kv_dkv=64, block_q_dq=32, block_kv_dq=128
    )
    _check_fwd_bwd(
        q, k, v, do, tol=F32_TOL, causal=False, sliding_window=40, softmax_scale=0.3, block_sizes=blocks
    )


def test_non_contiguous_segments_and_jit():
    """Segment ids are compared for equality only (need not be sorted); works under jit."""
    q, k, v, do = _inputs(2, 128, 4, 2, 64, jnp.float32)
    seg = jax.random.randint(jax.random.key(3), (2, 128), 0, 3)
    fn = jax.jit(lambda q, k, v, s: flash_attention(q, k, v, causal=True, segment_ids=s))
    ref = reference.attention(q, k, v, causal=True, segment_ids=seg)
    assert _rel_err(fn(q, k, v, seg), ref) <= F32_TOL


# ---------------------------------------------------------------------------
# Logit softcap (Gemma 2): c * tanh(scores / c) before the mask, in every kernel.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend,blocks,causal,window,dtype",
    [
        # split and fused backward on the CPU tiles; TPU ([B, H, S, D], fused) and Triton
        # (head_dim 96 padded, split) plumbing; bf16
        ("cpu", BlockSizes(64, 32, 32, 64, fused_bwd=False), True, 40, jnp.float32),
        ("cpu", BlockSizes(64, 32, 32, 64, fused_bwd=True), False, None, jnp.float32),
        ("tpu", BlockSizes(128, 128), True, 130, jnp.float32),
        ("gpu", BlockSizes(32, 32), True, None, jnp.float32),
        ("cpu", None, True, None, jnp.bfloat16),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_softcap_matches_reference(backend, blocks, causal, window, dtype):
    """Scores of a few units against a cap of 2: tanh far from linear, and its derivative
    (1 - tanh^2) in dS; GQA, packed segments, a sequence no block divides."""
    head_dim = 96 if backend == "gpu" else 64
    q, k, v, do = _inputs(2, 200 if backend != "tpu" else 384, 4, 2, head_dim, dtype, seed=5)
    q = (q.astype(jnp.float32) * 3).astype(dtype)
    seg = _packed_segments(2, q.shape[1])
    _check_fwd_bwd(
        q,
        k,
        v,
        do,
        tol=_tol(dtype),
        causal=causal,
        segment_ids=seg,
        sliding_window=window,
        softcap=2.0,
        backend=backend,
        interpret=True,
        block_sizes=blocks,
    )


def test_softcap_changes_the_result_and_a_huge_cap_does_not():
    """The cap is applied (a cap of 2 moves the output) and only through tanh (a cap of 1e6
    leaves it as without one)."""
    q, k, v, _ = _inputs(1, 128, 4, 2, 64, jnp.float32)
    q = q * 3
    plain = flash_attention(q, k, v, causal=True)
    assert _rel_err(flash_attention(q, k, v, causal=True, softcap=2.0), plain) > 0.05
    assert _rel_err(flash_attention(q, k, v, causal=True, softcap=1e6), plain) <= F32_TOL


# ---------------------------------------------------------------------------
# Fused backward (one kernel, 5 matmuls) vs the split dQ + dK/dV kernels (3 + 4).
# ---------------------------------------------------------------------------


def _grads(q, k, v, do, **kwargs):
    return jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v)[1](do)


@pytest.mark.parametrize(
    "seq,q_heads,kv_heads,causal,segments,window,dtype,backend,blocks",
    [
        # seq 200: no block divides it; GQA 4/2 and MQA 4/1; causal and not.
        (200, 4, 2, True, True, None, jnp.float32, "cpu", (64, 32, 32, 64)),
        (200, 4, 1, False, True, 40, jnp.float32, "cpu", (64, 64, 64, 32)),
        (256, 4, 4, True, False, None, jnp.bfloat16, "cpu", (64, 64)),
        # TPU plumbing ([B, H, S, D], 128-multiple tiles), GPU plumbing (atomics, head_dim 96 -> 128).
        (384, 4, 2, True, True, None, jnp.float32, "tpu", (128, 128)),  # dQ summed in its f32 output
        (256, 4, 2, False, True, None, jnp.bfloat16, "tpu", (128, 128)),  # f32 scratch, bf16 dQ out
        (200, 4, 2, True, True, None, jnp.float32, "gpu", (32, 32)),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_fused_backward_matches_split_and_reference(
    seq, q_heads, kv_heads, causal, segments, window, dtype, backend, blocks
):
    head_dim = 96 if backend == "gpu" else 64
    q, k, v, do = _inputs(2, seq, q_heads, kv_heads, head_dim, dtype, seed=4)
    seg = _packed_segments(2, seq) if segments else None
    kwargs = dict(causal=causal, segment_ids=seg, sliding_window=window)
    fused, split = (
        _grads(
            q,
            k,
            v,
            do,
            **kwargs,
            backend=backend,
            interpret=True,
            block_sizes=BlockSizes(*blocks, fused_bwd=f),
        )
        for f in (True, False)
    )
    ref = jax.vjp(lambda q, k, v: reference.attention(q, k, v, **kwargs), q, k, v)[1](do)
    tol = _tol(dtype)
    for name, f, s, r in zip(("dq", "dk", "dv"), fused, split, ref):
        assert f.dtype == r.dtype and f.shape == r.shape, name
        assert _rel_err(f, r) <= tol, (name, _rel_err(f, r))
        assert _rel_err(f, s) <= tol, (name, _rel_err(f, s))


def _backward_flops(fused, **kwargs):
    q, k, v, do = _inputs(1, 256, 4, 2, 64, jnp.float32)
    blocks = BlockSizes(64, 64, fused_bwd=fused)
    fn = jax.vjp(lambda q, k, v: flash_attention(q, k, v, block_sizes=blocks, **kwargs), q, k, v)[1]
    return declared_costs(jax.make_jaxpr(fn)(do))


@pytest.mark.parametrize("causal", [True, False])
def test_fused_backward_declares_five_matmuls(causal):
    """The backward's declared FLOPs: 3 + 4 matmuls per visited block split, 5 fused."""
    split, fused = _backward_flops(False, causal=causal), _backward_flops(True, causal=causal)
    assert set(split) == {"flash_attention_dq", "flash_attention_dkv"}, split
    assert set(fused) == {"flash_attention_fused"}, fused
    # Same tiles for every kernel, so all visit the same (q, kv) blocks.
    unit = split["flash_attention_dq"]["flops"] / 3
    assert split["flash_attention_dkv"]["flops"] == 4 * unit
    assert fused["flash_attention_fused"]["flops"] == 5 * unit
    # One block pair of 64 x 64 is 2 * 64 * 64 * head_dim flops per matmul.
    pairs = 1 * 4 * (10 if causal else 16)  # batch x heads x visited 64-blocks of 256
    assert unit == pairs * 2 * 64 * 64 * 64
    # One pass reads q, k, v, dO, LSE, delta once instead of twice.
    assert fused["flash_attention_fused"]["bytes_accessed"] < sum(c["bytes_accessed"] for c in split.values())


def _config(backend, seq, fused=None):
    blocks = resolve_block_sizes(BlockSizes(128, 128, fused_bwd=fused), backend, seq, 128, jnp.bfloat16)
    return flash_config(
        backend=backend,
        interpret=False,
        causal=True,
        window=None,
        scale=1.0,
        seq_len=seq,
        seq_pad=seq,
        head_dim=128,
        q_heads=8,
        kv_heads=8,
        blocks=blocks,
        dtype=jnp.bfloat16,
    )


def test_fused_backward_default_per_backend():
    """Fused by default on TPU (while its whole f32 dQ fits VMEM) and CPU; split on GPU."""
    assert _config("gpu", 4096).fused_bwd is False
    assert _config("gpu", 4096, fused=True).fused_bwd is True
    assert _config("cpu", 4096).fused_bwd is True
    assert _config("cpu", 4096, fused=False).fused_bwd is False
    assert _config("tpu", 32768).fused_bwd is True
    # 64k: Q, dO and the f32 dQ of one head (~96 MiB) exceed VMEM; the split kernels fit.
    assert _config("tpu", 65536).fused_bwd is False
    with pytest.raises(ValueError, match="fused_bwd=False needs less"):
        _config("tpu", 65536, fused=True)


def test_default_backend_on_cpu_is_interpret():
    from jaxtrain.pallas_kernels.mesh_utils import resolve_backend

    q, _, _, _ = _inputs(1, 128, 4, 4, 64, jnp.float32)
    assert resolve_backend(q) == "cpu"


# ---------------------------------------------------------------------------
# Input validation: ValueError naming the argument.
# ---------------------------------------------------------------------------


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _trace(q, k, v, **kwargs):
    return jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v)


Q = _sds((2, 128, 8, 64))
KV = _sds((2, 128, 2, 64))


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((_sds((128, 8, 64)), KV, KV), {}, "q must have rank 4"),
        ((Q, _sds((2, 128, 2)), KV), {}, "k must have rank 4"),
        ((Q, _sds((1, 128, 2, 64)), _sds((1, 128, 2, 64))), {}, "batch"),
        ((Q, _sds((2, 64, 2, 64)), _sds((2, 64, 2, 64))), {}, "seq"),
        ((Q, _sds((2, 128, 2, 32)), _sds((2, 128, 2, 32))), {}, "head_dim"),
        ((Q, _sds((2, 128, 3, 64)), _sds((2, 128, 3, 64))), {}, "multiple of k/v heads"),
        ((Q, KV, _sds((2, 128, 1, 64))), {}, "v must have k's number of heads"),
        ((_sds((2, 128, 8, 64), jnp.int32), KV, KV), {}, "q dtype"),
        ((Q, _sds((2, 128, 2, 64), jnp.bfloat16), KV), {}, "share a dtype"),
        ((Q, KV, KV), {"sliding_window": 0}, "sliding_window must be >= 1"),
        ((Q, KV, KV), {"sliding_window": 2.5}, "sliding_window must be an int"),
        ((Q, KV, KV), {"sliding_window": True}, "sliding_window must be an int"),
        ((Q, KV, KV), {"segment_ids": jnp.zeros((2, 64), jnp.int32)}, "segment_ids must have shape"),
        ((Q, KV, KV), {"segment_ids": jnp.zeros((2, 128), jnp.float32)}, "segment_ids must be integers"),
        ((Q, KV, KV), {"backend": "metal"}, "backend must be one of"),
        ((Q, KV, KV), {"backend": "cpu", "interpret": False}, "interpret"),
        ((Q, KV, KV), {"softmax_scale": float("nan")}, "softmax_scale"),
        ((Q, KV, KV), {"softcap": 0.0}, "softcap must be a finite float > 0"),
        ((Q, KV, KV), {"softcap": float("inf")}, "softcap must be a finite float > 0"),
        ((Q, KV, KV), {"softcap": jnp.float32(3.0) + jnp.zeros(2)}, "softcap must be a static"),
        ((Q, KV, KV), {"block_sizes": (128, 128)}, "block_sizes must be a BlockSizes"),
        ((Q, KV, KV), {"block_sizes": BlockSizes(0, 128)}, "block_sizes.block_q must be a positive"),
        ((Q, KV, KV), {"block_sizes": BlockSizes(128, 128, fused_bwd=1)}, "block_sizes.fused_bwd must be"),
        (
            (Q, KV, KV),
            {"backend": "tpu", "block_sizes": BlockSizes(128, 64)},
            "block_sizes.block_kv=64: TPU blocks must be multiples of 128",
        ),
        (
            (Q, KV, KV),
            {"backend": "gpu", "block_sizes": BlockSizes(128, 96)},
            "block_sizes.block_kv=96: Triton blocks must be powers of two",
        ),
        (
            (
                _sds((1, 262144, 8, 128), jnp.bfloat16),
                _sds((1, 262144, 8, 128), jnp.bfloat16),
                _sds((1, 262144, 8, 128), jnp.bfloat16),
            ),
            {"backend": "tpu"},
            "VMEM",
        ),
    ],
)
def test_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _trace(*args, **kwargs)


# ---------------------------------------------------------------------------
# shard_map wrapper on 8 simulated CPU devices.
# ---------------------------------------------------------------------------


def _mesh_or_skip(axis_types=None):
    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "must be set before jax is first imported"
        )
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=axis_types)


@pytest.mark.parametrize(
    "q_heads,kv_heads,mode",
    [
        (8, 2, "explicit"),  # kv heads sharded over tensor
        (8, 1, "auto"),  # MQA: kv replicated, each shard slices its one kv head
        (12, 3, "abstract"),  # kv replicated, shards gather the kv heads they read;
        # mesh passed as jax.get_abstract_mesh() under set_mesh
    ],
)
def test_sharded_matches_reference(q_heads, kv_heads, mode):
    Auto, Explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
    mesh = _mesh_or_skip((Auto if mode == "auto" else Explicit,) * 3)
    use_abstract = mode == "abstract"
    batch, seq, head_dim = 4, 256, 64
    q, k, v, do = _inputs(batch, seq, q_heads, kv_heads, head_dim, jnp.float32)
    seg = _packed_segments(batch, seq)
    ref, ref_vjp = jax.vjp(
        lambda q, k, v: reference.attention(q, k, v, causal=True, segment_ids=seg, sliding_window=96), q, k, v
    )
    ref_grads = ref_vjp(do)
    # Inputs laid out as a model would hand them over: k/v not sharded on heads.
    shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    q = shard(q, P(("data", "fsdp"), None, "tensor"))
    do = shard(do, P(("data", "fsdp"), None, "tensor"))
    k, v = (shard(x, P(("data", "fsdp"))) for x in (k, v))
    seg = shard(seg, P(("data", "fsdp")))

    def fn(q, k, v, seg):
        return sharded_flash_attention(
            q,
            k,
            v,
            mesh=jax.sharding.get_abstract_mesh() if use_abstract else mesh,
            batch_axes=("data", "fsdp"),
            head_axes=("tensor",),
            causal=True,
            segment_ids=seg,
            sliding_window=96,
        )

    jitted = jax.jit(fn)
    with jax.set_mesh(mesh):
        out, vjp = jax.vjp(lambda q, k, v: jitted(q, k, v, seg), q, k, v)
        grads = vjp(do)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 4)
    assert _rel_err(out, ref) <= F32_TOL
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _rel_err(g, rg) <= F32_TOL, name


def test_sharded_without_mesh_and_validation():
    q, k, v, _ = _inputs(2, 128, 4, 2, 64, jnp.float32)
    out = sharded_flash_attention(q, k, v, mesh=None, batch_axes=(), head_axes=(), causal=True)
    assert _rel_err(out, reference.attention(q, k, v, causal=True)) <= F32_TOL
    mesh = _mesh_or_skip()
    with pytest.raises(ValueError, match="not a mesh axis"):
        sharded_flash_attention(q, k, v, mesh=mesh, batch_axes=("batch",), head_axes=(), causal=True)
    with pytest.raises(ValueError, match="batch 2 is not divisible"):
        sharded_flash_attention(q, k, v, mesh=mesh, batch_axes=("data", "fsdp"), head_axes=(), causal=True)
    with pytest.raises(ValueError, match="overlap"):
        sharded_flash_attention(q, k, v, mesh=mesh, batch_axes=("data",), head_axes=("data",), causal=True)
