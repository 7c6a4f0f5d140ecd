"""The Mosaic GPU (Hopper) flash attention (pallas_kernels/flash_mgpu.py): under the Mosaic GPU
interpreter (jax >= 0.12), output and dq/dk/dv of ``flash_attention_mgpu`` against jax.grad
of ``reference.attention`` in float32, bf16 inputs, for GQA causal (two batch rows, a group of
four query heads per kv head), a sliding window, packed segments, non-causal, a length no
tile divides (padding) and head_dim 128/256; the same for
the kernels as the blocks of chunked and ring attention; what the kernel refuses; a
deviceless H100 (sm_90a) compile of forward + backward is three Mosaic GPU kernels (forward,
dQ, dK/dV) and no XLA attention."""

from __future__ import annotations

import contextlib
import io
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from jaxtrain.pallas_kernels import chunked_attention, reference, ring_attention  # noqa: E402
from jaxtrain.pallas_kernels.flash_mgpu import flash_attention_mgpu, unsupported_reason  # noqa: E402
from jaxtrain.pallas_kernels.ptxas_report import mosaic_kernel_resources  # noqa: E402

BF16_TOL = 2e-2  # relative max error, as tests/test_flash_attention.py
needs_interpreter = pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"), reason="this jax has no Mosaic GPU interpreter"
)


def _inputs(seq, q_heads, kv_heads, head_dim, seed=0, batch=1):
    ks = jax.random.split(jax.random.key(seed), 4)
    q_shape, kv_shape = (batch, seq, q_heads, head_dim), (batch, seq, kv_heads, head_dim)
    shapes = [q_shape, kv_shape, kv_shape]
    shapes.append(shapes[0])
    return [jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16) for key, s in zip(ks, shapes)]


def _segments(seq, cuts):
    return jnp.asarray(np.searchsorted(np.array(cuts), np.arange(seq), side="right")[None], jnp.int32)


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


CASES = [
    # batch, seq, q_heads, kv_heads, head_dim, causal, window, segment cuts, blocks
    # two batch rows (the grid's batch axis) of a GQA group of 4 query heads per kv head
    pytest.param(2, 128, 4, 1, 64, True, None, None, {}, id="batch2-gqa4-causal", marks=pytest.mark.slow),
    pytest.param(1, 256, 2, 1, 64, True, 70, (85, 170), {}, id="causal-window-segments"),
    pytest.param(1, 128, 2, 2, 64, False, None, None, {}, id="non-causal"),
    pytest.param(1, 128, 2, 1, 64, False, 40, (50,), {}, id="window-segments"),
    pytest.param(1, 300, 2, 1, 64, True, 150, None, {}, id="padding-window"),  # 3 blocks: slot reuse
    pytest.param(1, 128, 2, 1, 128, True, None, None, {}, id="head-dim-128", marks=pytest.mark.slow),
    pytest.param(1, 128, 2, 1, 256, True, None, None, {}, id="head-dim-256", marks=pytest.mark.slow),
    # dK/dV in two head-dim parts (head_dim 256's default) with every mask, at head_dim 128
    pytest.param(
        1, 256, 4, 2, 128, True, 70, (85, 170), {"dkv_parts": 2}, id="dkv-parts", marks=pytest.mark.slow
    ),
]


def _assert_matches_reference(attn, q, k, v, do, **kw):
    """``attn(q, k, v)`` and its dq/dk/dv against jax.grad of the f32 reference with ``kw``."""
    out, vjp = jax.vjp(attn, q, k, v)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    ref, ref_vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, **kw), *f32(q, k, v))
    assert out.shape == q.shape and out.dtype == q.dtype
    errors = {"out": _rel_err(out, ref)}
    for name, g, x, rg in zip(("dq", "dk", "dv"), vjp(do), (q, k, v), ref_vjp(*f32(do))):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        errors[name] = _rel_err(g, rg)
    assert all(e <= BF16_TOL for e in errors.values()), errors


