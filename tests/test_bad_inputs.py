"""Every bad input gets one clean line and exit 2, and nothing a user had is overwritten.

One parametrised test per family. Each case runs the real CLI entry point
(`jaxtrain.cli.main`) in-process and asserts: the exit code, one stderr line that
names the culprit, no traceback, and (where the user had files) their md5 sums
unchanged. In-process is enough here: every case fails before anything compiles.
"""

import hashlib
import json
import os

import pytest
from conftest import REPO

from jaxtrain import cli

TINY = os.path.join(REPO, "configs", "tiny.yaml")
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def run_cli(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_clean_error(code, err, *culprits, exit_code=2):
    assert code == exit_code, err
    assert "Traceback" not in err, err
    # Progress lines logged before the failure may precede it; the error is one line, last.
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("jaxtrain: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one error line, last:\n{err}"
    for culprit in culprits:
        assert culprit in errors[0], (culprit, errors[0])


def md5s(folder) -> dict[str, str]:
    sums = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                sums[os.path.relpath(path, folder)] = hashlib.md5(f.read()).hexdigest()
    return sums


# ------------------------------------------------------------------------------ config


def _config_cases(tmp):
    empty = tmp / "empty.yaml"
    empty.write_text("")
    comments = tmp / "comments.yaml"
    comments.write_text("# nothing but a comment\n")
    not_yaml = tmp / "bad.yaml"
    not_yaml.write_text("model: [unclosed\n")
    a_list = tmp / "list.yaml"
    a_list.write_text("- a\n- b\n")
    binary = tmp / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    return {
        "empty file": ([str(empty)], [str(empty), "empty"]),
        "only comments": ([str(comments)], [str(comments), "empty"]),
        "a directory": ([str(tmp)], [str(tmp), "is a directory"]),
        "missing file": ([str(tmp / "nope.yaml")], ["nope.yaml", "not found"]),
        "not YAML": ([str(not_yaml)], [str(not_yaml), "not valid YAML"]),
        "not a mapping": ([str(a_list)], [str(a_list), "mapping"]),
        "binary file": ([str(binary)], [str(binary)]),
        "unknown key": ([TINY, "model.d_modle=64"], ["model.d_modle", "unknown key"]),
        "wrong type": ([TINY, "train.steps=many"], ["train.steps", "many"]),
        "bad override syntax": ([TINY, "train.steps"], ["train.steps", "dotted.key=value"]),
        "section is not a section": ([TINY, "model.d_model.x=1"], ["model.d_model.x"]),
    }


@pytest.mark.parametrize(
    "case",
    [
        "empty file",
        "only comments",
        "a directory",
        "missing file",
        "not YAML",
        "not a mapping",
        "binary file",
        "unknown key",
        "wrong type",
        "bad override syntax",
        "section is not a section",
    ],
)
def test_config_family(case, tmp_path, capsys):
    argv, culprits = _config_cases(tmp_path)[case]
    code, _, err = run_cli(["train", *argv, *QUIET, f"output_dir={tmp_path}/run"], capsys)
    assert_clean_error(code, err, *culprits)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_section_override_merges_into_the_section():
    """`model={...}` merges into the YAML's model section (docs: configuration)."""
    from jaxtrain.config import load_config

    base = load_config(TINY)
    cfg = load_config(TINY, ["model={d_model: 64, mlp_dim: 96}"])
    assert (cfg.model.d_model, cfg.model.mlp_dim) == (64, 96)
    # Every other model setting is the YAML's, not the dataclass default.
    for field in ("vocab_size", "n_layers", "n_heads", "n_kv_heads", "rope_theta", "remat"):
        assert getattr(cfg.model, field) == getattr(base.model, field), field
    # A non-mapping value still replaces (how a section is switched off).
    moe = load_config(os.path.join(REPO, "configs", "tiny-moe.yaml"), ["model.moe=null"])
    assert moe.model.moe is None


# -------------------------------------------------------------------------------- data


def _data_cases(tmp):
    binary = tmp / "weights.bin.txt"
    binary.write_bytes(b"looks like text at first\n" + bytes(range(256)))
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("caf\u00e9 ol\u00e9\n".encode("latin-1"))
    bad_jsonl = tmp / "docs.jsonl"
    bad_jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    missing_field = tmp / "fields.jsonl"
    missing_field.write_text('{"text": "a"}\n{"body": "b"}\n')
    return {
        "binary file as text": (binary, [str(binary), "byte 25", "binary"]),
        "latin-1 text": (latin1, [str(latin1), "not valid UTF-8 at byte 3"]),
        "invalid UTF-8 in jsonl": (bad_jsonl, [f"{bad_jsonl}:2", "not valid UTF-8"]),
        "missing jsonl field": (missing_field, [f"{missing_field}:2", "'text'"]),
        "missing file": (tmp / "absent.txt", ["absent.txt"]),
    }


DATA_CASES = [
    "binary file as text",
    "latin-1 text",
    "invalid UTF-8 in jsonl",
    "missing jsonl field",
    "missing file",
]
# In-process runs see the suite's 8 simulated devices.
MESH8 = ["mesh.data=8"]


@pytest.mark.parametrize("case", DATA_CASES)
def test_data_family_train(case, tmp_path, capsys):
    path, culprits = _data_cases(tmp_path)[case]
    data = ["data.source=text", f"data.paths=[{path}]"]
    argv = ["train", TINY, *data, *MESH8, *QUIET, f"output_dir={tmp_path}/run"]
    code, _, err = run_cli(argv, capsys)
    assert_clean_error(code, err, *culprits)


@pytest.mark.parametrize("case", DATA_CASES)
def test_data_family_tokenize(case, tmp_path, capsys):
    path, culprits = _data_cases(tmp_path)[case]
    out = tmp_path / "tok"
    argv = ["tokenize", str(path), "--out", str(out), "--tokenizer", "byte", "--no-progress"]
    code, _, err = run_cli(argv, capsys)
    assert_clean_error(code, err, *culprits)


def test_a_utf8_character_split_across_read_chunks_is_not_an_error(tmp_path, monkeypatch):
    from jaxtrain.data import documents

    monkeypatch.setattr(documents, "_TEXT_CHUNK", 7)
    text = "h\u00e9llo \u20ac uro \U0001f600 |" * 5
    path = tmp_path / "multi.txt"
    path.write_text(text, encoding="utf-8")
    docs = [doc for _, doc in documents.DocumentReader(str(path), separator="|")]
    assert docs == [piece for piece in text.split("|") if piece]


# ------------------------------------------------------------------- sizes and paths


def _size_and_path_cases(tmp):
    a_file = tmp / "notes.txt"
    a_file.write_text("my notes\n")
    empty_dir = tmp / "empty"
    empty_dir.mkdir()
    return {
        "absurd seq_len": (["train.seq_len=1000000000"], ["train.seq_len=1000000000", "needs at least"]),
        "absurd vocab": (["model.vocab_size=4000000000"], ["model.vocab_size=4000000000", "needs at least"]),
        "absurd batch": (["train.global_batch_size=80000000"], ["train.global_batch_size=80000000"]),
        "output_dir is a file": ([f"output_dir={a_file}"], ["output_dir", str(a_file), "is a file"]),
        "checkpoint.dir is a file": ([f"checkpoint.dir={a_file}"], ["checkpoint.dir", "is a file"]),
        "output_dir under a file": ([f"output_dir={a_file}/run"], ["output_dir", "is a file"]),
        "init_from missing": (["train.init_from=/no/such/ckpt"], ["train.init_from", "/no/such/ckpt"]),
        "init_from empty folder": ([f"train.init_from={empty_dir}"], ["train.init_from", str(empty_dir)]),
    }


SIZE_AND_PATH_CASES = [
    "absurd seq_len",
    "absurd vocab",
    "absurd batch",
    "output_dir is a file",
    "checkpoint.dir is a file",
    "output_dir under a file",
    "init_from missing",
    "init_from empty folder",
]


@pytest.mark.parametrize("case", SIZE_AND_PATH_CASES)
def test_sizes_and_paths_are_refused_before_compile(case, tmp_path, capsys):
    overrides, culprits = _size_and_path_cases(tmp_path)[case]
    before = md5s(tmp_path)
    argv = ["train", TINY, *MESH8, *QUIET, f"output_dir={tmp_path}/run", *overrides]
    code, _, err = run_cli(argv, capsys)
    assert_clean_error(code, err, *culprits)
    assert md5s(tmp_path) == before  # nothing written, nothing changed
    assert not (tmp_path / "run").exists()


def test_a_genuine_bug_shows_its_traceback_and_asks_for_a_report(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(cli, "_compile", broken)
    code, _, err = run_cli(["compile", TINY, "--target", "tpu:v5p-8"], capsys)
    assert code == cli.EXIT_BUG == 70
    assert "Traceback" in err and "RuntimeError: an invariant broke" in err
    assert err.strip().splitlines()[-1].startswith("jaxtrain: internal error in `jaxtrain compile`")
    assert "please report it" in err


# ----------------------------------------------------------------------------- compile

COMPILE_CASES = {
    "unknown generation": (["--target", "tpu:v9-8"], ["tpu:v9-8", "expected tpu:GEN-N"]),
    "odd v5p cores": (["--target", "tpu:v5p-7"], ["tpu:v5p-7", "even"]),
    "no hosts": (["--target", "gpu:h100", "--hosts", "0"], ["--hosts=0"]),
    "unknown platform": (["--target", "npu:x-8"], ["npu:x-8"]),
    "mesh vs heads": (["mesh.tensor=3", "--target", "tpu:v5p-8"], ["mesh.tensor=3"]),
    "mesh vs devices": (["mesh.data=3", "--target", "tpu:v5p-8"], ["mesh", "device count 4"]),
    "decode batch 0": (
        ["--target", "tpu:v5p-8", "--mode", "decode", "--batch", "0", "--max-len", "16"],
        ["--batch=0"],
    ),
}


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compile_family(case, capsys):
    extra, culprits = COMPILE_CASES[case]
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    flags = [a for a in extra if a not in overrides]
    code, _, err = run_cli(["compile", TINY, *overrides, *flags], capsys)
    assert_clean_error(code, err, *culprits)


# --------------------------------------------------------------- nothing overwritten

ASSET = os.path.join(REPO, "tests", "assets", "hf", "llama_tied")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """configs/tiny.yaml, 2 steps, a checkpoint at step 2, on the suite's 8 devices."""
    out = tmp_path_factory.mktemp("run")
    argv = ["train", TINY, *MESH8, *QUIET, "train.steps=2", "checkpoint.every=2", f"output_dir={out}"]
    assert cli.main(argv) == 0
    return out


def test_a_refused_resume_rewrites_nothing(trained_run, capsys):
    """A resume rejected for a model-shape mismatch leaves config.yaml, metrics and
    TensorBoard exactly as they were (it used to rewrite config.yaml and add an event file)."""
    before = md5s(trained_run)
    argv = ["train", TINY, *MESH8, *QUIET, "model.d_model=64", "train.steps=4", "checkpoint.every=2"]
    code, _, err = run_cli([*argv, f"output_dir={trained_run}", "logging.tensorboard=true"], capsys)
    assert_clean_error(code, err, "checkpoint")
    assert md5s(trained_run) == before


def test_a_resumed_run_marks_where_it_appends(tmp_path, capsys):
    common = ["train", TINY, *MESH8, *QUIET, "checkpoint.every=2", f"output_dir={tmp_path}"]
    assert cli.main([*common, "train.steps=2"]) == 0
    assert cli.main([*common, "train.steps=4"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4]
    checkpoint = str(tmp_path / "checkpoints" / "2")
    assert rows[2] == {"step": 2, "event": "resume", "tier": "persistent", "checkpoint": checkpoint}
    assert all("loss" in r for i, r in enumerate(rows) if i != 2)


@pytest.mark.parametrize("direction", ["hf-to-ckpt", "ckpt-to-hf"])
def test_convert_refuses_a_non_empty_destination_without_force(direction, trained_run, tmp_path, capsys):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text('{"mine": true}\n')  # a user's file
    (dest / "model.yaml").write_text("d_model: 1\n")
    before = md5s(dest)
    source = ASSET if direction == "hf-to-ckpt" else str(trained_run)
    code, _, err = run_cli(["convert", direction, source, str(dest)], capsys)
    assert_clean_error(code, err, str(dest), "not empty", "--force")
    assert md5s(dest) == before
    assert run_cli(["convert", direction, source, str(dest), "--force"], capsys)[0] == 0


def test_convert_family(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["hf-to-ckpt", str(tmp_path / "nope"), str(tmp_path / "o1")], ["nope"]),
        (["hf-to-ckpt", ASSET, str(a_file)], [str(a_file), "is a file"]),
        (["ckpt-to-hf", str(tmp_path), str(tmp_path / "o2")], [str(tmp_path), "not a checkpoint"]),
        (["ckpt-to-hf", str(tmp_path / "nope"), str(tmp_path / "o3")], ["nope"]),
    ]
    for argv, culprits in cases:
        code, _, err = run_cli(["convert", *argv], capsys)
        assert_clean_error(code, err, *culprits)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


# ----------------------------------------------------------------------- checkpoint


def test_unreadable_checkpoints_stop_the_run_or_with_skip_are_one_warning_line_each(tmp_path, capsys):
    """By default a checkpoint proved unreadable stops the run with one line and nothing moved
    (checkpoint.on_unreadable=stop); with `skip` each is set aside with one warning line."""
    common = ["train", TINY, *MESH8, *QUIET, "checkpoint.every=2", f"output_dir={tmp_path}"]
    assert cli.main([*common, "train.steps=6"]) == 0
    ckpts = tmp_path / "checkpoints"
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckpts / "6" / "state") for f in fs]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:  # a truncated array file
        f.truncate(os.path.getsize(biggest) // 2)
    os.remove(ckpts / "4" / "state" / "_METADATA")  # a lost metadata file
    before = md5s(ckpts)
    capsys.readouterr()
    code, _, err = run_cli([*common, "train.steps=8"], capsys)
    assert_clean_error(
        code, err, "checkpoints/6 is unreadable", "OUT_OF_RANGE", "checkpoint.on_unreadable=skip"
    )
    assert md5s(ckpts) == before
    assert cli.main([*common, "train.steps=8", "checkpoint.on_unreadable=skip"]) == 0
    import gc

    gc.collect()  # anything abandoned would print now
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, err
    for step, line in zip((6, 4), warnings):
        assert f"checkpoints/{step} is unreadable (" in line and line.endswith("fell back to step 2"), line
        assert f"moved it to {step}.unreadable" in line
    for noise in ("Traceback", "Exception ignored", "Event loop is closed", "WARNING:absl"):
        assert noise not in err, err
    # nothing but the run's own lines: its start-up, the two warnings, the resume, the saves
    known = ("mesh", "model.", "train.", "host malloc:", "warning: checkpoint", "resumed from checkpoint")
    known += ("config changed since", "compiled train step", "checkpoint step", "goodput ")
    assert [line for line in err.splitlines() if line and not line.startswith(known)] == [], err
