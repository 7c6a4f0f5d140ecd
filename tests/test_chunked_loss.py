"""Chunked cross-entropy (train.loss_chunk) equals the plain loss over the full logits:
the function alone against optax's softmax cross-entropy (loss and gradients, f32 and
bf16), and the whole train program, sharded fsdp=2 x tensor=2 with microbatches and tied
embeddings, against the plain loss on one device (loss, gradients, eval sums)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.trainer.batches import batch_to_device
from jaxtrain.trainer.loss import chunked_cross_entropy, cross_entropy
from tests.conftest import program_on_mesh, replace, tiny_config
from tests.test_collectives import while_bodies

B, S, D, V = 2, 16, 32, 96


def _inputs(dtype):
    kx, kh, kt, km = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (B, S, D), jnp.float32).astype(dtype)
    head = jax.random.normal(kh, (D, V), jnp.float32) * 0.3
    targets = jax.random.randint(kt, (B, S), 0, V)
    mask = (jax.random.uniform(km, (B, S)) > 0.25).astype(jnp.float32)
    return x, head, targets, mask


def _plain(x, head, targets, mask):  # the oracle: optax over the full logits
    return cross_entropy(x @ head.astype(x.dtype), targets, mask)[0]


def _chunked(chunk):
    return lambda x, head, targets, mask: chunked_cross_entropy(x, head, targets, mask, chunk=chunk)[0]


def _value_and_grads(fn, *args):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(*args)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_f32_matches_plain(chunk):
    args = _inputs(jnp.float32)
    loss, (dx, dhead) = _value_and_grads(_chunked(chunk), *args)
    ref, (ref_dx, ref_dhead) = _value_and_grads(_plain, *args)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(_chunked(chunk))(*args), ref, rtol=1e-6)  # primal (no VJP) path
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dhead, ref_dhead, rtol=1e-5, atol=1e-6)
    assert dx.dtype == jnp.float32 and dhead.dtype == jnp.float32


@pytest.mark.composes("bf16+chunked_loss")
def test_bf16_compute_close_to_f32():
    """bf16 activations: the chunked loss keeps f32 logits, so it is at least as close to the
    f32 oracle as the plain bf16 loss (stated tolerance: 1e-2 relative on the loss, gradients
    within 2% of their largest entry)."""
    ref, (ref_dx, ref_dhead) = _value_and_grads(_plain, *_inputs(jnp.float32))
    args = _inputs(jnp.bfloat16)
    loss, (dx, dhead) = _value_and_grads(_chunked(4), *args)
    plain, (plain_dx, plain_dhead) = _value_and_grads(_plain, *args)
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, ref, rtol=1e-2)
    assert abs(loss - ref) <= abs(plain - ref) + 1e-3 * abs(ref)
    for got, want in ((dx, ref_dx), (dhead, ref_dhead)):
        err = np.max(np.abs(np.asarray(got, np.float32) - want))
        assert err <= 0.02 * np.max(np.abs(want)), err


def test_loss_scale_cotangent_scales_gradients():
    """The fused backward multiplies by the incoming cotangent (loss scaling, 1/tokens)."""
    args = _inputs(jnp.float32)
    _, (dx, dhead) = _value_and_grads(lambda *a: 3.0 * _chunked(4)(*a), *args)
    _, (ref_dx, ref_dhead) = _value_and_grads(lambda *a: 3.0 * _plain(*a), *args)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dhead, ref_dhead, rtol=1e-5, atol=1e-6)


def _small(chunk, **overrides):
    cfg = tiny_config(
        None,
        "model.d_model=64",
        "model.mlp_dim=128",
        "train.seq_len=32",
        "model.vocab_size=128",
        "model.n_layers=1",
        f"train.loss_chunk={chunk}",
    )
    return replace(cfg, **overrides)


def _program_results(cfg):
    with program_on_mesh(cfg) as (program, state, data):
        batch = batch_to_device(next(data), program.batch_sharding)
        loss, _, grads = program.loss_and_grads(state.params, batch)
        total, count = program.eval_step(state, batch)
        return float(loss), jax.device_get(grads), (float(total), float(count))


@pytest.mark.composes("fsdp+chunked_loss", "tensor+chunked_loss", "lm+chunked_loss", "dense+chunked_loss")
@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["untied", "tied"])
def test_program_sharded_matches_plain_single_device(tied):
    one = dict(data=1, fsdp=1, tensor=1)
    model = dict(tie_embeddings=tied)
    ref_loss, ref_grads, ref_eval = _program_results(_small(0, mesh=one, model=model))
    loss, grads, evals = _program_results(
        _small(8, mesh=dict(data=1, fsdp=2, tensor=2), model=model, train=dict(microbatches=2))
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(evals, ref_eval, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), grads, ref_grads)


def test_loss_chunk_must_divide_seq_len():
    from jaxtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.loss_chunk=5.*train.seq_len=32"):
        _small(5)


def test_loss_chunk_rejects_other_words():
    from jaxtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.loss_chunk=fast: expected auto, 0"):
        tiny_config(None, "train.loss_chunk=fast")


def test_auto_chunks_large_logits_in_four_and_leaves_small_ones_plain():
    """`auto` by hand: f32 logits per device = 4 x tokens x vocab / (data x fsdp x expert x
    context x tensor) bytes; from 16 MiB, 4 chunks of seq_len / 4 positions."""
    from jaxtrain.config import load_config
    from jaxtrain.planning.resolve import Placement, logits_mib_per_device, resolve
    from tests.conftest import REPO

    def chunk(cfg, mesh):
        """(resolved train.loss_chunk, the log line saying why, or None when not auto)."""
        resolution = resolve(cfg, Placement("cpu", mesh))
        why = [n for n in resolution.notes if n.startswith("train.loss_chunk")]
        return resolution.config.train.loss_chunk, why[0] if why else None

    peer = load_config(f"{REPO}/configs/bench-peer.yaml")  # 8 x 512 tokens, vocab 32000
    assert peer.train.loss_chunk == "auto"
    assert logits_mib_per_device(peer, {"fsdp": 8}) == 4 * 4096 * 32000 / 8 / 2**20 == 62.5
    assert chunk(peer, {"fsdp": 8})[0] == 128
    # 64 devices: 7.8 MiB each
    assert chunk(peer, {"data": 2, "fsdp": 8, "tensor": 4}) == (
        0,
        "train.loss_chunk=auto -> 0: the plain loss: 7.8 MiB of f32 logits per device, under 16 MiB",
    )
    # microbatches split the tokens: 4 of them leave 15.6 MiB
    micro = replace(peer, train=dict(microbatches=4))
    assert chunk(micro, {"fsdp": 8})[0] == 0
    # a sequence that does not split in four keeps the plain loss
    odd = replace(peer, train=dict(seq_len=510))
    assert chunk(odd, {"fsdp": 8})[1].endswith("train.seq_len=510 does not split into 4 chunks")
    # a number is kept as configured, without a line
    assert chunk(replace(peer, train=dict(loss_chunk=0)), {"fsdp": 8}) == (0, None)
    # the tiny config: 8 x 128 tokens x 512 entries, 2 MiB on one device
    assert chunk(tiny_config(), {})[0] == 0


def test_vocab_parallel_loss_takes_one_collective_per_chunk():
    """With the head's vocabulary split over fsdp=8, each chunk of the loss gathers its row
    statistics once (left to XLA's partitioner it took two or more a chunk, nine on bench-peer),
    and the loss, both gradients and the primal (eval) value equal optax over the full logits."""
    from jaxtrain import sharding

    b, s, d, v = 8, 16, 32, 256
    kx, kh, kt = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (b, s, d), jnp.float32)
    head = jax.random.normal(kh, (d, v), jnp.float32) * 0.3
    targets = jax.random.randint(kt, (b, s), 0, v)
    mask = jnp.ones((b, s), jnp.float32).at[:, :3].set(0.0)
    ref, (ref_dx, ref_dhead) = _value_and_grads(_plain, x, head, targets, mask)
    mesh = sharding.make_mesh({"fsdp": 8}, jax.devices()[:8])
    rules = sharding.vocab_parallel_head(sharding.PRESETS["fsdp_tensor"])
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
        grad_fn = jax.jit(jax.value_and_grad(_chunked(4), argnums=(0, 1)))
        loss, (dx, dhead) = grad_fn(x, head, targets, mask)
        primal = jax.jit(_chunked(4))(x, head, targets, mask)
        hlo = grad_fn.lower(x, head, targets, mask).compile().as_text()
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    np.testing.assert_allclose(primal, ref, rtol=1e-6)
    # atol as dhead's: sums over a vocabulary split in 8 round apart from one device's (1.5e-7 seen)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dhead, ref_dhead, rtol=1e-5, atol=1e-6)
    collective = r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\("
    per_body = [re.findall(collective, body) for body in while_bodies(hlo).values()]
    assert [[op for op, _ in ops] for ops in per_body if ops] == [["all-gather"]], per_body
