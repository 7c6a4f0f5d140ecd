"""The Pallas gated-delta-rule kernels (pallas_kernels/gated_delta.py) in the CPU interpreter
against both plain-jnp references of models/gated_deltanet.py (token by token and by chunks):
forward, final state, and the gradients of q, k, v, g, beta and the initial state, in float32
within 1e-5 of the largest value. Shapes: 200 tokens in 64-token chunks (a ragged last chunk),
key heads grouped over value heads, packed documents, an initial state; the value columns split
over the grid; bfloat16 inputs. Then deviceless compiles (forward + backward, inside shard_map)
at the shape of Qwen3.5-35B-A3B's linear-attention layers for TPU v5p (Mosaic) and H100
(Triton).
"""

from __future__ import annotations

import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxtrain.models import gated_deltanet as gdn  # noqa: E402
from jaxtrain.pallas_kernels.gated_delta import chunked_gated_delta_rule_pallas  # noqa: E402
from tests.test_flash_attention_deviceless import CUSTOM_CALL, _devices  # noqa: E402  compile-only devices

TOL = 1e-5  # float32, of the largest |value|
STATIC = ("use_qk_l2norm_in_kernel",)
# The interpreter with the CPU defaults (64-token chunks) on every machine; on_device below
# runs the compiled kernels where there is a GPU or TPU.
FORMS = {
    "pallas": jax.jit(
        functools.partial(chunked_gated_delta_rule_pallas, backend="cpu"),
        static_argnames=(*STATIC, "block_v"),
    ),
    "chunked": jax.jit(gdn.chunked_gated_delta_rule, static_argnames=STATIC),
    "recurrent": jax.jit(gdn.recurrent_gated_delta_rule, static_argnames=STATIC),
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(seed=0, *, batch=2, seq=200, k_heads=2, v_heads=4, dk=16, dv=32, packed=False, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (batch, seq, k_heads, dk), dtype)
    k = jax.random.normal(ks[1], (batch, seq, k_heads, dk), dtype)
    v = jax.random.normal(ks[2], (batch, seq, v_heads, dv), dtype)
    g = -0.5 * jax.nn.softplus(jax.random.normal(ks[3], (batch, seq, v_heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, seq, v_heads)))
    state = 0.3 * jax.random.normal(ks[5], (batch, v_heads, dk, dv))
    segments = None
    if packed:  # about 8 documents a row; starts inside a chunk, at its first and at its last token
        starts = jax.random.bernoulli(ks[6], 0.03, (batch, seq)).at[:, jnp.array([10, 64, 127])].set(True)
        segments = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    return (q, k, v, g, beta, state), segments


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@functools.cache
def _grad_fn(form: str, l2norm: bool, block_v):
    """Gradients of a loss that weighs every output and final-state entry differently."""
    fn = FORMS[form]
    kwargs = dict(use_qk_l2norm_in_kernel=l2norm, **({"block_v": block_v} if form == "pallas" else {}))

    def loss(q, k, v, g, beta, state, segments):
        out, final = fn(q, k, v, g, beta, state, segments, **kwargs)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(jnp.sin(final))

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))


@pytest.mark.parametrize(
    "l2norm, packed, block_v",
    [(True, True, None), (True, False, 8), (False, True, None)],
    ids=["packed", "one-document-column-blocks", "packed-raw-qk"],
)
def test_forward_and_gradients_match_both_references(l2norm, packed, block_v):
    """block_v=8: dv 32 split over 4 grid steps (the GPU path), their dq/dk/dbeta/dg summed."""
    args, segments = _inputs(1, packed=packed)
    if not l2norm:  # keys of norm about 1 (beta k.k < 2): a raw rule that does not blow up
        args = (args[0], args[1] * args[1].shape[-1] ** -0.5, *args[2:])
    kw = dict(use_qk_l2norm_in_kernel=l2norm)
    out, state = FORMS["pallas"](*args, segments, block_v=block_v, **kw)
    grads = _grad_fn("pallas", l2norm, block_v)(*args, segments)
    for ref in ("chunked", "recurrent"):
        ref_out, ref_state = FORMS[ref](*args, segments, **kw)
        errors = {"out": _rel(out, ref_out), "state": _rel(state, ref_state)}
        ref_grads = _grad_fn(ref, l2norm, None)(*args, segments)
        errors.update({f"d{name}": _rel(a, b) for name, a, b in zip(NAMES, grads, ref_grads)})
        print(ref, {k: f"{v:.1e}" for k, v in errors.items()})
        assert max(errors.values()) < TOL, (ref, errors)


def test_no_initial_state_and_one_ragged_chunk():
    """Fewer tokens than a chunk, no initial state: zeros as the reference."""
    (q, k, v, g, beta, _), _ = _inputs(2, seq=37, k_heads=1, v_heads=2)
    out, state = FORMS["pallas"](q, k, v, g, beta)
    ref_out, ref_state = FORMS["recurrent"](q, k, v, g, beta)
    assert _rel(out, ref_out) < TOL and _rel(state, ref_state) < TOL


