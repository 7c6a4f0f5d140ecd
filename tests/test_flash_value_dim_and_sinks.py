"""The Pallas flash kernels (interpret mode), their sharded entry point and the context-parallel
paths (ring, Ulysses, chunked) with a value head dim unlike the query/key one (MLA) and sink
logits (GPT-OSS), forward and gradients (the sinks' too), against the plain-jnp reference of
tests/test_attention_sinks.py (explicit max / exp / sum, K and V repeated per query head).
f32 inputs; tolerance 2e-5 absolute (observed about 1e-6: the kernels reorder f32 sums)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxtrain.models.attention import attend
from jaxtrain.pallas_kernels import (
    BlockSizes,
    chunked_attention,
    flash_attention,
    ring_attention,
    sharded_flash_attention,
    ulysses_attention,
)
from jaxtrain.sharding.context import zigzag_permutation
from tests.test_attention_sinks import inputs, reference, visible_mask

TOL = 2e-5
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _check(fn, args, ref, argnums):
    """fn(*args) and its gradients against ref(*args), through a random output cotangent."""
    out = fn(*args)
    want = ref(*args)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, atol=TOL)
    w = jax.random.normal(jax.random.key(7), out.shape)
    got = jax.grad(lambda *a: jnp.sum(w * fn(*a)), argnums)(*args)
    expected = jax.grad(lambda *a: jnp.sum(w * ref(*a)), argnums)(*args)
    for i, g, r in zip(argnums, got, expected):
        np.testing.assert_allclose(g, r, atol=TOL, err_msg=f"gradient of argument {i}")


SEGMENTS = np.array([[1] * 17 + [2] * 23, [1] * 40], np.int32)

# seq 40 with blocks of 16: several blocks per loop and a padded last block; the fused and
# the split backward kernels each with and without sinks
KERNEL_CASES = {
    "dv<dqk gqa window segments fused": dict(kvh=2, window=9, segments=True, sinks=None, fused=True),
    "sinks dv<dqk mqa window segments split": dict(kvh=1, window=9, segments=True, sinks="random"),
    "sinks dv<dqk gqa fused": dict(kvh=2, window=None, sinks="random", fused=True),
    "zero sinks non-causal window split": dict(kvh=2, window=7, causal=False, sinks="zero"),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_flash_kernel_equals_the_reference(case):
    c = KERNEL_CASES[case]
    fused_bwd = c.get("fused", False)
    q, k, v, sinks = inputs(s=40, kvh=c["kvh"], dqk=24, dv=16)
    sinks = {"random": sinks, "zero": jnp.zeros_like(sinks), None: None}[c["sinks"]]
    seg = SEGMENTS if c.get("segments") else np.ones((2, 40), np.int32)
    causal = c.get("causal", True)
    visible = visible_mask(seg, causal=causal, window=c["window"])
    kw = dict(
        causal=causal,
        segment_ids=jnp.asarray(seg) if c.get("segments") else None,
        sliding_window=c["window"],
        block_sizes=BlockSizes(16, 16, fused_bwd=fused_bwd),
    )
    if sinks is None:
        fn = lambda q, k, v: flash_attention(q, k, v, **kw)
        _check(fn, (q, k, v), lambda q, k, v: reference(q, k, v, visible), (0, 1, 2))
    else:
        fn = lambda q, k, v, s: flash_attention(q, k, v, sinks=s, **kw)
        _check(fn, (q, k, v, sinks), lambda q, k, v, s: reference(q, k, v, visible, sinks=s), (0, 1, 2, 3))


def test_a_zero_sink_is_not_no_sink_in_the_kernel():
    q, k, v, sinks = inputs(s=16)
    zero = flash_attention(q, k, v, causal=True, sinks=jnp.zeros_like(sinks))
    assert np.abs(np.asarray(zero - flash_attention(q, k, v, causal=True))).max() > 1e-2


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def test_sharded_kernel_splits_the_sinks_with_the_heads():
    """Heads over 'tensor' (each shard its own sinks), batch over 'data' (the sinks' gradient
    summed over it)."""
    mesh = _mesh((2, 2), ("data", "tensor"))
    q, k, v, sinks = inputs(s=16, h=4, kvh=2)
    visible = visible_mask(np.ones((2, 16), np.int32))
    fn = lambda q, k, v, s: sharded_flash_attention(
        q, k, v, mesh=mesh, batch_axes=("data",), head_axes=("tensor",), causal=True, sinks=s
    )
    _check(fn, (q, k, v, sinks), lambda q, k, v, s: reference(q, k, v, visible, sinks=s), (0, 1, 2, 3))


@pytest.mark.parametrize(
    "path, block_impl",
    [
        pytest.param("ring", "pallas", marks=pytest.mark.slow),
        ("ulysses", "xla"),
        ("ulysses", "pallas"),
        ("chunked", "xla"),
    ],
)
def test_context_parallel_paths_equal_the_reference(path, block_impl):
    """Ring and Ulysses over context=2 (zig-zag order), chunked attention over 4 chunks on one
    device: dv < dqk, GQA, sinks added once per query after the merge (and their gradient
    summed over the sequence shards)."""
    q, k, v, sinks = inputs(s=64, h=4, kvh=2, dqk=12, dv=8)
    visible = visible_mask(np.ones((2, 64), np.int32))
    ref = lambda q, k, v, s: reference(q, k, v, visible, sinks=s)
    if path == "chunked":
        fn = lambda q, k, v, s: chunked_attention(
            q, k, v, causal=True, sinks=s, chunks=4, block_impl=block_impl, backend="cpu"
        )
        _check(fn, (q, k, v, sinks), ref, (0, 1, 2, 3))
        return
    mesh = _mesh((2,), ("context",))
    perm = np.asarray(zigzag_permutation(64, 2))
    inv = np.argsort(perm)
    attention = ring_attention if path == "ring" else ulysses_attention
    # sequence order in and out: the permutation is part of the function under test
    fn = lambda q, k, v, s: attention(
        q[:, perm],
        k[:, perm],
        v[:, perm],
        mesh=mesh,
        causal=True,
        sinks=s,
        load_balanced=True,
        block_impl=block_impl,
    )[:, inv]
    _check(fn, (q, k, v, sinks), ref, (0, 1, 2, 3))


def test_attend_routes_sinks_and_value_dim_to_the_flash_kernel():
    q, k, v, sinks = inputs(s=16)
    visible = visible_mask(np.ones((2, 16), np.int32))
    out = attend(q, k, v, impl="pallas", sinks=sinks)
    np.testing.assert_allclose(out, reference(q, k, v, visible, sinks=sinks), atol=TOL)


@pytest.mark.parametrize(
    "impl, dv, sinks, match",
    [
        ("cudnn", 24, True, "attention sinks: cuDNN's attention takes none"),
        ("cudnn", 16, False, "value head dim 16 != query/key head dim 24"),
        ("pallas_mosaic", 16, False, "value head_dim 16 != query/key head_dim 24"),
    ],
)
def test_paths_without_the_case_refuse_it(impl, dv, sinks, match):
    q, k, v, s = inputs(s=16, dv=dv)
    with pytest.raises(ValueError, match=match):
        attend(q, k, v, impl=impl, sinks=s if sinks else None)


@pytest.mark.parametrize(
    "case, impl, kernel",
    [(dict(sinks=True), "pallas_mosaic", "mosaic"), (dict(v_head_dim=64), "pallas", "triton")],
)
def test_auto_gives_cases_cudnn_cannot_run_to_a_flash_kernel(case, impl, kernel):
    """GPT-OSS's sinks and MLA's value head dim: `auto` on an H100 takes a Pallas kernel where
    it would take cuDNN, the fastest measured one that runs the case: the Hopper kernel takes
    sinks, only Triton takes MLA's value dim."""
    from jaxtrain.planning.attention_speeds import choose_gpu_attention, choose_gpu_flash_kernel

    args = dict(chip="h100", head_dim=128, compute_dtype="bfloat16")
    assert choose_gpu_attention(window=False, **args)[0] == "cudnn"
    chosen, why = choose_gpu_attention(window=False, **args, **case)
    assert chosen == impl and "not cudnn" in why
    assert choose_gpu_flash_kernel(**args, **case)[0] == kernel


@pytest.mark.parametrize("context_impl", [pytest.param("ring", marks=pytest.mark.slow), "ulysses"])
def test_attend_routes_them_to_context_parallelism(context_impl):
    """Under a mesh with context=2 and the default rules, `attend` runs ring or Ulysses
    attention (XLA blocks here, the CPU default), sinks and value dim included; its input is in
    zig-zag order, as the trainer feeds it."""
    from jaxtrain import sharding

    q, k, v, sinks = inputs(s=32)
    visible = visible_mask(np.ones((2, 32), np.int32))
    perm = np.asarray(zigzag_permutation(32, 2))
    mesh = _mesh((2,), ("context",))
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.DEFAULT_RULES):
        fn = jax.jit(
            lambda q, k, v, s: attend(
                q[:, perm], k[:, perm], v[:, perm], impl="xla", context_impl=context_impl, sinks=s
            )[:, np.argsort(perm)]
        )
        _check(fn, (q, k, v, sinks), lambda q, k, v, s: reference(q, k, v, visible, sinks=s), (0, 1, 2, 3))