@needs_interpreter
@pytest.mark.parametrize("batch, seq, q_heads, kv_heads, head_dim, causal, window, cuts, blocks", CASES)
def test_matches_reference(batch, seq, q_heads, kv_heads, head_dim, causal, window, cuts, blocks):
    q, k, v, do = _inputs(seq, q_heads, kv_heads, head_dim, batch=batch)
    seg = None if cuts is None else jnp.tile(_segments(seq, cuts), (batch, 1))
    kw = dict(causal=causal, sliding_window=window, segment_ids=seg)
    attn = lambda q, k, v: flash_attention_mgpu(q, k, v, interpret=True, **kw, **blocks)
    _assert_matches_reference(attn, q, k, v, do, **kw)


@needs_interpreter
def test_sinks_match_reference():
    """GPT-OSS's sink logits (added to the kernel's statistics in XLA): output, dq/dk/dv and
    d sinks against jax.grad of the f32 reference; 200 positions: a padded last tile."""
    q, k, v, do = _inputs(200, 2, 1, 64)
    sinks = jnp.array([0.0, 1.5], jnp.float32)  # a zero sink still counts
    kw = dict(causal=True, sliding_window=90)
    attn = lambda q, k, v, s: flash_attention_mgpu(q, k, v, interpret=True, sinks=s, **kw)
    out, vjp = jax.vjp(attn, q, k, v, sinks)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    ref_fn = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, **kw)
    ref, ref_vjp = jax.vjp(ref_fn, *f32(q, k, v), sinks)
    errors = {"out": _rel_err(out, ref)}
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), vjp(do), ref_vjp(*f32(do))):
        errors[name] = _rel_err(g, rg)
    assert all(e <= BF16_TOL for e in errors.values()), errors


@needs_interpreter
def test_chunked_attention_blocks_match_reference():
    """The blocks ring attention is made of, on one device (``chunked_attention``): two chunks
    of 128, a causal window of 150 that reaches from the second into the first (the kernels'
    q_offset), packed documents (the off-diagonal pair's query-side segment ids differ from its
    key-side ones), GQA; partial results merged through the LSE, and the backward kernels fed
    the merged LSE and delta instead of their own."""
    seq = 256
    q, k, v, do = _inputs(seq, 2, 1, 64)
    kw = dict(causal=True, segment_ids=_segments(seq, (100, 200)), sliding_window=150)
    attn = lambda q, k, v: chunked_attention(
        q, k, v, chunks=2, block_impl="pallas", gpu_kernel="mosaic", **kw
    )
    _assert_matches_reference(attn, q, k, v, do, **kw)


def _ring_case():
    """Ring attention over context=2 with the Hopper kernels as its blocks, against the
    reference: K/V and their segment ids travel, so a block's key-side segment ids are the other
    shard's; dK/dV accumulate as they travel home. Non-causal, one chunk of 128 per shard (the
    causal kernels' masks and windows at a distance are the chunked case's). Run in a fresh
    process by the test below, for two quirks of Mosaic GPU's interpreter with kernels on two
    devices:

    * it keeps one shared memory for all devices, and the check it runs as a kernel ends ("no
      barrier remains allocated") also sees the barriers of the same kernel still running on
      the other device: a race in the check (silenced here), not in the kernel;
    * with JAX's persistent compilation cache on (the suite's conftest turns it on) the two
      devices' kernels wait on each other forever, as they do when the devices run different
      kernels (a causal ring with a sliding window picks each shard's distance with a
      lax.switch), so neither is used here.
    """
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    from jax.sharding import AxisType

    shared_memory.GPUSharedMemory.assert_no_barriers_allocated = lambda self: None
    n, seq = 2, 256
    q, k, v, do = _inputs(seq, 2, 1, 64)
    seg = _segments(seq, (100, 200))
    mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])

    def ring(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            causal=False,
            segment_ids=seg,
            load_balanced=False,
            block_impl="pallas",
            gpu_kernel="mosaic",
        )

    _assert_matches_reference(ring, q, k, v, do, causal=False, segment_ids=seg)
    print("ring attention with Hopper blocks matches the reference")


