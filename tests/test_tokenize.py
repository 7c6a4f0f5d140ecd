"""`jaxtrain tokenize`: corpora in every supported format -> token shards, resumable.

Oracles: each document encoded alone with the `tokenizers` library (or its UTF-8 bytes),
plus EOS, compared with the shard files read back with plain `np.fromfile`; the split
rule re-derived with hashlib; an uninterrupted run's files, byte for byte. All exact."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxtrain.data import shards
from jaxtrain.data.tokenize import add_tokenize_parser, run_tokenize, tokenize
from tests.conftest import REPO
from tests.corpora import documents, encode_reference, train_bpe, word_level, write_jsonl, write_parquet


def parse(*argv):
    p = argparse.ArgumentParser(prog="jaxtrain")
    add_tokenize_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["tokenize", *map(str, argv)])


def read_split(out, split="train"):
    """(stream, ends) of a split, from the raw files the manifest lists."""
    manifest = json.loads((out / "manifest.json").read_text())
    dtype = shards.TOKEN_DTYPES[manifest["dtype"]]
    info = manifest["splits"][split]
    tokens = np.concatenate([np.fromfile(out / s["tokens_file"], dtype=dtype) for s in info["shards"]])
    ends = np.concatenate([np.fromfile(out / s["docs_file"], dtype="<u8") for s in info["shards"]])
    assert tokens.size == info["tokens"] and ends.size == info["documents"]
    for s in info["shards"][:-1]:
        assert s["tokens"] == manifest["shard_tokens"]
    return tokens.astype(np.int64), ends.astype(np.int64)


def split_docs(tokens, ends):
    starts = np.concatenate([[0], ends[:-1]])
    assert ends[-1] == tokens.size
    return [tokens[a:b].tolist() for a, b in zip(starts, ends)]


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = documents(60, seed=1)
    return d, docs, train_bpe(d / "bpe.json", docs)


FORMATS = ["txt", "txt-separator", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_round_trip_every_format(tmp_path, corpus, fmt, tokenizer):
    _, docs, bpe = corpus
    tok = bpe if tokenizer == "bpe" else "byte"
    halves = [docs[:25], docs[25:]]
    extra = []
    if fmt == "txt":  # one document per file, given as a glob
        for i, d in enumerate(docs):
            (tmp_path / f"{i:03d}.txt").write_bytes(d.encode())
        inputs = [tmp_path / "*.txt"]
    elif fmt == "txt-separator":
        for i, half in enumerate(halves):
            (tmp_path / f"{i}.txt").write_bytes(("<|sep|>".join(half) + "<|sep|>").encode())
        inputs, extra = [tmp_path / "0.txt", tmp_path / "1.txt"], ["--separator", "<|sep|>"]
    elif fmt == "parquet":
        inputs = [write_parquet(tmp_path / f"{i}.parquet", h, field="body") for i, h in enumerate(halves)]
        extra = ["--text-field", "body"]
    else:
        inputs = [write_jsonl(tmp_path / f"{i}.{fmt}", h, field="body") for i, h in enumerate(halves)]
        extra = ["--text-field", "body"]
    out = tmp_path / "out"
    args = parse(
        *inputs, "--out", out, "--tokenizer", tok, "--shard-tokens", 300, "--batch-mb", 0.0005, *extra
    )
    assert run_tokenize(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    expected = encode_reference(tok, docs)
    tokens, ends = read_split(out)
    assert split_docs(tokens, ends) == expected
    assert len(manifest["splits"]["train"]["shards"]) == -(-sum(map(len, expected)) // 300) >= 3
    assert list(manifest["splits"]) == ["train"]
    info = manifest["tokenizer"]
    if tok == "byte":
        assert (info["vocab_size"], info["eos_id"]) == (257, 256)
    else:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(bpe)
        assert (info["vocab_size"], info["eos_id"]) == (hf.get_vocab_size(), hf.token_to_id("</s>"))
        assert info["sha256"] == hashlib.sha256(open(bpe, "rb").read()).hexdigest()
        assert (out / "tokenizer.json").read_bytes() == open(bpe, "rb").read()
    assert manifest["dtype"] == "uint16"
    for s in manifest["splits"]["train"]["shards"]:
        assert hashlib.sha256((out / s["tokens_file"]).read_bytes()).hexdigest() == s["sha256"]
    assert not [n for n in os.listdir(out) if "partial" in n or n == "progress.json" or n.endswith(".tmp")]


def test_lone_surrogates_become_replacement_characters(tmp_path, corpus):
    # JSON may escape half a surrogate pair; UTF-8 cannot hold it: U+FFFD, as for invalid bytes.
    (tmp_path / "s.jsonl").write_text('{"text": "ab\\ud83dcd"}\n{"text": "\\ud83d\\ude42 ok"}\n')
    for tok in ("byte", corpus[2]):
        out = tmp_path / f"out-{tok == 'byte'}"
        tokenize([str(tmp_path / "s.jsonl")], str(out), tok, log=lambda _: None)
        assert split_docs(*read_split(out)) == encode_reference(tok, ["ab\ufffdcd", "\U0001f642 ok"])


def test_eval_split_by_text_hash_and_uint32_vocab(tmp_path):
    docs = documents(80, seed=2)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    tokenize([src], str(out), "byte", eval_fraction=0.3, shard_tokens=200, log=lambda _: None)

    def is_eval(text):  # the documented rule, re-derived
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64 < 0.3

    for split, want in (("train", False), ("eval", True)):
        got = split_docs(*read_split(out, split))
        assert got == encode_reference("byte", [d for d in docs if is_eval(d) == want])
    assert 0 < len(split_docs(*read_split(out, "eval"))) < len(docs)

    # A vocabulary over 65536 ids is stored as uint32.
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    big = word_level(tmp_path / "big.json", vocab)
    (tmp_path / "w.txt").write_text("w3 w69999 w12")
    tokenize([str(tmp_path / "w.txt")], str(tmp_path / "out32"), big, log=lambda _: None)
    m = json.loads((tmp_path / "out32" / "manifest.json").read_text())
    assert m["dtype"] == "uint32"
    assert read_split(tmp_path / "out32")[0].tolist() == [5, 70001, 14, 1]


def test_bad_line_named_with_file_and_line_finished_shards_kept_then_fix_and_resume(tmp_path, capsys):
    docs = documents(40, seed=3)
    a = write_jsonl(tmp_path / "a.jsonl", docs[:30], blank_lines=False)
    b = tmp_path / "b.jsonl"
    lines = [json.dumps({"text": d}) for d in docs[30:]]
    bad = lines[:5] + ['{"text": "cut off'] + lines[5:]
    b.write_text("\n".join(bad) + "\n")
    out = tmp_path / "out"
    argv = [a, b, "--out", out, "--tokenizer", "byte", "--shard-tokens", 256, "--batch-mb", 0.0002]
    assert run_tokenize(parse(*argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxtrain: error: {b}:6: invalid JSON"), err
    progress = json.loads((out / "progress.json").read_text())
    finished = progress["splits"]["train"]["state"]["shards"]
    assert len(finished) >= 2 and not (out / "manifest.json").exists()
    kept = {s["tokens_file"]: (out / s["tokens_file"]).read_bytes() for s in finished}
    for s in finished:  # valid: as recorded, and the tokens a clean run would have there
        assert hashlib.sha256(kept[s["tokens_file"]]).hexdigest() == s["sha256"]
    clean = tmp_path / "clean"
    b_fixed = tmp_path / "fixed" / "b.jsonl"
    b_fixed.parent.mkdir()
    b_fixed.write_text("\n".join(lines) + "\n")
    tokenize([a, str(b_fixed)], str(clean), "byte", shard_tokens=256, log=lambda _: None)
    for name, data in kept.items():
        assert (clean / name).read_bytes() == data
    # Fix the reported line in place and rerun: it resumes and the result is the clean run's.
    b.write_text("\n".join(lines) + "\n")
    stats = {n: os.stat(out / n) for n in kept}
    assert run_tokenize(parse(*argv)) == 0
    for n, st in stats.items():  # finished shards kept, not rewritten
        assert (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    got, want = snapshot(out), snapshot(clean)
    got.pop("manifest.json"), want.pop("manifest.json")
    assert got == want


@pytest.mark.parametrize(
    "case",
    ["missing field", "not an object", "id >= vocab", "corrupt gzip", "no parquet column", "missing file"],
)
def test_bad_input_is_named(tmp_path, capsys, case):
    good = write_jsonl(tmp_path / "good.jsonl", ["a b", "b a"], blank_lines=False)
    tok = "byte"
    if case == "missing field":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "ok"}\n{"txt": "a"}\n')
        where = f"{bad}:2: expected an object with a string 'text' field"
    elif case == "not an object":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "ok"}\n\n["text"]\n')
        where = f"{bad}:3: expected an object"
    elif case == "id >= vocab":
        # get_vocab_size() counts 5 entries, but "big" has id 10
        tok = word_level(tmp_path / "gap.json", {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "big": 10})
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "a b"}\n{"text": "b"}\n{"text": "a big"}\n')
        where = f"{bad}:3: tokenizer {tok!r} produced id 10 >= its vocab size 5"
    elif case == "corrupt gzip":
        bad = tmp_path / "bad.jsonl.gz"
        bad.write_bytes(open(write_jsonl(tmp_path / "x.jsonl.gz", documents(50)), "rb").read()[:300])
        where = f"{bad}: unreadable"
    elif case == "no parquet column":
        bad = write_parquet(tmp_path / "bad.parquet", ["x"], field="content")
        where = f"{bad}: no column 'text'"
    else:
        bad = tmp_path / "nothing.jsonl"
        where = f"{bad}: no such file or directory"
    code = run_tokenize(parse(good, bad, "--out", tmp_path / "out", "--tokenizer", tok))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"jaxtrain: error: {where}"), err


def test_out_dir_rules_refuse_force_and_done(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", documents(10))
    other = write_jsonl(tmp_path / "d.jsonl", documents(5, seed=9))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_tokenize(parse(src, "--out", out, "--tokenizer", "byte")) == 2
    assert "not empty" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert run_tokenize(parse(src, "--out", out, "--tokenizer", "byte")) == 0
    first = snapshot(out)
    capsys.readouterr()
    assert run_tokenize(parse(src, "--out", out, "--tokenizer", "byte")) == 0  # done already
    assert "nothing to do" in capsys.readouterr().out and snapshot(out) == first
    assert run_tokenize(parse(other, "--out", out, "--tokenizer", "byte")) == 2
    assert "--force" in capsys.readouterr().err
    assert run_tokenize(parse(other, "--out", out, "--tokenizer", "byte", "--force")) == 0
    assert split_docs(*read_split(out)) == encode_reference("byte", documents(5, seed=9))
    for bad in (["--eval-fraction", "1.0"], ["--shard-tokens", "0"]):
        assert run_tokenize(parse(src, "--out", tmp_path / "x", "--tokenizer", "byte", *bad)) == 2
        assert bad[0] in capsys.readouterr().err


KILLER = textwrap.dedent("""
    import argparse, os, signal, sys
    from jaxtrain.data import shards
    from jaxtrain.data.tokenize import add_tokenize_parser

    write, written = shards.SplitWriter._write_shard, []

    def write_then_die(self, tokens):  # SIGKILL right after the 3rd train shard, before progress.json
        write(self, tokens)
        written.append(self.split)
        if written.count("train") == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    shards.SplitWriter._write_shard = write_then_die
    p = argparse.ArgumentParser()
    add_tokenize_parser(p.add_subparsers())
    args = p.parse_args(sys.argv[1:])
    sys.exit(args.func(args))