def test_bfloat16_inputs():
    """bf16 q/k/v: the output in bf16 (as the reference), the state in float32, both as the
    reference computes from the same bf16 inputs (its float32 math, then one rounding)."""
    args, segments = _inputs(4, packed=True, dtype=jnp.bfloat16)
    out, state = FORMS["pallas"](*args, segments)
    ref_out, ref_state = FORMS["chunked"](*args, segments)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert _rel(out, ref_out) < 1e-2 and _rel(state, ref_state) < 1e-2


def test_bad_arguments():
    args, _ = _inputs(5, seq=8)
    with pytest.raises(ValueError, match="block_v"):
        chunked_gated_delta_rule_pallas(*args, block_v=12)
    with pytest.raises(ValueError, match="interpret"):
        chunked_gated_delta_rule_pallas(*args, backend="cpu", interpret=False)
    with pytest.raises(ValueError, match="segment_ids"):
        chunked_gated_delta_rule_pallas(*args, segment_ids=jnp.zeros((2, 9), jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        chunked_gated_delta_rule_pallas(*args, backend="gpu", interpret=False, chunk_size=48)
    with pytest.raises(ValueError, match="initial_state"):
        chunked_gated_delta_rule_pallas(*args[:5], jnp.zeros((2, 4, 16, 16)))


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
def test_compiled_kernels_on_device():
    """The compiled Mosaic / Triton kernels (not the interpreter) on this machine's accelerator,
    float32 (HIGHEST-precision matmuls), against the chunked reference. Never run so far: written
    on a machine without one; 1e-4 leaves room for the device's own float32 rounding."""
    args, segments = _inputs(1, packed=True)
    kernel = jax.jit(chunked_gated_delta_rule_pallas)
    for a, b in zip(kernel(*args, segments), FORMS["chunked"](*args, segments)):
        assert _rel(a, b) < 1e-4

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a, segments)[0])) + jnp.sum(fn(*a, segments)[1])

    got = jax.jit(jax.grad(loss(chunked_gated_delta_rule_pallas), argnums=tuple(range(6))))(*args)
    want = jax.jit(jax.grad(loss(gdn.chunked_gated_delta_rule), argnums=tuple(range(6))))(*args)
    errors = {name: _rel(a, b) for name, a, b in zip(NAMES, got, want)}
    assert max(errors.values()) < 1e-4, errors


def test_tpu_sequence_must_fit_vmem():
    """One head's whole sequence sits in TPU VMEM: past it, a ValueError when the backward is
    traced (no compile; 12288 tokens at dk = dv = 128 need about 54 MiB of v5p's 64)."""
    q = jax.ShapeDtypeStruct((1, 12288, 1, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 12288, 1, 128), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((1, 12288, 1), jnp.float32)

    def loss(q, k, v, g, beta):
        return chunked_gated_delta_rule_pallas(q, k, v, g, beta, backend="tpu")[0].astype(jnp.float32).sum()

    jax.eval_shape(loss, q, q, v, gate, gate)  # the forward fits
    with pytest.raises(ValueError, match="VMEM"):
        jax.eval_shape(jax.grad(loss), q, q, v, gate, gate)


# ----------------------------------------------------------------------------
# Deviceless compiles: the real Mosaic TPU and Triton (sm_90a) compilers, no hardware.
# ----------------------------------------------------------------------------

# Qwen3.5-35B-A3B's linear-attention layers: 16 key heads, 32 value heads, head dims 128.
QWEN_HEADS = dict(k_heads=16, v_heads=32, dk=128, dv=128)


@pytest.mark.deviceless
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_qwen3_5_layer_compiles(target):
    """Forward + backward, batch 8 split over 8 compile-only devices inside shard_map, seq 4096,
    bf16 q/k/v, packed documents: the program calls the Pallas kernels, and no XLA fallback
    does the chunk algebra (no triangular solve)."""
    from jaxtrain.sharding import targets

    devices = _devices(target)
    if isinstance(devices, str):
        pytest.skip(devices)
    mesh = Mesh(np.array(devices), ("data",))
    batch, seq, h = 8, 4096, QWEN_HEADS
    spec = NamedSharding(mesh, P("data"))
    qk = jax.ShapeDtypeStruct((batch, seq, h["k_heads"], h["dk"]), jnp.bfloat16, sharding=spec)
    v = jax.ShapeDtypeStruct((batch, seq, h["v_heads"], h["dv"]), jnp.bfloat16, sharding=spec)
    gate = jax.ShapeDtypeStruct((batch, seq, h["v_heads"]), jnp.float32, sharding=spec)
    seg = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=spec)

    def local(q, k, v, g, beta, seg):
        out, state = chunked_gated_delta_rule_pallas(q, k, v, g, beta, segment_ids=seg, backend=target)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(state), "data")

    loss = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 6, out_specs=P(), check_vma=False)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(qk, qk, v, gate, gate, seg).compile()
    hlo = compiled.as_text()
    assert targets.has_custom_call(hlo, CUSTOM_CALL[target]), targets.custom_call_targets(hlo)
    assert "triangular-solve" not in hlo and not re.search(r"\s(dot|convolution)\(", hlo)
    print(target, targets.compiled_memory(compiled))
