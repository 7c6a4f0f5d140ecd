"""`jaxtrain generate` (jaxtrain/interchange/generate.py): every kind of SOURCE, the streamed text
against `models.generate` for the same seed, meshes, and the error contract (exit 2,
one line). The decode compile (`jaxtrain compile --mode decode`) is in tests/test_compile.py."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain import cli, models, sharding
from jaxtrain.interchange import generate as g
from jaxtrain.planning.resolve import axis_rules, resolve_for_mesh
from tests.conftest import REPO, child_env, tiny_config

TINY = os.path.join(REPO, "configs", "tiny.yaml")
HF_TIED = os.path.join(REPO, "tests", "assets", "hf", "llama_tied")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """configs/tiny.yaml (byte tokenizer, vocab 512) trained 2 steps, checkpoint at step 2."""
    from jaxtrain.trainer import train

    out = tmp_path_factory.mktemp("tiny_run")
    train(tiny_config(out, "train.steps=2", "checkpoint.every=2"), devices=jax.devices()[:1])
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A copy of the tiny Llama asset (vocab 128) with a WordLevel tokenizer.json over its ids:
    <unk> <s> </s> w3 .. w127."""
    import tokenizers
    from tokenizers import pre_tokenizers

    d = tmp_path_factory.mktemp("hf") / "llama_tied"
    shutil.copytree(HF_TIED, d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    return d


def generate_cli(capsys, *args):
    code = cli.main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected_text(source, prompt, *, max_new_tokens, **sampling):
    """The continuation `models.generate` (one jitted while loop) gives on one device."""
    src = g.open_source(str(source))
    try:
        tok = g.Tokenizer(
            src.tokenizer, vocab_size=src.cfg.model.vocab_size, special_tokens=src.special_tokens
        )
        ids = tok.encode(prompt)
        eos = src.eos_id if src.eos_id is not None else tok.eos_id
        mesh = g.make_mesh(src.cfg, jax.devices()[:1])
        with jax.set_mesh(mesh), sharding.axis_rules(axis_rules(resolve_for_mesh(src.cfg, mesh))):
            model = g.load_model(src, mesh)
            out = np.asarray(
                models.generate(model, [ids], max_new_tokens=max_new_tokens, eos_id=eos, **sampling)
            )
    finally:
        src.close()
    new = list(out[0, len(ids) :])
    new = new[: new.index(eos)] if eos in new else new
    return tok.continuation(ids, new)


SAMPLED = dict(temperature=0.9, top_k=100, top_p=0.95, seed=3)


# --- a training run: its output_dir, checkpoint.dir, step dir, config --------------------


def test_streamed_text_equals_generate_on_one_device_and_on_a_mesh(run_dir, capsys):
    greedy = expected_text(run_dir, "hello", max_new_tokens=8, seed=0)
    sampled = expected_text(run_dir, "hello", max_new_tokens=8, **SAMPLED)
    assert greedy != sampled
    flags = ["--temperature", "0.9", "--top-k", "100", "--top-p", "0.95", "--seed", "3"]
    for mesh in ([], ["mesh.tensor=2", "mesh.data=2"]):
        code, out, err = generate_cli(capsys, run_dir, *mesh, "--prompt", "hello", "--max-new-tokens", 8)
        assert code == 0, err
        assert out == greedy + "\n"
        code, out, err = generate_cli(
            capsys, run_dir, *mesh, "--prompt", "hello", "--max-new-tokens", 8, *flags
        )
        assert code == 0 and out == sampled + "\n", err
    assert "mesh {'data': 2, 'tensor': 2}" in err and "step 2" in err


def test_every_way_to_name_the_run_gives_the_same_text(run_dir, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    shutil.copy(run_dir / "config.yaml", config)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("hello")
    texts = set()
    for source in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "2", config):
        code, out, err = generate_cli(capsys, source, "--prompt-file", prompt_file, "--max-new-tokens", 6)
        assert code == 0, err
        texts.add(out)
    assert len(texts) == 1


def test_text_is_written_token_by_token(run_dir):
    src = g.open_source(str(run_dir))
    chunks = []
    result = g.run(src, "hello", max_new_tokens=8, write=chunks.append, devices=jax.devices()[:1])
    src.close()
    assert len(chunks) == len(result.new_ids) + (result.stop != "eos")  # one per token, then the end
    assert "".join(chunks) == result.text + "\n"
    assert result.stop in ("eos", "max_new_tokens") and 1 <= len(result.new_ids) <= 8


def test_cli_subprocess_simulates_the_mesh_devices(run_dir):
    """As a user runs it: a fresh process simulates the 4 CPU devices the mesh needs."""
    expected = expected_text(run_dir, "hello", max_new_tokens=8, seed=0)
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-m", "jaxtrain", "generate", str(run_dir), "mesh.tensor=2", "mesh.data=2"]
        + ["--prompt", "hello", "--max-new-tokens", "8", "--seed", "0"],
        capture_output=True,  # bytes: text mode would turn a generated "\r" into "\n"
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode("utf-8") == expected + "\n"
    assert "mesh {'data': 2, 'tensor': 2}" in out.stderr.decode()


def test_random_init_only_when_asked(tmp_path, capsys):
    args = [TINY, f"output_dir={tmp_path}", "mesh.tensor=2"]
    code, _, err = generate_cli(capsys, *args, "--prompt", "hi", "--max-new-tokens", 3)
    assert code == 2 and "--random-init" in err
    code, out, err = generate_cli(capsys, *args, "--random-init", "--prompt", "hi", "--max-new-tokens", 3)
    assert code == 0 and "random initialisation" in err and out.endswith("\n")
    assert not any(tmp_path.iterdir())  # nothing written


# --- Hugging Face directory and converted checkpoint --------------------------------------


def test_hf_dir_and_its_converted_checkpoint(hf_dir, capsys, tmp_path):
    prompt = "w5 w17 w3 w9"
    expected = expected_text(hf_dir, prompt, max_new_tokens=8)
    # The ids by hand: WordLevel ids are the numbers, the continuation is " w.. w.." (no EOS here).
    model = models.from_hf(HF_TIED)
    out = np.asarray(models.generate(model, [[5, 17, 3, 9]], max_new_tokens=8))[0, 4:]
    assert 2 not in out.tolist()
    assert expected == "".join(f" w{i}" for i in out)
    code, text, err = generate_cli(capsys, hf_dir, "--prompt", prompt, "--max-new-tokens", 8)
    assert code == 0 and text == expected + "\n", err
    assert cli.main(["convert", "hf-to-ckpt", str(hf_dir), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()  # convert carries the tokenizer along
    capsys.readouterr()
    code, text, err = generate_cli(
        capsys, tmp_path / "ckpt", "mesh.tensor=2", "--prompt", prompt, "--max-new-tokens", 8
    )
    assert code == 0 and text == expected + "\n", err
    assert "mesh {'tensor': 2}" in err


# --- bad input: exit 2, one line --------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/run", "--prompt", "x"], "no such file or directory; expected a run config"),
        (["{tmp}", "--prompt", "x"], "not a model source"),
        (["{run}", "--prompt", "hello", "--max-len", "5"], "leaves no room in the model's 5-position"),
        (["{run}", "--prompt", ""], "the prompt is empty"),
        (["{run}", "--prompt-file", "/nonexistent/p.txt"], "--prompt-file=/nonexistent/p.txt"),
        ([HF_TIED, "--prompt", "x", "--tokenizer", "byte"], "vocab mismatch: tokenizer 'byte' has 257 ids"),
        ([HF_TIED, "--prompt", "x"], "no tokenizer.json there"),
        ([TINY, "output_dir={tmp}", "--prompt", "x"], "no complete checkpoint"),
        (["{run}", "mesh.context=2", "--prompt", "x"], "generation needs mesh.context=1"),
        (["{run}", "mesh.tensor=2", "mesh.data=8", "--prompt", "x"], "needs 16 devices; 8 available"),
        (["{run}", "model.d_model=64", "--prompt", "x"], "model.d_model=64 but the checkpoint has 128"),
        (["{run}", "--prompt", "x", "--top-p", "1.5"], "--top-p=1.5"),
        (["{run}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0"),
        (["{run}", "--prompt", "x", "--max-len", "0"], "--max-len=0"),
        (["{hf}", "model.n_layers=3", "--prompt", "w3"], "model.n_layers=3"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, run_dir, hf_dir, tmp_path, capsys):
    args = [a.format(tmp=tmp_path, run=run_dir, hf=hf_dir) for a in args]
    code, out, err = generate_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxtrain: error: ") and message in err, err


def test_bad_source_in_a_fresh_process_has_no_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "jaxtrain", "generate", "/nonexistent/run", "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 2 and out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if not line.startswith("WARNING")]
    assert lines == [f"jaxtrain: error: /nonexistent/run: no such file or directory; {g.SOURCES}"]