@needs_interpreter
@pytest.mark.slow
@pytest.mark.skipif(
    jax.__version__.startswith("0.11."),
    reason="jax 0.11's interpreter waits forever with kernels on two devices",
)
def test_ring_attention_blocks_match_reference():
    """``_ring_case`` in a fresh process without the persistent compilation cache (about 20 s)."""
    import subprocess
    import sys

    from tests.conftest import child_env

    env = {k: v for k, v in child_env(devices=8).items() if not k.startswith("JAX_COMPILATION_CACHE")}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "matches the reference" in proc.stdout


def test_ring_and_chunked_refuse_what_the_kernel_cannot_run():
    """Named at the door, as ``flash_attention`` does: softcap, and chunks off the tile."""
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="gpu_kernel='mosaic' cannot run this case: softcap"):
        chunked_attention(q, q, q, chunks=2, block_impl="pallas", gpu_kernel="mosaic", softcap=30.0)
    with pytest.raises(ValueError, match="chunk length 64 .* multiple of 128"):
        chunked_attention(q, q, q, chunks=4, block_impl="pallas", gpu_kernel="mosaic")
    with pytest.raises(ValueError, match="gpu_kernel must be one of"):
        chunked_attention(q, q, q, chunks=2, block_impl="pallas", gpu_kernel="cutlass")


def test_refuses_what_it_cannot_do():
    assert unsupported_reason(head_dim=128, dtype=jnp.bfloat16) is None
    assert "softcap" in unsupported_reason(head_dim=128, dtype=jnp.bfloat16, softcap=30.0)
    assert "head_dim" in unsupported_reason(head_dim=96, dtype=jnp.bfloat16)
    assert "dtype" in unsupported_reason(head_dim=64, dtype=jnp.float32)
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attention_mgpu(q, q, q, softcap=30.0)


@pytest.mark.deviceless
@pytest.mark.parametrize(
    "shape, kw",
    [
        ((1, 1000, 4, 2, 128), dict(causal=True, sliding_window=300, segments=True)),
        ((1, 1024, 4, 2, 256), dict(causal=True)),
        ((1, 1000, 4, 2, 64), dict(causal=True, sliding_window=128, sinks=True)),
    ],
    ids=["d128-window-segments-padding", "d256", "d64-window-sinks-padding"],
)
def test_compiles_for_h100(shape, kw):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.sharding import targets

    try:
        devices = targets.h100_devices(num_hosts=1, gpus_per_host=1)
    except targets.DevicelessUnavailableError as e:
        pytest.skip(str(e))
    s = NamedSharding(Mesh(np.array(devices), ("data",)), P())
    b, seq, hq, hk, d = shape
    q = jax.ShapeDtypeStruct((b, seq, hq, d), jnp.bfloat16, sharding=s)
    k = jax.ShapeDtypeStruct((b, seq, hk, d), jnp.bfloat16, sharding=s)
    seg = jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=s) if kw.pop("segments", False) else None
    sinks = jax.ShapeDtypeStruct((hq,), jnp.float32, sharding=s) if kw.pop("sinks", False) else None

    def loss(q, k, v, seg, sinks):
        out = flash_attention_mgpu(q, k, v, segment_ids=seg, sinks=sinks, **kw)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 4))
    compiled = []
    kernels = mosaic_kernel_resources(
        lambda: compiled.append(jax.jit(grad).lower(q, k, k, seg, sinks).compile())
    )
    hlo = compiled[0].as_text()
    assert hlo.count('custom_call_target="mosaic_gpu') == 3, targets.custom_call_targets(hlo)
    assert " dot(" not in hlo
    # ptxas' own report of the three kernels: no wgmma serialised for want of registers (at
    # head_dim 256 the dK/dV kernel did, with full-width accumulators: 4 KB of spills)
    assert sorted(r.name for r in kernels) == ["flash_dkv", "flash_dq", "flash_fwd"], kernels
    assert not any(r.wgmma_serialized for r in kernels), [r.line() for r in kernels]


