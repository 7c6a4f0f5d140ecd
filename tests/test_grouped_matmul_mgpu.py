"""JAX's Mosaic GPU ragged-dot kernels in the grouped-matmul contract
(pallas_kernels/grouped_matmul_mgpu.py): under the Mosaic GPU interpreter (jax >= 0.12)
against jax.lax.ragged_dot, output and both gradients in bf16 with empty, tiny and very
unequal groups and garbage rows past them; the shape checks refuse by name; a deviceless
H100 compile of forward + backward is three Mosaic GPU kernels."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from jaxtrain.pallas_kernels.grouped_matmul_mgpu import MosaicBlocks, mosaic_grouped_matmul  # noqa: E402

BLOCKS = MosaicBlocks(
    block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, dw_block_m=64, dw_block_n=64, dw_block_k=64
)
needs_interpreter = pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"), reason="this jax has no Mosaic GPU interpreter"
)


@needs_interpreter
@pytest.mark.parametrize("sizes, m", [([40, 0, 3, 100], 160), ([0, 1, 127, 0], 128)])
def test_matches_ragged_dot(sizes, m):
    k, n = 128, 64
    ka, kw, kd = jax.random.split(jax.random.key(m), 3)
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(jnp.bfloat16)
    dout = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    valid = (jnp.arange(m) < sum(sizes))[:, None]
    a_bad, dout_bad = jnp.where(valid, a, jnp.nan), jnp.where(valid, dout, jnp.nan)

    def reference(a, w):
        out = jax.lax.ragged_dot(jnp.where(valid, a, 0), w, gs, preferred_element_type=jnp.float32)
        return jnp.where(valid, out, 0).astype(a.dtype)

    ref, ref_vjp = jax.vjp(reference, a, w)
    out, vjp = jax.vjp(lambda a, w: mosaic_grouped_matmul(a, w, gs, blocks=BLOCKS, interpret=True), a_bad, w)
    refs = (ref, *ref_vjp(jnp.where(valid, dout, 0)))
    for name, x, y in zip(("out", "da", "dw"), (out, *vjp(dout_bad)), refs):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.isfinite(x).all(), name
        np.testing.assert_allclose(x, y, atol=2e-2 * max(1.0, np.abs(y).max()), rtol=0, err_msg=name)


def test_refuses_by_name():
    a = jnp.zeros((64, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match="k=100 must be a multiple of block_k=64"):
        mosaic_grouped_matmul(a, jnp.zeros((2, 100, 128), jnp.bfloat16), jnp.array([32, 32]))
    with pytest.raises(ValueError, match="bf16 or f16"):
        mosaic_grouped_matmul(a.astype(jnp.float32)[:, :64], jnp.zeros((2, 64, 128)), jnp.array([32, 32]))


@pytest.mark.deviceless
def test_compiles_for_h100():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.sharding import targets

    try:
        devices = targets.h100_devices(num_hosts=1, gpus_per_host=1)
    except targets.DevicelessUnavailableError as e:
        pytest.skip(str(e))
    s = NamedSharding(Mesh(np.array(devices), ("data",)), P())
    m, k, n, g = 4096, 2048, 1408, 8
    a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=s)
    w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=s)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=s)
    loss = lambda a, w, gs: jnp.sum(mosaic_grouped_matmul(a, w, gs).astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, w, gs).compile().as_text()
    assert hlo.count('custom_call_target="mosaic_gpu') == 3, targets.custom_call_targets(hlo)
    assert " dot(" not in hlo
