"""`data.source: tokens`: windows over token directories, Feistel shuffle, mixtures,
per-process rows, exact resume (the iterator's and a training run's).

Oracles: the tokenizer's own output per document (tests/corpora.py), laid out by the
documented window and permutation rules re-implemented here in plain Python; the `text`
source on the same files; a one-process global batch; an uninterrupted training run's
metrics (bit for bit on CPU). Mixture counts: the bound stated in `Mixture`."""

import json
import math
import shutil
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import DataError, TextIterator, make_data_iterator
from jaxtrain.data.packing import pack_documents
from jaxtrain.data.tokenize import tokenize
from tests.conftest import REPO, tiny_config
from tests.corpora import documents, encode_reference, train_bpe, write_jsonl

M64 = (1 << 64) - 1


@dataclass(frozen=True, kw_only=True)
class Cfg:  # stands in for jaxtrain.config.DataConfig
    source: str = "tokens"
    paths: tuple = ()
    tokenizer: str = "byte"
    shuffle: bool = True
    weights: tuple = ()
    packing: str = "by_directory"


def token_dir(tmp_path, name, docs, tokenizer="byte", shard_tokens=64, **kw):
    src = write_jsonl(tmp_path / f"{name}.jsonl", docs, blank_lines=False)
    out = tmp_path / name
    tokenize([src], str(out), tokenizer, shard_tokens=shard_tokens, log=lambda _: None, **kw)
    return str(out)


def tokens_iter(
    paths,
    *,
    seq_len=16,
    batch=4,
    seed=0,
    shuffle=True,
    weights=(),
    vocab_size=512,
    packing="by_directory",
    **kw,
):
    cfg = Cfg(paths=tuple(paths), shuffle=shuffle, weights=tuple(weights), packing=packing)
    return make_data_iterator(
        cfg, vocab_size=vocab_size, seq_len=seq_len, global_batch_size=batch, seed=seed, **kw
    )


