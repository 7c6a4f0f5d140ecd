"""HF <-> jaxtrain checkpoint conversion and train.init_from. Oracle: transformers'
logits for the tiny HF assets and the assets' own tensors."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtrain import sharding
from jaxtrain.interchange.convert import ckpt_to_hf, hf_to_ckpt, load_params, read_model_config
from jaxtrain.models.hf import HFConversionError, from_hf
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from jaxtrain.trainer.program import build_program
from tests.conftest import tiny_config

ASSET = Path(__file__).parent / "assets" / "hf" / "llama_gqa_rope_llama3"


def test_hf_to_ckpt_to_hf_round_trip(tmp_path):
    cfg = hf_to_ckpt(ASSET, tmp_path / "ckpt")
    assert read_model_config(tmp_path / "ckpt") == dataclasses.replace(cfg)
    out = ckpt_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=50_000)
    theirs = load_file(str(ASSET / "model.safetensors"))
    ours = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(ours) == set(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    tokens = np.load(ASSET / "tokens.npy")
    np.testing.assert_allclose(np.asarray(from_hf(out)(tokens)), np.load(ASSET / "logits.npy"), atol=1e-5)


def test_init_from_loads_sharded_weights_with_transformers_logits(tmp_path):
    model_cfg = hf_to_ckpt(ASSET, tmp_path / "ckpt")
    overrides = [
        f"model.{k}={v}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if v not in (None, ()) and not isinstance(v, dict)
    ]
    cfg = tiny_config(
        tmp_path,
        *overrides,
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.seq_len=16",
        f"train.init_from={tmp_path / 'ckpt'}",
    )
    mesh = sharding.make_mesh(cfg.mesh.sizes())
    cfg = resolve_for_mesh(cfg, mesh)
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.DEFAULT_RULES):
        program = build_program(cfg, mesh, sharding.DEFAULT_RULES)
        abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(program.init).params,
            program.state_shardings.params,
        )
        params = load_params(tmp_path / "ckpt", cfg.model, abstract)
        wq = params["blocks"]["attn"]["wq"]
        assert wq.sharding.spec == program.state_shardings.params["blocks"]["attn"]["wq"].spec
        from jaxtrain import models

        model = models.merge(program.graphdef, program.abstract_params, params)
        logits = jax.jit(lambda t: model(t))(np.load(ASSET / "tokens.npy"))
    np.testing.assert_allclose(np.asarray(logits), np.load(ASSET / "logits.npy"), atol=1e-5)


def test_init_from_with_a_different_model_names_the_field(tmp_path):
    hf_to_ckpt(ASSET, tmp_path / "ckpt")
    cfg = tiny_config(tmp_path)
    with pytest.raises(HFConversionError, match="model.vocab_size"):
        load_params(tmp_path / "ckpt", cfg.model, {})


def test_convert_cli_and_init_from_training(tmp_path, monkeypatch):
    """The CLI converts HF -> checkpoint, training starts from it (its first loss is the
    converted model's loss, not a random init's), and the checkpoint converts back. The run
    never initialises parameters randomly (the random init is never even traced), so it holds
    one copy of them at any time."""
    import subprocess
    import sys

    from jaxtrain.trainer import program as program_module
    from jaxtrain.trainer import train
    from tests.conftest import REPO

    random_inits = []
    fresh = program_module.fresh_params
    monkeypatch.setattr(program_module, "fresh_params", lambda make: random_inits.append(1) or fresh(make))

    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "jaxtrain", "convert", *a],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    out = run("hf-to-ckpt", str(ASSET), str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train.init_from=" in out.stdout
    back = run("ckpt-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert back.returncode == 0, back.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    bad = run("hf-to-ckpt", str(tmp_path / "nowhere"), str(tmp_path / "x"))
    assert bad.returncode == 2 and "config.json" in bad.stderr

    model_cfg = read_model_config(tmp_path / "ckpt")
    overrides = [
        f"model.{k}={v}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if v not in (None, ()) and not isinstance(v, dict)
    ]
    cfg = tiny_config(
        tmp_path / "run",
        *overrides,
        "train.steps=2",
        "train.seq_len=16",
        "model.vocab_size=128",
        f"train.init_from={tmp_path / 'ckpt'}",
    )
    first = train(cfg, devices=jax.devices()[:1]).metrics[0]["loss"]
    assert random_inits == []
    from jaxtrain.data import make_data_iterator

    batch = next(
        make_data_iterator(
            cfg.data, vocab_size=128, seq_len=16, global_batch_size=cfg.train.global_batch_size, seed=cfg.seed
        )
    )
    import optax

    logits = from_hf(ASSET)(batch["inputs"])
    expected = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean())
    assert abs(first - expected) < 1e-4  # f32 CE of the converted model on the first batch
    # the spy does see a random initialisation where there is one
    fresh_run = dataclasses.replace(
        cfg, output_dir=str(tmp_path / "fresh"), train=dataclasses.replace(cfg.train, init_from=None, steps=1)
    )
    train(fresh_run, devices=jax.devices()[:1])
    assert random_inits == [1]


# --- training checkpoints -> HF -------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny model trained 3 steps on an fsdp=2 mesh, checkpointed at step 3."""
    from jaxtrain.trainer import train

    out = tmp_path_factory.mktemp("run")
    cfg = tiny_config(out, "train.steps=3", "checkpoint.every=3", "mesh.fsdp=2", "train.seq_len=32")
    result = train(cfg, devices=jax.devices()[:2])
    assert result.checkpoint_step == 3
    return cfg, result


