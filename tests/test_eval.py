"""Evaluation during training (`eval.*`): the held-out loss over a fixed set of batches.

Oracles: `eval_loss` equals a hand-run forward (the training loss function,
`TrainProgram.loss_and_grads`, over the same eval batches, combined by their token
counts); the eval step on a context=2 mesh (ring attention, zig-zag sequence order) and an
expert=2 MoE mesh equals one device; the eval data is the documented split."""

import json
import math
import os
import struct

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import DataError, make_data_iterator, make_eval_iterator
from jaxtrain.data.tokenize import tokenize
from jaxtrain.metrics import read_metrics
from jaxtrain.trainer import train
from jaxtrain.trainer.batches import BatchFeeder, batch_to_device
from jaxtrain.trainer.evaluate import Evaluator
from tests import corpora
from tests.conftest import REPO, program_on_mesh, tiny_config


def hand_run_eval_loss(program, params, cfg):
    """sum over eval batches of (mean loss x counted tokens) / total counted tokens, with the
    training loss function on freshly built eval batches (no context permutation: one device)."""
    data = make_eval_iterator(
        cfg.data,
        cfg.eval.paths,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.eval.batch_size or cfg.train.global_batch_size,
        seed=cfg.seed,
    )
    total = count = 0.0
    for k in range(cfg.eval.batches):
        loss, tokens, _ = program.loss_and_grads(
            params, batch_to_device(data.batch_at(k), program.batch_sharding)
        )
        total += float(loss) * float(tokens)
        count += float(tokens)
    return total / count


def read_event_scalars(logdir):
    """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in sorted(os.listdir(logdir)):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def test_eval_loss_equals_a_hand_run_forward_and_goes_to_metrics_and_tensorboard(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "train.steps=5",
        "train.seq_len=32",
        "eval.every=3",
        "eval.batches=3",
        "eval.batch_size=4",
        "logging.tensorboard=true",
    )
    result = train(cfg, devices=jax.devices()[:1])
    # every 3 steps, and once more after the last one
    assert [r["step"] for r in result.evals] == [3, 5]
    last = result.evals[-1]
    expected = hand_run_eval_loss(result.program, result.state.params, cfg)
    np.testing.assert_allclose(last["eval_loss"], expected, rtol=1e-6)
    assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    assert last["eval_tokens"] == 3 * 4 * 32  # synthetic rows: every target counts
    assert result.evals[0]["eval_loss"] > last["eval_loss"]  # it learns
    # metrics.jsonl: eval records are their own lines (no `loss` key), after the step's record
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r for r in rows if "eval_loss" in r] == result.evals
    steps_in_order = [(r["step"], "eval_loss" in r) for r in rows]
    assert steps_in_order.index((3, True)) == steps_in_order.index((3, False)) + 1
    scalars = read_event_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["eval/loss"]] == [3, 5]
    np.testing.assert_allclose(
        [v for _, v in scalars["eval/perplexity"]], [r["eval_perplexity"] for r in result.evals], rtol=1e-6
    )
    assert "train/loss" in scalars and "train/eval_loss" not in scalars


def eval_on_mesh(cfg):
    """The eval record of `cfg`'s fresh (seeded) parameters, through the trainer's evaluator
    and batch placement (context order included), on cfg's mesh."""
    data = make_eval_iterator(
        cfg.data,
        cfg.eval.paths,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.eval.batch_size or cfg.train.global_batch_size,
        seed=cfg.seed,
    )
    with program_on_mesh(cfg) as (program, state, _):
        feeder = BatchFeeder(cfg, None, jax.sharding.get_abstract_mesh(), program.batch_sharding)
        evaluator = Evaluator(cfg, data, feeder, program, log=lambda _: None)
        record = evaluator(state, 0)
        again = evaluator(state, 0)  # the same batches every time
        assert again["eval_loss"] == record["eval_loss"]
        assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing donated
    return record


@pytest.mark.parametrize(
    "config, overrides, parallel",
    [
        ("tiny.yaml", ("train.seq_len=32", "train.microbatches=2"), ("mesh.context=2", "mesh.data=2")),
        ("tiny-moe.yaml", ("train.seq_len=32",), ("mesh.expert=2",)),
    ],
    ids=["context2_data2_microbatches", "moe_expert2"],
)
def test_eval_on_context_and_expert_parallel_meshes_equals_one_device(config, overrides, parallel):
    base = ["logging.progress=false", "logging.tensorboard=false", "eval.every=1", "eval.batches=2"]
    one = load_config(os.path.join(REPO, "configs", config), [*base, *overrides])
    many = load_config(os.path.join(REPO, "configs", config), [*base, *overrides, *parallel])
    single, sharded = eval_on_mesh(one), eval_on_mesh(many)
    assert sharded["eval_tokens"] == single["eval_tokens"] == 2 * 8 * 32
    np.testing.assert_allclose(sharded["eval_loss"], single["eval_loss"], rtol=2e-6)


