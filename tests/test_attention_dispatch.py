"""The model's attention dispatcher: `attention_impl=pallas` (the flash kernel in
interpret mode, inside shard_map over batch/heads) trains like `xla`, with packed
multi-document rows; `auto` resolves by backend."""

import json

import jax
import numpy as np
import pytest

from jaxtrain.models.attention import resolve_impl
from jaxtrain.trainer import train
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "platform,impl", [("cpu", "xla"), ("tpu", "pallas"), ("gpu", "pallas"), ("cuda", "pallas")]
)
def test_auto_resolves_by_backend(platform, impl):
    assert resolve_impl("auto", platform) == impl
    assert resolve_impl("xla", "tpu") == "xla"


def test_pallas_trains_like_xla_on_packed_documents(tmp_path):
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sharding", "mesh", "kernel", "flash"]
    docs.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 12)))}) + "\n" for _ in range(200)
        )
    )

    def losses(impl):
        cfg = tiny_config(
            tmp_path / impl,
            "model.d_model=64",
            "model.mlp_dim=128",
            "train.seq_len=64",
            "train.steps=3",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "data.source=text",
            f"data.paths=[{docs}]",
            f"model.attention_impl={impl}",
        )
        return [r["loss"] for r in train(cfg, devices=jax.devices()).metrics]

    xla, pallas = losses("xla"), losses("pallas")
    # f32; the kernel's blockwise softmax differs from XLA's only in summation order.
    np.testing.assert_allclose(pallas, xla, rtol=1e-5)


def test_packed_rows_really_hold_several_documents(tmp_path):
    from jaxtrain.data import make_data_iterator

    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": f"short doc {i}"}) + "\n" for i in range(50)))
    cfg = tiny_config(None, "data.source=text", f"data.paths=[{docs}]")
    it = make_data_iterator(cfg.data, vocab_size=512, seq_len=64, global_batch_size=2, seed=0)
    assert next(it)["segment_ids"].max() >= 3


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("block_rows,blocks", [(128, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize(
    "heads,kv_heads,window,packed", [(4, 4, None, False), (4, 2, None, True), (4, 1, 3, True)]
)
def test_cpu_attention_equals_autodiff_of_xla_attention(
    monkeypatch, dtype, tol, heads, kv_heads, window, packed, block_rows, blocks
):
    """cpu_attention (own VJP: recomputes the probabilities from the log-sum-exp, moves q
    and dO for dK/dV; causal query blocks that skip the keys after their last row) against
    jax.vjp of xla_attention: output and all three gradients, MHA / GQA / MQA, packed
    segments (a boundary inside a block), a sliding window, in 1, 2 and 4 query blocks.
    Tolerance relative to the largest entry."""
    import jax.numpy as jnp

    from jaxtrain.models import attention
    from jaxtrain.models.attention import attend, cpu_attention, xla_attention

    monkeypatch.setattr(attention, "QUERY_BLOCK_ROWS", block_rows)
    assert attention.causal_query_blocks(16, 16, True) == blocks

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

    got = jax.jit(lambda: value_and_grads(cpu_attention))()
    want = jax.jit(lambda: value_and_grads(xla_attention))()
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        r32, g32 = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert np.max(np.abs(g32 - r32)) <= tol * np.max(np.abs(r32)), name
    # on this CPU backend the model's "xla" attention is this one
    routed = jax.jit(lambda: attend(q, k, v, segment_ids=seg, impl="xla", sliding_window=window))()
    direct = jax.jit(lambda: cpu_attention(q, k, v, segment_ids=seg, causal=True, sliding_window=window))()
    np.testing.assert_array_equal(np.asarray(routed, np.float32), np.asarray(direct, np.float32))


def test_causal_query_blocks():
    """About 128 rows a block, at most 8, a divisor of the length; one block when not
    causal or not self-attention. Work left: (n + 1) / 2n of the square."""
    from jaxtrain.models.attention import causal_query_blocks

    assert [causal_query_blocks(s, s, True) for s in (64, 128, 256, 384, 512, 1000, 1024, 8192)] == [
        1,
        1,
        2,
        3,
        4,
        5,
        8,
        8,
    ]
    assert causal_query_blocks(512, 512, False) == 1
    assert causal_query_blocks(512, 1024, True) == 1