def _logits_of(result, cfg, params, tokens):
    from jaxtrain import models

    with jax.set_mesh(result.mesh), sharding.axis_rules(axis_rules(resolve_for_mesh(cfg, result.mesh))):
        model = models.merge(result.program.graphdef, result.program.abstract_params, params)
        return np.asarray(jax.jit(lambda t: model(t))(tokens))


def _cli(*args):
    import subprocess
    import sys

    from tests.conftest import REPO

    return subprocess.run(
        [sys.executable, "-m", "jaxtrain", "convert", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_ckpt_to_hf_from_a_training_step_dir_and_output_dir(trained, tmp_path):
    """`ckpt-to-hf` on a training checkpoint's step directory and on the run's output_dir
    (newest step; Orbax tmp and set-aside directories are not steps, and are left alone):
    from_hf of each export gives the trained model's logits."""
    cfg, result = trained
    out = Path(cfg.output_dir)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16), dtype=np.int32)
    want = _logits_of(result, cfg, result.state.params, tokens)
    fresh = _logits_of(result, cfg, result.program.init().params, tokens)
    assert np.max(np.abs(want - fresh)) > 1e-3  # training moved the logits: the test can tell

    ckpts = out / "checkpoints"
    (ckpts / "9.orbax-checkpoint-tmp-1234").mkdir()  # a write in flight
    (ckpts / "7.unreadable").mkdir()  # set aside by a resume
    for name, source in (("step", ckpts / "3"), ("run", out)):
        done = _cli("ckpt-to-hf", str(source), str(tmp_path / name))
        assert done.returncode == 0, done.stderr[-2000:]
        got = np.asarray(from_hf(tmp_path / name)(tokens))
        err = float(np.max(np.abs(got - want)))
        print(f"{name}: max |logit error| {err:.3g}")
        assert err <= 1e-6, (name, err)
    assert (ckpts / "9.orbax-checkpoint-tmp-1234").is_dir()  # read-only: nothing cleaned up


def test_init_from_a_training_checkpoint_restores_its_params(trained):
    """train.init_from accepts a run's output_dir: the newest step's parameters, exactly."""
    from jaxtrain.recovery.checkpoint import abstract_state

    cfg, result = trained
    with jax.set_mesh(result.mesh), sharding.axis_rules(axis_rules(resolve_for_mesh(cfg, result.mesh))):
        params = load_params(cfg.output_dir, cfg.model, abstract_state(result.program).params)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(result.state.params)
    ):
        assert got.sharding == want.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


def test_ckpt_to_hf_on_a_folder_that_is_no_checkpoint_names_it(tmp_path, capsys):
    from jaxtrain.cli import main

    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    assert main(["convert", "ckpt-to-hf", str(tmp_path / "stuff"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'stuff'}: not a checkpoint" in err
    assert "model.yaml" in err and "step" in err and "output_dir" in err
    assert not (tmp_path / "hf").exists()
