"""Data pipeline tests. Oracles are hand-written expectations or plain-Python re-derivations;
all comparisons are exact (integers), so no tolerance is needed."""

import json
from dataclasses import dataclass

import numpy as np
import pytest

from jaxtrain.data import BYTE_EOS_ID, DataError, make_data_iterator

EOS = BYTE_EOS_ID
KEYS = {
    "inputs": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
}


@dataclass(frozen=True, kw_only=True)
class Cfg:  # stands in for jaxtrain.config.DataConfig
    source: str = "synthetic"
    paths: tuple = ()
    tokenizer: str = "byte"
    shuffle: bool = True


def draw(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() == KEYS.keys()
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def synth(seed=0, **kw):
    args = dict(vocab_size=97, seq_len=16, global_batch_size=4, seed=seed)
    args.update(kw)
    return make_data_iterator(Cfg(), **args)


def text_iter(paths, seq_len=4, batch=2, seed=0, shuffle=True, vocab_size=300, **kw):
    cfg = Cfg(
        source="text",
        paths=tuple(str(p) for p in paths),
        shuffle=shuffle,
        tokenizer=kw.pop("tokenizer", "byte"),
    )
    return make_data_iterator(
        cfg, vocab_size=vocab_size, seq_len=seq_len, global_batch_size=batch, seed=seed, **kw
    )


# ------------------------------------------------------------------ synthetic


def test_synthetic_shapes_dtypes_and_progression():
    b = next(synth())
    for k, dtype in KEYS.items():
        assert b[k].shape == (4, 16) and b[k].dtype == dtype, k
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    # Oracle: each row is an arithmetic progression mod 97 with stride in 1..8.
    full = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
    for row in full:
        stride = (row[1] - row[0]) % 97
        assert 1 <= stride <= 8
        assert [(row[0] + stride * t) % 97 for t in range(17)] == row.tolist()
    assert (b["segment_ids"] == 1).all() and (b["loss_mask"] == 1).all()
    assert (b["positions"] == np.arange(16)).all()


def test_synthetic_determinism_seeds_and_state_round_trip():
    assert_batches_equal(draw(synth(seed=3), 3), draw(synth(seed=3), 3))
    assert not np.array_equal(next(synth(seed=3))["inputs"], next(synth(seed=4))["inputs"])
    it = synth(seed=3)
    draw(it, 3)
    state = it.get_state()
    assert json.loads(json.dumps(state)) == state
    expected = draw(it, 2)
    fresh = synth(seed=3)
    fresh.set_state(state)
    assert_batches_equal(draw(fresh, 2), expected)


def test_synthetic_process_split_matches_single_process():
    whole = draw(synth(global_batch_size=6), 2)
    parts = [draw(synth(global_batch_size=6, process_index=p, process_count=2), 2) for p in range(2)]
    assert parts[0][0]["inputs"].shape == (3, 16)
    for k in range(2):
        for key in KEYS:
            np.testing.assert_array_equal(np.concatenate([parts[0][k][key], parts[1][k][key]]), whole[k][key])


def test_argument_and_state_validation():
    with pytest.raises(DataError, match="process_count"):
        synth(global_batch_size=5, process_count=2)
    with pytest.raises(DataError, match="data.source"):
        make_data_iterator(Cfg(source="parquet"), vocab_size=97, seq_len=4, global_batch_size=2, seed=0)
    it = synth()
    for bad in ({"batch": -1}, {"step": 3}, {"source": "text", "batch": 1}, {"batch": "2"}):
        with pytest.raises(DataError):
            it.set_state(bad)


# ------------------------------------------------------------------ text


def test_text_byte_ids_and_eos_between_documents(tmp_path):
    texts = ["héllo wörld\r\n", "second doc"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t, encoding="utf-8")
    it = text_iter([tmp_path / "*.txt"], seq_len=8, batch=1, shuffle=False)
    expected = list(texts[0].encode()) + [EOS] + list(texts[1].encode()) + [EOS]
    assert it.num_documents == 2 and it.num_tokens == len(expected)
    # Reassemble the stream from the unshuffled windows: inputs plus the final target.
    rows = [next(it) for _ in range(it.num_windows)]
    stream = [t for b in rows for t in b["inputs"][0].tolist()] + [rows[-1]["targets"][0, -1]]
    assert stream[: len(expected)] == expected
    assert all(t == 0 for t in stream[len(expected) :])


def test_text_packing_hand_checked(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.txt").write_text("cde")
    it = text_iter([tmp_path / "a.txt", tmp_path / "b.txt"], seq_len=4, batch=2, shuffle=False)
    # stream: a b EOS c d e EOS (7 tokens) -> windows [a b EOS c d], [d e EOS pad pad]
    assert it.num_windows == 2
    b = next(it)
    a_, b_, c_, d_, e_ = (ord(ch) for ch in "abcde")
    assert b["inputs"].tolist() == [[a_, b_, EOS, c_], [d_, e_, EOS, 0]]
    assert b["targets"].tolist() == [[b_, EOS, c_, d_], [e_, EOS, 0, 0]]
    assert b["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 1, 0]]
    assert b["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 0, 0]]
    # jsonl: one document per line's "text"; too-short stream still yields one padded window.
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n\n{"text": "yz", "id": 2}\n')
    it = text_iter([tmp_path / "d.jsonl"], seq_len=8, batch=1)
    b = next(it)
    x, y, z = (ord(ch) for ch in "xyz")
    assert it.num_windows == 1
    assert b["inputs"].tolist() == [[x, EOS, y, z, EOS, 0, 0, 0]]
    assert b["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 0, 0, 0]]
    assert b["positions"].tolist() == [[0, 1, 0, 1, 2, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 0, 0, 0]]


def test_text_shuffle_covers_each_window_once_per_epoch_and_resumes(tmp_path):
    # Every window's first token is unique (bytes 1..n with stride seq_len), so a window
    # is identified by (inputs[:, 0] - 1) // seq_len.
    seq_len, n_windows = 4, 10
    # bytes 1..40 (NUL would mark the file as binary), plus EOS: 41 tokens -> exactly 10 windows
    data = bytes(range(1, n_windows * seq_len + 1))
    (tmp_path / "d.bin.txt").write_bytes(data)
    it = text_iter([tmp_path / "d.bin.txt"], seq_len=seq_len, batch=4, seed=7)
    assert it.num_windows == n_windows
    batches = draw(it, 5)  # 20 slots = exactly two epochs; batch 2 straddles them
    ids = np.concatenate([(b["inputs"][:, 0] - 1) // seq_len for b in batches]).tolist()
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:]) == list(range(10))
    assert ids[:10] != list(range(10)) and ids[:10] != ids[10:]  # shuffled, per-epoch
    assert ids[:10] == np.random.default_rng([7, 0]).permutation(10).tolist()
    # Resume mid-run, and across process counts.
    resumed = text_iter([tmp_path / "d.bin.txt"], seq_len=seq_len, batch=4, seed=7)
    resumed.set_state({"source": "text", "batch": 2})
    assert_batches_equal(draw(resumed, 3), batches[2:])
    half = text_iter(
        [tmp_path / "d.bin.txt"], seq_len=seq_len, batch=4, seed=7, process_index=1, process_count=2
    )
    half.set_state({"batch": 2})
    np.testing.assert_array_equal(next(half)["inputs"], batches[2]["inputs"][2:])


def make_wordlevel_tokenizer(path, vocab):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return str(path)


def test_text_hf_tokenizer_and_errors(tmp_path):
    tok = make_wordlevel_tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "big": 10})
    (tmp_path / "t.txt").write_text("a b a")
    b = next(text_iter([tmp_path / "t.txt"], seq_len=4, batch=1, tokenizer=tok, vocab_size=16))
    assert b["inputs"].tolist() == [[1, 2, 1, 3]]
    (tmp_path / "big.txt").write_text("a big")
    with pytest.raises(DataError, match=r"token id 10.*vocab_size=8"):
        text_iter([tmp_path / "big.txt"], tokenizer=tok, vocab_size=8)
    no_eos = make_wordlevel_tokenizer(tmp_path / "noeos.json", {"[UNK]": 0, "a": 1})
    with pytest.raises(DataError, match="end-of-text"):
        text_iter([tmp_path / "t.txt"], tokenizer=no_eos, vocab_size=8)

    with pytest.raises(DataError, match="missing.txt"):
        text_iter([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match=r"nothing\*\.md"):
        text_iter([tmp_path / "nothing*.md"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt"):
        text_iter([tmp_path / "empty.txt"])
    with pytest.raises(DataError, match=r"model\.vocab_size=256"):
        text_iter([tmp_path / "t.txt"], vocab_size=256)
    (tmp_path / "bad.jsonl").write_text('{"txt": "a"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        text_iter([tmp_path / "bad.jsonl"])
