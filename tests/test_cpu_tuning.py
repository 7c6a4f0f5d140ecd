"""models/cpu_tuning.py: XLA:CPU's program changes compute what the portable program
computes. Oracles: autodiff of jnp.einsum for the weight matmuls, jax.vjp of
models/attention.py `xla_attention` for the attention, and whole training runs with
`model.cpu_tuning` off (the program a TPU or GPU runs) for the model. And a TPU or GPU
program never contains them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import cpu_tuning
from jaxtrain.models.attention import attend, xla_attention
from jaxtrain.trainer import train
from tests.conftest import tiny_config

CASES = [
    # (eqn, x shape, w shape): K <= N moves x, K > N moves dy
    ("bsd,dhk->bshk", (2, 8, 16), (16, 4, 8)),  # q/k/v projection, K=16 < N=32
    ("bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 16)),  # output projection, K=32 > N=16
    ("...d,df->...f", (2, 8, 16), (16, 64)),  # MLP in
    ("...d,df->...f", (2, 8, 64), (64, 16)),  # MLP out
    ("...d,dv->...v", (1, 16, 8), (8, 100)),  # head-like, odd vocab
]


def _close(got, want, tol, names):
    for name, g, r in zip(names, got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        r32, g32 = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert np.max(np.abs(g32 - r32)) <= tol * np.max(np.abs(r32)), name


@pytest.mark.parametrize("eqn,xs,ws", CASES)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_weight_matmul_values_and_gradients_equal_autodiff_of_einsum(eqn, xs, ws, dtype, tol):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(kw, ws, jnp.float32)).astype(dtype)
    ct = jax.random.normal(kg, jnp.einsum(eqn, x, w).shape, jnp.float32).astype(dtype)

    def grads(f):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(ct))

    # any_dtype: the transpose-free VJP itself in both dtypes (by default only float32 takes it)
    got = jax.jit(lambda: grads(lambda a, b: cpu_tuning.einsum(eqn, a, b, any_dtype=True)))()
    want = jax.jit(lambda: grads(lambda a, b: jnp.einsum(eqn, a, b)))()
    _close(got, want, tol, ("value", "dx", "dw"))


def test_the_weight_gradient_moves_the_smaller_operand_behind_a_barrier():
    """The weight gradient's transpose is a real copy of the smaller operand (x [T, 16]
    here, not dy [T, 100]); bfloat16 keeps autodiff's program."""
    x, w = jnp.ones((1, 16, 8)), jnp.ones((8, 100))
    grad = lambda a, b: jnp.sum(cpu_tuning.einsum("...d,dv->...v", a, b).astype(jnp.float32))
    hlo = jax.jit(jax.grad(grad, argnums=1)).lower(x, w).as_text()
    barrier_line = next(line for line in hlo.splitlines() if "optimization_barrier" in line)
    assert "8x16" in barrier_line and "100" not in barrier_line, barrier_line
    bf16 = jax.jit(jax.grad(grad, argnums=1)).lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert "optimization_barrier" not in bf16.as_text()


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
def test_only_weight_matmul_equations_take_the_transpose_free_gradient(eqn, contract):
    assert cpu_tuning._weight_matmul_contract(eqn) == contract


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 3\) and w \(4, 5\)"):
        cpu_tuning.einsum("...d,df->...f", jnp.ones((2, 3)), jnp.ones((4, 5)))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("block_rows,blocks", [(128, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize(
    "heads,kv_heads,window,packed", [(4, 4, None, False), (4, 2, None, True), (4, 1, 3, True)]
)
def test_attention_equals_autodiff_of_xla_attention(
    monkeypatch, dtype, tol, heads, kv_heads, window, packed, block_rows, blocks
):
    """The CPU attention (own VJP: recomputes the probabilities from the log-sum-exp, moves q
    and dO for dK/dV; causal query blocks that skip the keys after their last row) against
    jax.vjp of xla_attention: output and all three gradients, MHA / GQA / MQA, packed
    segments (a boundary inside a block), a sliding window, in 1, 2 and 4 query blocks.
    Tolerance relative to the largest entry. The dispatcher routes to it exactly when
    cpu_tuned is set."""
    monkeypatch.setattr(cpu_tuning, "QUERY_BLOCK_ROWS", block_rows)
    assert cpu_tuning.causal_query_blocks(16, 16, True) == blocks
    dt = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(1), 4)
    b, s, d = 2, 16, 8
    q = jax.random.normal(ks[0], (b, s, heads, d)).astype(dt)
    k = jax.random.normal(ks[1], (b, s, kv_heads, d)).astype(dt)
    v = jax.random.normal(ks[2], (b, s, kv_heads, d)).astype(dt)
    ct = jax.random.normal(ks[3], (b, s, heads, d)).astype(dt)
    seg = (
        jnp.concatenate([jnp.ones((b, 7), jnp.int32), 2 * jnp.ones((b, 9), jnp.int32)], 1) if packed else None
    )

    def value_and_grads(f):
        y, vjp = jax.vjp(lambda *a: f(*a, segment_ids=seg, causal=True, sliding_window=window), q, k, v)
        return (y, *vjp(ct))

    got = jax.jit(lambda: value_and_grads(cpu_tuning.attention))()
    want = jax.jit(lambda: value_and_grads(xla_attention))()
    _close(got, want, tol, ("out", "dq", "dk", "dv"))
    for f, tuned in ((cpu_tuning.attention, True), (xla_attention, False)):
        kw = dict(segment_ids=seg, sliding_window=window)
        routed = jax.jit(lambda: attend(q, k, v, impl="xla", cpu_tuned=tuned, **kw))()
        direct = jax.jit(lambda: f(q, k, v, causal=True, **kw))()
        np.testing.assert_array_equal(np.asarray(routed, np.float32), np.asarray(direct, np.float32))


def test_causal_query_blocks():
    """About 128 rows a block, at most 8, a divisor of the length; one block when not
    causal or not self-attention. Work left: (n + 1) / 2n of the square."""
    blocks = [cpu_tuning.causal_query_blocks(s, s, True) for s in (64, 128, 256, 384, 512, 1000, 1024, 8192)]
    assert blocks == [1, 1, 2, 3, 4, 5, 8, 8]
    assert cpu_tuning.causal_query_blocks(512, 512, False) == 1
    assert cpu_tuning.causal_query_blocks(512, 1024, True) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tuned_training_equals_the_portable_program(tmp_path, dtype):
    """The tiny model on data x fsdp x tensor, remat none (so the bfloat16 run keeps the
    gathered weights as well), with every CPU change on and with none: the same losses
    within reduction-order noise, and in float32 the same trained parameters."""
    common = (
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.steps=4",
        "model.remat=none",
        f"model.compute_dtype={dtype}",
    )
    runs = {
        tuned: train(tiny_config(tmp_path / tuned, *common, f"model.cpu_tuning={tuned}"))
        for tuned in ("true", "false")
    }
    losses = {k: [r["loss"] for r in v.metrics] for k, v in runs.items()}
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=1e-5 if dtype == "float32" else 1e-2)
    if dtype == "float32":
        tuned, portable = (jax.tree.leaves(runs[k].state.params) for k in ("true", "false"))
        for a, b in zip(tuned, portable):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
