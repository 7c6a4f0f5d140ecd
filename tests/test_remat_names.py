"""Attention kernels keep their residuals under the checkpoint name `context`
(pallas_kernels/remat_names.py): a policy keeping `context` stores the output and the softmax
statistics and runs no forward kernel in the backward pass, with the gradients of no remat."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from jaxtrain.pallas_kernels import flash_attention
from jaxtrain.pallas_kernels.cudnn_attention import cudnn_attention
from jaxtrain.pallas_kernels.remat_names import with_named_residuals

B, S, H, KV, D = 1, 64, 4, 2, 32


def _layer(attention):
    """A layer around `attention`: projections in, a scalar out (q, k, v not kept by name)."""

    def f(w, x):
        q = jnp.tanh(x @ w[0]).reshape(B, S, H, D)
        k = jnp.sin(x @ w[1]).reshape(B, S, H, D)[:, :, :KV]
        v = (x @ w[1]).reshape(B, S, H, D)[:, :, KV:]
        return jnp.sum(attention(q, k, v) ** 2)

    return f


def _inputs():
    kw, kx = jax.random.split(jax.random.key(0))
    return jax.random.normal(kw, (2, H * D, H * D)) * 0.1, jax.random.normal(kx, (B, S, H * D))


def _named(f, names, *args) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each residual but the arguments that the policy keeping `names`
    saves (jax's public print_saved_residuals, parsed; behind a jit boundary a residual is
    described as the jitted function's output, not by its name)."""
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(jax.checkpoint(f, policy=policy), *args)
    kept = re.findall(r"^(\w+)\[([\d,]*)\] (?!from the argument|from a constant)", out.getvalue(), re.M)
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in kept]


def test_flash_keeps_output_and_statistics_and_gradients_match():
    f = _layer(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True))
    w, x = _inputs()
    kept = _named(f, ("context",), w, x)
    # the output [B, S, H, D] and the f32 log-sum-exp (one per query row and head)
    assert len(kept) == 2 and ("f32", (B, S, H, D)) in kept, kept
    (lse,) = [shape for _, shape in kept if shape != (B, S, H, D)]
    assert np.prod(lse) == B * H * S, kept
    assert _named(f, (), w, x) == []  # nothing kept without the policy
    policy = jax.checkpoint_policies.save_only_these_names("context")
    want = jax.grad(f)(w, x)
    got = jax.jit(jax.grad(jax.checkpoint(f, policy=policy)))(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cudnn_keeps_output_and_statistics_not_its_inputs():
    """Traced only (cuDNN has no CPU lowering): the vjp closure's leaves other than q, k, v are
    named, once for the output (which the caller also reads)."""
    w, x = _inputs()
    for segments in (None, jnp.ones((B, S), jnp.int32)):
        bf16 = lambda *t: (x.astype(jnp.bfloat16) for x in t)
        f = _layer(lambda q, k, v: cudnn_attention(*bf16(q, k, v), causal=True, segment_ids=segments))
        kept = [shape for _, shape in _named(f, ("context",), w, x) if np.prod(shape) > B]
        assert sorted(kept) == sorted([(B, S, H, D), (B, H, S)]), kept  # output, statistics


def test_with_named_residuals_is_the_function_and_its_gradient():
    def f(a, b):
        return jnp.sin(a) * b + a**2

    a, b = jnp.arange(4.0), jnp.ones(4) * 3
    np.testing.assert_allclose(with_named_residuals(f, a, b), f(a, b))
    ga = jax.grad(lambda a: with_named_residuals(f, a, b).sum())(a)
    np.testing.assert_allclose(ga, jnp.cos(a) * b + 2 * a, rtol=1e-6)
