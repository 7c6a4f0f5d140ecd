"""Weight matmuls `y = x @ w` whose weight gradient XLA:CPU computes without a large transpose.

`x` is [tokens..., K...] (activations, token dims leading), `w` is [K..., N...] (a weight,
contracted dims leading). Autodiff's weight gradient `dw = x^T @ dy` contracts the token
dims, which are the *major* dims of both operands. XLA:CPU's dot kernels (YNNPACK) want
the contracted dim minor on the left-hand side, so the compiler first transposes one
operand, and it picks `dy` when `dy` comes out of an elementwise fusion (SwiGLU's
backward, the softmax gradient): a strided [tokens, 1024] or [tokens, vocab] transpose
that ran at under 1 GB/s and cost more than the matmul itself (profile in the README,
*The training step*). On CPU `dense` therefore has its own VJP: it moves the *smaller*
of `x` and `dy` (token dims last) behind an optimization barrier, so that XLA cannot
fold the transpose back into the dot, and takes `dw` as a plain row-major matmul; `dx =
dy @ w^T` is already in the kernels' layout. The values are the same matmuls as
autodiff's (tests/test_dense.py: equal gradients, f32 and bf16).

Only in float32 by default: with bfloat16 operands the bench-peer step was slower this way
(2.32 against 2.12 s, 10 steps each, one quiet run), so bf16 keeps autodiff's program. A
caller can ask for it in any dtype (`any_dtype=True`): the vocab-parallel output head does
(models/transformer.py), whose bf16 weight gradient autodiff leaves to XLA:CPU's Eigen dot.

On TPU and GPU (the mesh's devices, so a deviceless TPU compile on a CPU host counts as
TPU) it is `jnp.einsum` unchanged: there the compiler's layouts are free and a barrier
would only fence its scheduling.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["dense", "einsum", "materialized_transpose", "on_cpu"]


def trace_platform() -> str:
    """The platform the program being traced runs on ("cpu", "tpu", "gpu"): the active
    mesh's devices if a mesh is set (compile-only TPU/GPU meshes count as theirs), else
    JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = None
    if not mesh.empty:
        platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    platform = (platform or jax.default_backend()).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def on_cpu() -> bool:
    """Whether the program being traced runs on CPU (trace_platform)."""
    return trace_platform() == "cpu"


def dense(x: jax.Array, w: jax.Array, contract: int = 1, *, any_dtype: bool = False) -> jax.Array:
    """`x @ w` over the last `contract` dims of `x` and the first `contract` dims of `w`,
    in their common dtype (as `jnp.einsum`). On CPU in float32 (in any dtype with
    `any_dtype`) with the transpose-free weight gradient described in the module docstring."""
    if x.shape[x.ndim - contract :] != w.shape[:contract]:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} do not share their {contract} contracted dims")
    if not (on_cpu() and (any_dtype or x.dtype == jnp.float32)):
        return _plain(x, w, contract)
    return _dense_cpu(x, w, contract)


def einsum(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(eqn, x, w)`, through `dense` when the equation is a weight matmul of the
    form `tokens + K, K + N -> tokens + N` (e.g. "bsd,dhk->bshk", "bshk,hkd->bsd",
    "...d,df->...f"); any other equation goes to `jnp.einsum` as it is."""
    contract = _weight_matmul_contract(eqn)
    if contract is None:
        return jnp.einsum(eqn, x, w)
    return dense(x, w, contract)


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
def _dense_cpu(x, w, contract):
    return _plain(x, w, contract)


def _dense_cpu_fwd(x, w, contract):
    return _plain(x, w, contract), (x, w)


def materialized_transpose(x: jax.Array, axes) -> jax.Array:
    """`jnp.transpose(x, axes)` as a real copy: the optimization barrier keeps XLA from
    folding the transpose back into the consumer dot (see the module docstring). Shared
    with the CPU attention's backward (models/attention.py)."""
    return jax.lax.optimization_barrier(jnp.transpose(x, axes))


def _dense_cpu_bwd(contract, res, g):
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


_dense_cpu.defvjp(_dense_cpu_fwd, _dense_cpu_bwd)