@needs_interpreter
def test_the_dispatch_routes_to_it_and_refuses_by_name():
    """`flash_attention(gpu_kernel="mosaic")` (what `model.attention_impl: pallas_mosaic` calls)
    runs this kernel, here in its interpreter, and its output and statistics are the `context`
    residuals a remat policy keeps; what it cannot run is refused at the door, naming the key."""
    from jax.ad_checkpoint import print_saved_residuals

    from jaxtrain.pallas_kernels import flash_attention
    from tests.conftest import tiny_config

    q, k, v, _ = _inputs(128, 2, 1, 64)
    out = flash_attention(q, k, v, causal=True, gpu_kernel="mosaic")
    ref = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    assert _rel_err(out, ref) <= BF16_TOL

    # Traced only (the interpreter's callbacks cannot sit under jax.checkpoint): the kernel's
    # output and f32 log-sum-exp are what a policy keeping `context` saves (q is an argument).
    kernel = lambda q: flash_attention(q, k, v, causal=True, backend="gpu", gpu_kernel="mosaic")
    f = lambda q: jnp.sum(jnp.tanh(kernel(jnp.sin(q))).astype(jnp.float32))
    policy = jax.checkpoint_policies.save_only_these_names("context")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(jax.checkpoint(f, policy=policy), q)
    kept = re.findall(r"^(\w+\[[\d,]*\]) (?!from the argument|from a constant)", printed.getvalue(), re.M)
    assert sorted(kept) == ["bf16[1,128,2,64]", "f32[1,2,128]"], printed.getvalue()

    with pytest.raises(ValueError, match="gpu_kernel must be one of"):
        flash_attention(q, k, v, gpu_kernel="cuda")
    with pytest.raises(ValueError, match="gpu_kernel='mosaic' cannot run this case: head_dim 96"):
        z = jnp.zeros((1, 128, 2, 96), jnp.bfloat16)
        flash_attention(z, z, z, gpu_kernel="mosaic")
    with pytest.raises(ValueError, match="Hopper GPU kernel; the backend here is tpu"):
        flash_attention(q, k, v, backend="tpu", gpu_kernel="mosaic")
    tiny_config(
        None, "model.attention_impl=pallas_mosaic", "model.compute_dtype=bfloat16", "model.head_dim=64"
    )
    for override, expected in [
        ("model.compute_dtype=float32", "pallas_mosaic .*float32: its wgmma operands are 16-bit"),
        ("model.head_dim=48", "pallas_mosaic .*head_dim 48: expected one of \\(64, 128, 256\\)"),
        ("model.attention_softcap=30.0", "pallas_mosaic .*attention_softcap=30.0: it takes no softcap"),
        ("mesh.context=2", "train.seq_len=256 with mesh.context=2 .* chunks of 64 tokens .* multiple of 128"),
    ]:
        with pytest.raises(ValueError, match=expected):
            base = ("model.attention_impl=pallas_mosaic", "model.compute_dtype=bfloat16", "model.head_dim=64")
            tiny_config(None, *base, "train.seq_len=256", override)
    # the same doors for the kernel asked for by model.gpu_flash_kernel (attention_impl pallas)
    base = ("model.attention_impl=pallas", "model.compute_dtype=bfloat16", "model.head_dim=64")
    for override, expected in [
        ("model.gpu_flash_kernel=mosaic", None),
        ("model.gpu_flash_kernel=cuda", "model.gpu_flash_kernel='cuda': expected one of"),
        (
            "model.head_dim=48",
            "gpu_flash_kernel=mosaic .*head_dim 48: expected .* or gpu_flash_kernel triton",
        ),
    ]:
        args = (*base, "train.seq_len=256", "model.gpu_flash_kernel=mosaic", override)
        if expected is None:
            tiny_config(None, *args)
            continue
        with pytest.raises(ValueError, match=expected):
            tiny_config(None, *args)


if __name__ == "__main__":
    _ring_case()
