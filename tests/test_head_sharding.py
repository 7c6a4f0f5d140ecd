"""The vocab-parallel output head: `mesh.head_sharding`, `sharding.vocab_parallel_head`.

Oracles: the single-device run (loss and gradients of the whole train program, plain and
chunked loss, tied and untied head); the layout's definition (the head's specs by hand; once
the head is vocab-parallel no collective moves a head-sized array, while FSDP gathers it);
and `auto`'s byte comparison worked by hand."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.config import ConfigError, load_config, validate
from jaxtrain.planning.resolve import Placement, axis_rules, resolve
from tests.conftest import REPO, replace, tiny_config
from tests.test_collectives import compiled_hlo
from tests.test_sharded_training import loss_and_grads

# f32: the sharded program changes only the summation order (tests/test_sharded_training.py)
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-4, 1e-6


def _mesh(**sizes):
    n = int(np.prod(list(sizes.values())))
    return sharding.make_mesh(sizes, jax.devices()[:n])


def test_vocab_parallel_head_specs_by_hand():
    mesh = _mesh(fsdp=4, tensor=2)
    spec = lambda axes, rules: sharding.logical_to_spec(axes, rules, mesh)
    embed, vocab = sharding.FSDP_TENSOR, sharding.vocab_parallel_head(sharding.FSDP_TENSOR)
    # FSDP: the head and the table are sharded on d_model like every weight
    assert spec(("head_embed", "head_vocab"), embed) == P("fsdp", "tensor")
    assert spec(("vocab", "embed"), embed) == P("tensor", "fsdp")
    assert spec(("head_batch", "seq", "act_vocab"), embed) == P("fsdp", None, "tensor")
    # vocab-parallel: fsdp moves to the vocabulary, after tensor; the head's rows are gathered
    assert spec(("head_embed", "head_vocab"), vocab) == P(None, ("tensor", "fsdp"))
    assert spec(("vocab", "embed"), vocab) == P("tensor", "fsdp")  # the table keeps its layout
    assert spec(("head_batch", "seq", "act_vocab"), vocab) == P(None, None, ("tensor", "fsdp"))
    # nothing else moves
    for axes in [("layers", "embed", "heads", "head_dim"), ("batch", "seq", "act_embed"), ("embed", "mlp")]:
        assert spec(axes, vocab) == spec(axes, embed)
    # data still splits the head's rows; the fsdp preset has no vocab rule, so one is added
    assert sharding.logical_to_spec(("head_batch", "seq", "act_vocab"), vocab, _mesh(data=2, fsdp=4)) == P(
        "data", None, "fsdp"
    )
    assert spec(("head_embed", "head_vocab"), sharding.vocab_parallel_head(sharding.FSDP)) == P(None, "fsdp")


def _bench_peer(*overrides):
    return load_config(f"{REPO}/configs/bench-peer.yaml", list(overrides))


@pytest.mark.parametrize(
    "overrides,mesh,expected",
    [
        # 8 x 512 = 4096 rows per device against 32000 vocabulary columns: vocab
        ((), dict(fsdp=8), "vocab"),
        # 256 x 512 = 131072 rows >= 32000: embed (a pod's batch)
        (("train.global_batch_size=256",), dict(fsdp=8), "embed"),
        # 64 x 512 / 2 microbatches = 16384 < 32000: vocab; / data=2 more so
        (("train.global_batch_size=64", "train.microbatches=2"), dict(fsdp=8), "vocab"),
        # ... but tensor=4 leaves 8000 columns per device, fewer than 16384 rows: embed
        (("train.global_batch_size=64", "train.microbatches=2"), dict(fsdp=2, tensor=4), "embed"),
        ((), dict(fsdp=1, data=8), "embed"),  # no fsdp axis
        (("mesh.rules=data_parallel",), dict(fsdp=8), "embed"),  # nothing to move the head off
        (("mesh.head_sharding=embed",), dict(fsdp=8), "embed"),  # as configured
        (("mesh.head_sharding=vocab", "train.global_batch_size=256"), dict(fsdp=8), "vocab"),
    ],
)
def test_auto_picks_vocab_when_fewer_rows_than_columns(overrides, mesh, expected):
    resolution = resolve(_bench_peer(*overrides), Placement("cpu", mesh))
    mode, why = resolution.config.mesh.head_sharding, resolution.notes
    assert mode == expected, why
    rules = axis_rules(resolution.config)
    head = tuple(sharding.logical_to_spec(("head_embed", "head_vocab"), rules, _mesh(**mesh))) + (None, None)
    assert ("fsdp" in sharding.axes_tuple(head[1])) == (expected == "vocab" and mesh.get("fsdp", 1) > 1)


def test_head_sharding_config_errors():
    with pytest.raises(ConfigError, match="mesh.head_sharding='rows'"):
        validate(_bench_peer("mesh.head_sharding=rows"))
    with pytest.raises(ConfigError, match="data_parallel"):
        validate(_bench_peer("mesh.head_sharding=vocab", "mesh.rules=data_parallel"))
    with pytest.raises(ConfigError, match="mesh.stage=2"):
        validate(_bench_peer("mesh.head_sharding=vocab", "mesh.fsdp=4", "mesh.stage=2"))


def _small(head, *overrides, **mesh):
    cfg = tiny_config(
        None, "model.d_model=64", "model.mlp_dim=128", "train.seq_len=32", "model.vocab_size=128", *overrides
    )
    return replace(cfg, mesh=dict(mesh, head_sharding=head))


CASES = {
    "plain": ((), dict(fsdp=4, tensor=2)),
    "chunked": (("train.loss_chunk=8",), dict(fsdp=4, tensor=2)),
    "tied-chunked": (("model.tie_embeddings=true", "train.loss_chunk=8"), dict(fsdp=8)),
    "tied-microbatches": (("model.tie_embeddings=true", "train.microbatches=2"), dict(data=2, fsdp=4)),
    # the chunked loss's shard_map (jaxtrain/trainer/loss.py): rows split over data (the loss
    # and the head's gradient summed over it), over context (each device chunks its own
    # positions), and a batch that the vocabulary shards do not divide (d loss / d x summed
    # whole instead of reduce-scattered)
    "chunked-data": (("train.loss_chunk=8",), dict(data=2, fsdp=4)),
    "chunked-context": (("train.loss_chunk=8",), dict(fsdp=4, context=2)),  # against embed, same mesh
    "chunked-small-batch": (("train.loss_chunk=8", "train.global_batch_size=4"), dict(fsdp=4, tensor=2)),
}


PAIRS = {"chunked-data": ("data+chunked_loss",)}  # feature pairs a case runs against one device


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.composes(*PAIRS[c])) if c in PAIRS else c for c in CASES]
)
def test_vocab_parallel_matches_single_device(case):
    overrides, mesh = CASES[case]
    # Ring attention's summation order moves the loss by about 1e-4 against one device, so
    # with a context axis the oracle is the FSDP head on the same mesh (its loss, partitioned
    # by XLA, equals the one-device loss to 1e-7 without a context axis: the other cases).
    ref_mesh = mesh if "context" in mesh else dict(data=1, fsdp=1, tensor=1)
    ref_loss, ref_grads, _ = loss_and_grads(_small("embed", *overrides, **ref_mesh))
    loss, grads, specs = loss_and_grads(_small("vocab", *overrides, **mesh))
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads
    )
    # an untied head's gradient stays vocab-sharded over fsdp (no reshard back to d_model)
    if "model.tie_embeddings=true" not in overrides:
        assert "fsdp" in sharding.axes_tuple((*specs["lm_head"], None, None)[1])


def _head_collectives(head):
    """Collectives of the fsdp=8 forward + backward program that move a head-sized array."""
    cfg = _small(head, "model.vocab_size=1024", fsdp=8)  # head 64 x 1024 > activations 256 x 64
    _, mesh, lowered = compiled_hlo(cfg, jax.devices()[:8])
    m = cfg.model
    head_elems = m.vocab_size * m.d_model
    ops = sharding.collectives.collectives_by_axes(lowered.compile().as_text(), mesh)

    def elems(shape_text):  # the largest array of a (possibly tuple) shape
        return max(
            int(np.prod([int(d) for d in dims.split(",") if d]))
            for dims in re.findall(r"\[([0-9,]*)\]", shape_text)
        )

    return [op for op in ops if elems(op.shape) >= head_elems]


def test_vocab_parallel_head_is_never_gathered():
    """FSDP gathers the [d_model, vocab] head (and sums its gradient) over fsdp; the
    vocab-parallel program moves no array that large."""
    assert {op.kind for op in _head_collectives("embed")} >= {"all-gather"}
    assert _head_collectives("vocab") == []