def draw(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def oracle_permutation(q, n, seed, component, epoch):
    """tokens.feistel_permutation as documented, in plain Python integers."""
    keys = [int(k) for k in np.random.SeedSequence([seed, component, epoch]).generate_state(4, np.uint64)]
    half = max(1, math.ceil((n - 1).bit_length() / 2))
    mask = (1 << half) - 1

    def f(r, key):
        z = r ^ key
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return (z ^ (z >> 31)) & mask

    def encrypt(x):
        l, r = x >> half, x & mask
        for key in keys:
            l, r = r, l ^ f(r, key)
        return (l << half) | r

    y = encrypt(q)
    while y >= n:
        y = encrypt(y)
    return y


def oracle_row(stream, doc_of, w, L):
    """Window w of the stream, and its batch fields, from the definitions."""
    tok = stream[w * L : w * L + L + 1]
    doc = doc_of[w * L : w * L + L + 1]
    tok = tok + [0] * (L + 1 - len(tok))
    doc = doc + [None] * (L + 1 - len(doc))
    seg, pos = [], []
    for t in range(L):
        if doc[t] is None:
            seg.append(0), pos.append(0)
            continue
        first = t == 0 or doc[t - 1] != doc[t]
        seg.append((seg[-1] if t else 0) + 1 if first else seg[-1])
        pos.append(0 if first else pos[-1] + 1)
    mask = [float(doc[t] is not None and doc[t] == doc[t + 1]) for t in range(L)]
    return {"inputs": tok[:-1], "targets": tok[1:], "segment_ids": seg, "positions": pos, "loss_mask": mask}


def test_round_trip_in_the_documented_permutation(tmp_path):
    docs = documents(30, seed=4)
    bpe = train_bpe(tmp_path / "bpe.json", docs)
    d = token_dir(tmp_path, "c", docs, tokenizer=bpe, shard_tokens=50)  # windows cross shards
    encoded = encode_reference(bpe, docs)
    stream = [t for ids in encoded for t in ids]
    doc_of = [i for i, ids in enumerate(encoded) for _ in ids]
    L, B, seed = 16, 4, 5
    it = tokens_iter([d], seq_len=L, batch=B, seed=seed)
    n = it.num_windows[0]
    assert n == math.ceil((len(stream) - 1) / L)
    batches = draw(it, math.ceil(2 * n / B) + 1)  # two epochs and a bit
    windows = []
    for k, batch in enumerate(batches):
        for r in range(B):
            epoch, q = divmod(k * B + r, n)
            w = oracle_permutation(q, n, seed, 0, epoch)
            windows.append(w)
            for key, want in oracle_row(stream, doc_of, w, L).items():
                assert batch[key][r].tolist() == want, (k, r, key)
    assert sorted(windows[:n]) == list(range(n)) == sorted(windows[n : 2 * n])
    assert windows[:n] != list(range(n)) and windows[:n] != windows[n : 2 * n]


def test_same_batches_as_the_text_source_without_shuffle(tmp_path):
    docs = documents(12, seed=6)
    files = []
    for i, doc in enumerate(docs):
        (tmp_path / f"{i:02d}.txt").write_bytes(doc.encode())
        files.append(str(tmp_path / f"{i:02d}.txt"))
    out = tmp_path / "tok"
    tokenize(files, str(out), "byte", shard_tokens=100, log=lambda _: None)
    text = TextIterator(
        Cfg(source="text", paths=tuple(files), shuffle=False),
        vocab_size=300,
        seq_len=24,
        global_batch_size=3,
        seed=0,
    )
    toks = tokens_iter([out], seq_len=24, batch=3, shuffle=False, vocab_size=300)
    assert toks.num_windows[0] == text.num_windows
    assert_same(draw(toks, text.num_windows), draw(text, text.num_windows))


@pytest.fixture(scope="module")
def three_dirs(tmp_path_factory):
    """Three byte-token corpora told apart by alphabet: rows start with a, b or c."""
    tmp = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    dirs = []
    for ch, n_docs in (("a", 30), ("b", 20), ("c", 10)):
        docs = [ch * int(rng.integers(3, 30)) for _ in range(n_docs)]
        dirs.append(token_dir(tmp, ch, docs, shard_tokens=40))
    return dirs


def component_of_rows(batch):
    return [int(row[row < 256][0]) - ord("a") for row in batch["inputs"]]  # skip EOS (256)


def test_mixture_weights_within_the_stated_bound_and_epochs_per_component(three_dirs):
    weights = (5, 3, 2)
    it = tokens_iter(three_dirs, seq_len=8, batch=8, weights=weights)
    w = np.array(weights) / sum(weights)
    seen = np.zeros(3)
    visits = {0: [], 1: [], 2: []}
    for k in range(100):
        for slot, c in enumerate(component_of_rows(next(it))):
            seen[c] += 1
            n = k * 8 + slot + 1
            # Mixture's bound: component c's count is within c + 1 of n * w_c, every prefix.
            assert np.all(np.abs(seen - n * w) <= np.arange(3) + 1 + 1e-6), (n, seen)
            visits[c].append(it.window(k * 8 + slot)[1])
    for c in range(3):  # each component walks its own epochs: every window once per epoch
        n_c = it.num_windows[c]
        epochs = len(visits[c]) // n_c
        assert epochs >= 1
        for e in range(epochs):
            assert sorted(visits[c][e * n_c : (e + 1) * n_c]) == list(range(n_c))
    # Without weights, each directory weighs its token count.
    it = tokens_iter(three_dirs, seq_len=8, batch=8)
    counts = np.bincount(np.concatenate([component_of_rows(next(it)) for _ in range(50)]), minlength=3)
    sizes = np.array([c.num_tokens for c in it.components])
    np.testing.assert_allclose(counts / 400, sizes / sizes.sum(), atol=3 / 400)


def test_processes_read_disjoint_rows_whose_union_is_the_global_batch(three_dirs):
    whole = draw(tokens_iter(three_dirs, batch=8, weights=(1, 1, 2)), 6)
    for P in (2, 4):
        its = [
            tokens_iter(three_dirs, batch=8, weights=(1, 1, 2), process_index=p, process_count=P)
            for p in range(P)
        ]
        for k in range(6):  # each process's slots: disjoint, together the global batch's
            slots = [set(it.local_slots(k).tolist()) for it in its]
            assert sum(map(len, slots)) == 8 and set.union(*slots) == set(range(8 * k, 8 * k + 8))
        parts = [draw(it, 6) for it in its]
        assert all(next(iter(b.values())).shape[0] == 8 // P for part in parts for b in part)
        for k in range(6):
            for key in whole[k]:
                np.testing.assert_array_equal(np.concatenate([part[k][key] for part in parts]), whole[k][key])


def test_state_is_the_batch_index_and_resume_is_exact(three_dirs):
    it = tokens_iter(three_dirs, weights=(2, 1, 1), seed=3)
    draw(it, 7)
    state = it.get_state()
    assert state == {"source": "tokens", "batch": 7} and json.loads(json.dumps(state)) == state
    expected = draw(it, 5)
    fresh = tokens_iter(three_dirs, weights=(2, 1, 1), seed=3)
    fresh.set_state(state)
    assert_same(draw(fresh, 5), expected)
    # Ranged reads (the path remote shards take) give the same batches as memory maps.
    ranged = tokens_iter(three_dirs, weights=(2, 1, 1), seed=3)
    for comp in ranged.components:
        comp.local = False
    ranged.set_state(state)
    assert_same(draw(ranged, 5), expected)


def test_errors_name_the_directory_and_key(tmp_path, three_dirs):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty.*manifest\.json"):
        tokens_iter([tmp_path / "empty"])
    with pytest.raises(DataError, match="model.vocab_size=200"):
        tokens_iter(three_dirs[:1], vocab_size=200)
    with pytest.raises(DataError, match="data.weights has 2 entries for 3"):
        tokens_iter(three_dirs, weights=(1, 2))
    bpe = train_bpe(tmp_path / "bpe.json", ["some text here"] * 5)
    other = token_dir(tmp_path, "other", ["some text"], tokenizer=bpe)
    with pytest.raises(DataError, match="expected one tokenizer"):
        tokens_iter([three_dirs[0], other])
    with pytest.raises(DataError, match="data.packing='rows'"):
        tokens_iter(three_dirs[:1], packing="rows")
    for overrides, key in (
        (["data.source=tokens"], "data.paths"),
        (["data.source=tokens", "data.paths=[a, b]", "data.weights=[1]"], "data.weights"),
        (["data.source=tokens", "data.paths=[a]", "data.weights=[-1]"], r"data.weights\[0\]"),
        (["data.source=text", "data.paths=[a]", "data.weights=[1]"], "data.weights"),
        (["data.source=tokens", "data.paths=[a]", "data.packing=rows"], "data.packing='rows'"),
        (["data.source=text", "data.paths=[a]", "data.packing=documents"], "data.packing=documents"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(f"{REPO}/configs/tiny.yaml", overrides)


def by_step(metrics):
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in metrics if "loss" in r}


def test_training_resumes_mid_epoch_on_a_token_mixture_with_identical_losses(tmp_path, three_dirs):
    from jaxtrain.trainer import train

    paths = "[" + ", ".join(three_dirs) + "]"
    cfg = tiny_config(
        tmp_path,
        "model.d_model=64",
        "model.mlp_dim=128",
        "train.seq_len=16",
        "train.steps=8",
        "optimizer.decay_steps=20",
        "data.source=tokens",
        f"data.paths={paths}",
        "data.weights=[3, 2, 1]",
        "checkpoint.every=2",
        "checkpoint.keep=10",
        "model.n_layers=1",
    )
    it = make_data_iterator(cfg.data, vocab_size=512, seq_len=16, global_batch_size=8, seed=0)
    visits = np.bincount([it.mixture.assign(s)[0] for s in range(4 * 8)], minlength=3)
    assert np.all((0 < visits) & (visits < it.num_windows)), visits  # step 4: mid-epoch everywhere
    first = train(cfg, devices=jax.devices()[:1])
    for step in ("6", "8"):  # as if killed after the checkpoint of step 4
        shutil.rmtree(tmp_path / "checkpoints" / step)
    second = train(cfg, devices=jax.devices()[:1])
    assert second.start_step == 4
    want, got = by_step(first.metrics), by_step(second.metrics)
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[s] == want[s] for s in got), (got, want)  # bit for bit


def test_pack_documents_greedy_rows_by_hand():
    """Documents of 5, 5, 3, 17 and 2 tokens in rows of 8: [5] (the next 5 does not fit), [5, 3]
    (exactly full), the 17's first 8 alone (9 cut), [2]; every row one contiguous range."""
    rows = pack_documents(np.array([5, 10, 13, 30, 32]), 8)
    assert rows.starts.tolist() == [0, 5, 13, 30] and rows.lengths.tolist() == [5, 8, 8, 2]
    assert (rows.documents, rows.truncated, rows.dropped_tokens) == (5, 1, 9)
