"""The GPU grouped matmul (Pallas Triton, interpret mode) against jax.lax.ragged_dot:
output and both gradients, f32 and bf16, with empty, tiny and very unequal groups, a row
count no tile divides, and garbage rows past the groups; the tile metadata covering every
row exactly once; and a deviceless H100 compile (forward + backward are Triton kernels)
under whichever jax runs the suite."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.pallas_kernels.grouped_matmul_gpu import (  # noqa: E402
    GroupedMatmulBlocks,
    tile_metadata,
    triton_grouped_matmul,
)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# small tiles so that groups straddle tiles at test sizes
BLOCKS = GroupedMatmulBlocks(block_m=16, block_n=16, block_k=16, tgmm_m=16, tgmm_k=16, tgmm_n=16)


def _reference(a, w, gs, valid):
    """ragged_dot with the rows past the groups zeroed (in and out: ragged_dot leaves them
    unspecified), f32 accumulation."""
    a = jnp.where(valid, a, 0)
    out = jax.lax.ragged_dot(
        a, w, gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return jnp.where(valid, out, 0).astype(a.dtype)


def _check(sizes, m, k, n, dtype, tol):
    ka, kw, kd = jax.random.split(jax.random.key(sum(sizes) + m), 3)
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(dtype)
    dout = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    gs = jnp.array(sizes, jnp.int32)
    valid = (jnp.arange(m) < sum(sizes))[:, None]
    a = jnp.where(valid, a, jnp.nan)  # garbage past the groups must not leak anywhere
    dout = jnp.where(valid, dout, jnp.nan)
    ref, ref_vjp = jax.vjp(lambda a, w: _reference(a, w, gs, valid), a, w)
    out, vjp = jax.vjp(lambda a, w: triton_grouped_matmul(a, w, gs, blocks=BLOCKS), a, w)
    (ref_da, ref_dw), (da, dw) = ref_vjp(jnp.where(valid, dout, 0)), vjp(dout)
    for name, x, y in (("out", out, ref), ("da", da, ref_da), ("dw", dw, ref_dw)):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.isfinite(x).all(), name
        scale = max(1.0, float(np.abs(y).max()))
        np.testing.assert_allclose(x, y, atol=tol * scale, rtol=0, err_msg=name)
    # rows past the groups: exactly zero out and zero gradient
    assert not np.asarray(out[sum(sizes) :]).any() and not np.asarray(da[sum(sizes) :]).any()


@pytest.mark.parametrize(
    "sizes, m",
    [
        ([5, 0, 20, 3], 40),  # an empty group in the middle, tail rows, m % 16 != 0
        ([0, 0, 33, 0], 33),  # all rows in one group, empty first and last groups
        ([1, 1, 1, 60], 70),  # tiny groups sharing one tile, one huge group
        ([16, 16, 0, 16], 48),  # groups on tile boundaries
    ],
)
def test_matches_ragged_dot_f32(sizes, m):
    _check(sizes, m, 24, 40, jnp.float32, 1e-5)  # k, n no tile divides (padded)


def test_matches_ragged_dot_bf16():
    _check([3, 50, 0, 11, 1], 70, 32, 48, jnp.bfloat16, 2e-2)


def test_tile_metadata_covers_each_row_once():
    """Each row is stored by exactly one grid entry (the mask's rows), and the entry's
    group is the row's group (or `groups` for the rows past them)."""
    bm, m = 16, 112  # the caller pads m to a tile multiple
    sizes = np.array([0, 7, 30, 0, 1, 40, 0])
    row_tile, lo, hi, grp = (np.asarray(x) for x in tile_metadata(jnp.asarray(sizes), m, bm))
    assert len(row_tile) == m // bm + len(sizes)  # the static bound on visits
    owner = np.full(m, -1)
    hits = np.zeros(m, int)
    for t, l, h, g in zip(row_tile, lo, hi, grp):
        rows = np.arange(t * bm, t * bm + bm)
        rows = rows[(rows >= l) & (rows < h)]
        hits[rows] += 1
        owner[rows] = g
    assert (hits == 1).all()
    expected = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), [len(sizes)] * (m - sizes.sum())])
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.deviceless
def test_compiles_for_h100():
    """fwd + bwd at the MoE layer's shape compile to three Triton kernels and no XLA dot."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.sharding import targets

    try:
        devices = targets.h100_devices(num_hosts=1, gpus_per_host=1)
    except targets.DevicelessUnavailableError as e:
        pytest.skip(str(e))
    mesh = Mesh(np.array(devices), ("data",))
    s = NamedSharding(mesh, P())
    m, k, n, g = 4096, 2048, 1408, 8
    a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=s)
    w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=s)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=s)
    loss = lambda a, w, gs: jnp.sum(triton_grouped_matmul(a, w, gs).astype(jnp.float32) ** 2)
    with jax.set_mesh(mesh):  # the backend comes from the mesh: not interpreted
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, w, gs).compile().as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3, targets.custom_call_targets(hlo)
    assert " dot(" not in hlo


@pytest.mark.parametrize(
    "chip, table, dtype, expected",
    [
        ("h100", {}, "bfloat16", "triton"),  # nothing measured: the Triton kernel
        ("h100", {"h100": "mosaic"}, "bfloat16", "mosaic"),
        ("h100", {"h100": "mosaic"}, "float32", "triton"),  # Mosaic takes bf16/f16 only
        ("a100", {"a100": "mosaic"}, "bfloat16", "triton"),  # Mosaic is Hopper-only
        ("h200", {"h200": "ragged_dot"}, "bfloat16", "ragged_dot"),
    ],
)
def test_auto_on_gpu_resolves_from_the_table(monkeypatch, chip, table, dtype, expected):
    """moe.grouped_matmul=auto on a GPU placement: the chip's measured choice where the kernel
    can run the layer, else the Triton kernel; CPU keeps ragged_dot."""
    from jaxtrain.config import load_config
    from jaxtrain.planning import grouped_matmul_choice
    from jaxtrain.planning.resolve import Placement, resolve
    from tests.conftest import REPO

    monkeypatch.setattr(grouped_matmul_choice, "GPU_GROUPED_MATMUL", table)
    cfg = load_config(os.path.join(REPO, "configs", "tiny-moe.yaml"), [f"model.compute_dtype={dtype}"])
    mesh = dict.fromkeys(cfg.mesh.sizes(), 1)
    assert resolve(cfg, Placement("gpu", mesh, chip=chip)).config.model.moe.grouped_matmul == expected
    assert resolve(cfg, Placement("cpu", mesh)).config.model.moe.grouped_matmul == "ragged_dot"