# --- the eval data ------------------------------------------------------------


def _token_dir(tmp_path, name, n_docs, eval_fraction, seed=0):
    src = corpora.write_jsonl(tmp_path / f"{name}.jsonl", corpora.documents(n_docs, seed=seed))
    out = tmp_path / name
    tokenize([src], str(out), "byte", eval_fraction=eval_fraction, shard_tokens=256, log=lambda _: None)
    return str(out), json.loads((out / "manifest.json").read_text())


def _eval_iter(data_cfg, paths=(), batch=4):
    return make_eval_iterator(data_cfg, paths, vocab_size=512, seq_len=16, global_batch_size=batch, seed=0)


def _tokens_cfg(*paths, **kw):
    import types

    return types.SimpleNamespace(source="tokens", paths=paths, shuffle=True, weights=(), **kw)


def test_eval_data_is_the_eval_split_or_eval_paths_and_the_same_every_time(tmp_path):
    corpus, manifest = _token_dir(tmp_path, "corpus", 60, eval_fraction=0.3)
    assert 0 < manifest["splits"]["eval"]["tokens"] < manifest["splits"]["train"]["tokens"]
    it = _eval_iter(_tokens_cfg(corpus))
    assert [c.split for c in it.components] == ["eval"]
    assert it.components[0].num_tokens == manifest["splits"]["eval"]["tokens"]
    first = [it.batch_at(k) for k in range(3)]
    again = _eval_iter(_tokens_cfg(corpus))
    for k in range(3):
        for key in first[k]:
            np.testing.assert_array_equal(first[k][key], again.batch_at(k)[key])
    # eval.paths: a held-out corpus with no eval split is read whole (its train split);
    # one with an eval split is read through that split
    held_out, _ = _token_dir(tmp_path, "held_out", 10, eval_fraction=0.0, seed=1)
    it = _eval_iter(_tokens_cfg(corpus), [held_out, corpus])
    assert [c.split for c in it.components] == ["train", "eval"]
    # no eval split and no eval.paths: the error says how to get one
    no_split, _ = _token_dir(tmp_path, "no_split", 10, eval_fraction=0.0, seed=2)
    with pytest.raises(DataError, match=r"has no eval split .*--eval-fraction"):
        _eval_iter(_tokens_cfg(no_split))


def test_synthetic_eval_is_a_held_out_stream_and_text_needs_paths(tmp_path):
    import types

    synthetic = types.SimpleNamespace(source="synthetic")
    train_data = make_data_iterator(synthetic, vocab_size=512, seq_len=16, global_batch_size=4, seed=0)
    held_out = _eval_iter(synthetic)
    assert not np.array_equal(train_data.batch_at(0)["inputs"], held_out.batch_at(0)["inputs"])
    with pytest.raises(DataError, match="eval.paths"):
        _eval_iter(synthetic, ["x.txt"])
    with pytest.raises(DataError, match="text has no eval split"):
        _eval_iter(types.SimpleNamespace(source="text", paths=("a.txt",), tokenizer="byte", shuffle=True))


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"eval.every=-1"):
        tiny_config(None, "eval.every=-1")
    with pytest.raises(ConfigError, match=r"eval.batches=0"):
        tiny_config(None, "eval.batches=0")
    with pytest.raises(
        ConfigError, match=r"eval.batch_size=3: expected a positive multiple of train.microbatches=2"
    ):
        tiny_config(None, "eval.batch_size=3", "train.microbatches=2")
    with pytest.raises(ConfigError, match=r"eval.paths=\[\]: eval with data.source=text"):
        tiny_config(None, "eval.every=5", "data.source=text", "data.paths=[a.txt]")
    with pytest.raises(ConfigError, match=r"eval.paths=\['x'\]: data.source=synthetic"):
        tiny_config(None, "eval.paths=[x]")
    from jaxtrain.config import validate

    with pytest.raises(ConfigError, match=r"eval.batch_size=6: expected a multiple of mesh.data"):
        validate(tiny_config(None, "mesh.data=4", "eval.batch_size=6"), num_devices=4)


def test_progress_bar_shows_the_last_eval_loss_beside_the_training_loss(tmp_path):
    from jaxtrain.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, total_steps=10, tensorboard=False, progress=True)
    writer.write({"step": 4, "loss": 2.5, "tokens_per_second": 100.0, "mfu": 0.1})
    writer.write({"step": 4, "eval_loss": 2.25, "eval_perplexity": math.exp(2.25)})
    task = writer._progress.tasks[0]
    writer.close()
    assert (task.completed, task.fields["loss"], task.fields["eval"]) == (4, "2.5000", "2.2500")
