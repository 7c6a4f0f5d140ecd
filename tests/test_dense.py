"""models/dense.py: the CPU weight matmul with its own VJP equals autodiff of jnp.einsum
(the oracle), on every branch, and is plain jnp.einsum on TPU and GPU meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.models import dense as dense_mod
from jaxtrain.sharding import targets

CASES = [
    # (eqn, x shape, w shape): K <= N moves x, K > N moves dy
    ("bsd,dhk->bshk", (2, 8, 16), (16, 4, 8)),  # q/k/v projection, K=16 < N=32
    ("bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 16)),  # output projection, K=32 > N=16
    ("...d,df->...f", (2, 8, 16), (16, 64)),  # MLP in
    ("...d,df->...f", (2, 8, 64), (64, 16)),  # MLP out
    ("bsd,dv->bsv", (1, 16, 8), (8, 100)),  # head-like, odd vocab
]


@pytest.mark.parametrize("eqn,xs,ws", CASES)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_values_and_gradients_equal_autodiff_of_einsum(eqn, xs, ws, dtype, tol):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(kw, ws, jnp.float32)).astype(dtype)
    out_shape = jnp.einsum(eqn, x, w).shape
    ct = jax.random.normal(kg, out_shape, jnp.float32).astype(dtype)

    def grads(f):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(ct))

    contract = dense_mod._weight_matmul_contract(eqn)
    # the CPU VJP itself, in both dtypes (dense() routes only float32 to it)
    got = jax.jit(lambda: grads(lambda a, b: dense_mod._dense_cpu(a, b, contract)))()
    want = jax.jit(lambda: grads(lambda a, b: jnp.einsum(eqn, a, b)))()
    for name, g, r in zip(("value", "dx", "dw"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
        assert err <= tol * scale, (name, err, scale)


def test_cpu_program_moves_the_smaller_operand_behind_a_barrier():
    """On CPU the weight gradient's transpose is a real copy of the smaller operand
    (x [T, 16] here, not dy [T, 100])."""
    x = jnp.ones((1, 16, 8))
    w = jnp.ones((8, 100))
    hlo = jax.jit(jax.grad(lambda a, b: jnp.sum(dense_mod.dense(a, b)), argnums=1)).lower(x, w).as_text()
    assert "optimization_barrier" in hlo
    barrier_line = next(line for line in hlo.splitlines() if "optimization_barrier" in line)
    assert "8x16" in barrier_line and "100" not in barrier_line, barrier_line


def test_float32_takes_the_cpu_vjp_and_bfloat16_keeps_autodiff():
    def program(dtype):
        x, w = jnp.ones((1, 16, 8), dtype), jnp.ones((8, 100), dtype)
        f = lambda a, b: jnp.sum(dense_mod.einsum("bsd,dv->bsv", a, b).astype(jnp.float32))
        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).as_text()

    assert "optimization_barrier" in program(jnp.float32)
    assert "optimization_barrier" not in program(jnp.bfloat16)


@pytest.mark.parametrize(
    "eqn,contract",
    [
        ("bsd,dhk->bshk", 1),
        ("bshk,hkd->bsd", 2),
        ("...d,df->...f", 1),
        ("bsd,dv->bsv", 1),
        ("bsd,bsv->dv", None),  # a weight gradient, not a weight matmul
        ("bsv,dv->bsd", None),  # contracts w's last dim
        ("bskgd,btkd->bkgst", None),  # attention scores
        ("bsd,de->bse,", None),
    ],
)
def test_only_weight_matmul_equations_take_the_dense_path(eqn, contract):
    assert dense_mod._weight_matmul_contract(eqn) == contract


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 3\) and w \(4, 5\)"):
        dense_mod.dense(jnp.ones((2, 3)), jnp.ones((4, 5)))


@pytest.mark.deviceless
@pytest.mark.parametrize("target", ["tpu", "h100"])
def test_accelerator_meshes_get_plain_einsum(target):
    """A deviceless TPU or H100 mesh traced on this CPU host is not CPU: no barrier, the
    compiler keeps its own layouts there."""
    if target == "tpu":
        if not targets.tpu_available():
            pytest.skip("libtpu not installed")
        devices = targets.tpu_topology_devices("v5p:2x2x1")
    else:
        if not targets.cuda_available():
            pytest.skip("jax-cuda12-plugin not installed")
        devices = targets.h100_devices(1, 4)
    mesh = jax.sharding.Mesh(np.array(list(devices)[:4]), ("fsdp",))
    seen = {}

    def loss(x, w):
        seen["cpu"] = dense_mod.on_cpu()
        return jnp.sum(dense_mod.dense(x, w))

    with jax.set_mesh(mesh):
        x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert seen["cpu"] is False
    assert "optimization_barrier" not in hlo