""")


def test_kill_9_mid_run_then_rerun_resumes_byte_identical(tmp_path, corpus):
    _, docs, bpe = corpus
    inputs = [write_jsonl(tmp_path / "a.jsonl.zst", docs[:30]), write_jsonl(tmp_path / "b.jsonl", docs[30:])]
    opts = ["--tokenizer", bpe, "--shard-tokens", "150", "--eval-fraction", "0.25", "--batch-mb", "0.0003"]
    reference = tmp_path / "reference"
    assert run_tokenize(parse(*inputs, "--out", reference, *opts)) == 0
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", KILLER, "tokenize", *inputs, "--out", str(out), "--no-progress", *opts]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    progress = json.loads((out / "progress.json").read_text())
    kept = [s["tokens_file"] for s in progress["splits"]["train"]["state"]["shards"]]
    assert kept == ["train-00000.tokens", "train-00001.tokens"]
    assert (out / "train-00002.tokens").exists() and not (out / "manifest.json").exists()
    stats = {n: os.stat(out / n) for n in kept}
    assert run_tokenize(parse(*inputs, "--out", out, *opts)) == 0
    for n, st in stats.items():
        assert (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert snapshot(out) == snapshot(reference)
    assert split_docs(*read_split(out)) + split_docs(*read_split(out, "eval")) != []
