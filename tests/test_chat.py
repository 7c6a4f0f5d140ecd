"""Chat data: `encode_chat` against transformers, masks by role, `jaxtrain tokenize --chat` and
the masked loss.

Oracles: transformers 5's ``apply_chat_template(..., return_assistant_tokens_mask=True)`` ids
and masks, saved by tests/assets/make_chat_assets.py (3 templates x 120 conversations, and a
tool-calling template x 60), exact;
hand-written masks for small cases; numpy's cross-entropy for the loss (rtol 1e-6, float32)."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.data import DataError, encode_chat, make_data_iterator, shards
from jaxtrain.data.chat import ChatEncoder, overlap_mask
from jaxtrain.data.tokenize import run_tokenize, tokenize
from tests.conftest import REPO
from tests.test_tokenize import parse
from tests.test_tokens_data import Cfg

ASSETS = Path(__file__).parent / "assets" / "chat"
TEMPLATES = ("chatml", "llama3", "gemma", "tools")


@pytest.fixture(scope="module")
def expected():
    with gzip.open(ASSETS / "expected.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


def mask_text(mask) -> str:
    return "".join(map(str, np.asarray(mask).tolist()))


@pytest.mark.parametrize("name", TEMPLATES)
def test_encode_chat_equals_transformers(expected, name):
    conversations = expected["tool_conversations" if name == "tools" else "conversations"]
    rows = expected["encoded"][name]
    assert len(conversations) == len(rows) == (60 if name == "tools" else 120)
    for messages, row in zip(conversations, rows):
        ids, mask = encode_chat(messages, ASSETS / name)
        assert ids.tolist() == row["ids"], messages
        assert mask_text(mask) == row["mask"], messages


def test_batch_equals_one_by_one_and_template_file_wins(expected, tmp_path):
    """encode_batch is encode per conversation; a chat_template.jinja beside the config is the
    template (transformers 5 saves it there and prefers it)."""
    conversations = expected["conversations"][:20]
    enc = ChatEncoder(ASSETS / "chatml")
    for (ids, mask), messages in zip(enc.encode_batch(conversations), conversations):
        one = enc.encode(messages)
        assert ids.tolist() == one[0].tolist() and mask.tolist() == one[1].tolist()
    d = tmp_path / "tok"
    shutil.copytree(ASSETS / "llama3", d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(config["chat_template"][0]["template"])
    config["chat_template"] = "{{ raise_exception('the config template is not used') }}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ids, mask = ChatEncoder(d).encode(conversations[0])
    row = expected["encoded"]["llama3"][0]
    assert ids.tolist() == row["ids"] and mask_text(mask) == row["mask"]


def test_overlap_mask_is_transformers_single_pass():
    # spans [2, 5) and [9, 9) (an empty block); tokens by character span
    offsets = [(0, 2), (1, 3), (3, 4), (4, 6), (5, 7), (8, 10), (9, 9), (10, 12)]
    assert overlap_mask(offsets, [(2, 5), (9, 9)]).tolist() == [0, 1, 1, 1, 0, 1, 0, 0]


def plain_chatml(tmp_path) -> Path:
    """The chatml directory with its generation markers taken out."""
    d = tmp_path / "plain"
    shutil.copytree(ASSETS / "chatml", d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    template = config["chat_template"].replace("{% generation %}", "").replace("{% endgeneration %}", "")
    config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_template_without_generation_is_refused_unless_mask_by_role(tmp_path):
    d = plain_chatml(tmp_path)
    with pytest.raises(
        DataError, match=r"tokenizer_config.json: chat_template.*no \{% generation %\}.*--mask-by-role"
    ):
        encode_chat([{"role": "user", "content": "hi"}], d)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the answer"},
        {"role": "user", "content": "the answer"},  # the same text in a user turn is not masked
        {"role": "assistant", "content": " 42 "},
    ]
    ids, mask = encode_chat(messages, d, mask_by_role=True)
    tok = ChatEncoder(ASSETS / "chatml").tokenizer
    pieces = [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("the answer", 1),
        ("<|im_end|>\n<|im_start|>user\nthe answer<|im_end|>\n<|im_start|>assistant\n", 0),
        (" 42 ", 1),
        ("<|im_end|>\n", 0),
    ]
    want_ids, want_mask = [], []
    for text, m in pieces:  # each piece tokenizes alone as in the whole (token boundaries at the seams)
        piece = tok.encode_batch([text])[0].tolist()
        want_ids += piece
        want_mask += [m] * len(piece)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    # with markers, by-role masking leaves out what generation adds: the <|im_end|> after the reply
    _, by_marker = encode_chat(messages, ASSETS / "chatml")
    _, by_role = encode_chat(messages, ASSETS / "chatml", mask_by_role=True)
    im_end = tok._tok.token_to_id("<|im_end|>")
    diff = np.flatnonzero(by_marker != by_role)
    assert diff.size == 2 and all(ids[i] == im_end for i in diff) and by_role[diff].sum() == 0


@pytest.mark.parametrize(
    "config, match",
    [
        ({"eos_token": "x"}, r"tokenizer_config.json: no 'chat_template' key"),
        ({"chat_template": 5}, r"chat_template=5; expected a Jinja template string or a list"),
        (
            {"chat_template": [{"name": "other", "template": "x"}]},
            r"names \['other'\]; expected one named 'default'",
        ),
        (
            {"chat_template": "{% generation %}", "bos_token": 3},
            r"bos_token=3; expected a string or an AddedToken",
        ),
        ({"chat_template": "{% generation %}{% for %}"}, r"not a valid Jinja template"),
    ],
)
def test_bad_tokenizer_config_is_named(tmp_path, config, match):
    shutil.copy(ASSETS / "chatml" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=match):
        ChatEncoder(tmp_path)


def test_template_errors_and_bad_messages_are_named():
    with pytest.raises(
        DataError, match=r"chatml/tokenizer_config.json: chat_template: rendering failed.*unknown role tool"
    ):
        encode_chat([{"role": "tool", "content": "x"}], ASSETS / "chatml")
    with pytest.raises(DataError, match=r"expected a non-empty list"):
        encode_chat([], ASSETS / "chatml")
    with pytest.raises(DataError, match=r"expected a dict with 'role' and 'content'"):
        encode_chat(["hi"], ASSETS / "chatml")


def test_data_package_import_stays_light():
    """`jaxtrain tokenize` must not pay for JAX; jinja2 loads only when a template compiles."""
    code = "import sys, json, jaxtrain.data; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert not {"jax", "flax", "jinja2"} & loaded


# --------------------------------------------------------------------------- tokenize --chat, tokens source


def write_rows(path, conversations):
    """{"messages": [...]} per line, with a blank line and an empty conversation (both skipped)."""
    lines = [json.dumps({"id": i, "messages": c}, ensure_ascii=False) for i, c in enumerate(conversations)]
    lines[1:1] = ["", json.dumps({"messages": []})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, expected):
    """20 chatml conversations tokenized with 64-token shards, and what encode_chat makes of them."""
    d = tmp_path_factory.mktemp("chat")
    conversations = expected["conversations"][:20]
    rows = write_rows(d / "rows.jsonl", conversations)
    out = d / "out"
    args = parse(rows, "--chat", "--tokenizer", ASSETS / "chatml", "--out", out, "--shard-tokens", 64)
    assert run_tokenize(args) == 0
    encoded = [encode_chat(c, ASSETS / "chatml") for c in conversations]
    return out, encoded, rows


def test_tokenize_chat_writes_conversations_and_masks(chat_dir):
    out, encoded, _ = chat_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == shards.MASK_VERSION and manifest["chat"]["mask"] == "generation"
    assert manifest["text_field"] == "messages"
    assert (out / "tokenizer_config.json").read_bytes() == (
        ASSETS / "chatml" / "tokenizer_config.json"
    ).read_bytes()
    info = manifest["splits"]["train"]
    assert info["documents"] == 20 and len(info["shards"]) > 3
    dtype = shards.TOKEN_DTYPES[manifest["dtype"]]
    tokens = np.concatenate([np.fromfile(out / s["tokens_file"], dtype=dtype) for s in info["shards"]])
    masks = np.concatenate([np.fromfile(out / s["mask_file"], dtype=np.uint8) for s in info["shards"]])
    ends = np.concatenate([np.fromfile(out / s["docs_file"], dtype="<u8") for s in info["shards"]])
    assert tokens.tolist() == np.concatenate([i for i, _ in encoded]).tolist()  # no EOS appended
    assert masks.tolist() == np.concatenate([m for _, m in encoded]).tolist()
    assert ends.tolist() == np.cumsum([i.size for i, _ in encoded]).tolist()
    shards.TokenShards(out).verify()


def expected_windows(encoded, seq_len):
    """Window w of the stream by the documented rule, and its batch fields, by hand."""
    stream = np.concatenate([i for i, _ in encoded])
    mask = np.concatenate([m for _, m in encoded])
    doc = np.repeat(np.arange(1, len(encoded) + 1), [i.size for i, _ in encoded])
    n = -(-(stream.size - 1) // seq_len)
    rows = []
    for w in range(n):
        lo, hi = w * seq_len, min(w * seq_len + seq_len + 1, stream.size)
        t, d, m = (np.zeros(seq_len + 1, np.int64) for _ in range(3))
        t[: hi - lo], d[: hi - lo], m[: hi - lo] = stream[lo:hi], doc[lo:hi], mask[lo:hi]
        real = d[:-1] > 0
        rows.append(
            {
                "inputs": t[:-1],
                "targets": t[1:],
                # conversations are consecutive numbers: the first one in the row is segment 1
                "segment_ids": np.where(real, d[:-1] - d[0] + 1, 0),
                "loss_mask": (real & (d[:-1] == d[1:]) & (m[1:] == 1)).astype(np.float32),
            }
        )
    return rows


def test_tokens_source_masks_the_loss_and_keeps_conversations_apart(chat_dir):
    out, encoded, _ = chat_dir
    seq_len = 48
    want = expected_windows(encoded, seq_len)
    it = make_data_iterator(
        Cfg(paths=(str(out),), shuffle=False, packing="windows"),
        vocab_size=512,
        seq_len=seq_len,
        global_batch_size=len(want),
        seed=0,
    )
    batch = it.batch_at(0)  # no shuffle: row w is window w; every window once
    for w, row in enumerate(want):
        for key, value in row.items():
            assert batch[key][w].tolist() == value.tolist(), (w, key)
    # the mask is the assistant's: some targets of real tokens are left out, none outside a turn
    assert 0 < batch["loss_mask"].sum() < (batch["segment_ids"] > 0).sum()
    # per-process rows and resume read the same masks
    shuffled = Cfg(paths=(str(out),), shuffle=True, packing="windows")
    one = make_data_iterator(shuffled, vocab_size=512, seq_len=seq_len, global_batch_size=4, seed=3)
    halves = [
        make_data_iterator(
            shuffled,
            vocab_size=512,
            seq_len=seq_len,
            global_batch_size=4,
            seed=3,
            process_index=p,
            process_count=2,
        ).batch_at(5)  # fmt: skip
        for p in range(2)
    ]
    whole = one.batch_at(5)
    for key in whole:
        assert np.array_equal(np.concatenate([h[key] for h in halves]), whole[key]), key
    one.set_state({"source": "tokens", "batch": 5})
    assert all(np.array_equal(v, whole[k]) for k, v in next(one).items())


# Conversations 5, 6, 7, 0, 14, 9, 4 of the assets, in that order: 93, 71, 89, 319, 87, 117 and 152
# tokens. With rows of W = seq_len + 1 = 256 tokens, greedy packing gives, by hand:
PACKED_ORDER = (5, 6, 7, 0, 14, 9, 4)
PACKED_SEQ_LEN = 255
PACKED_ROWS = (  # (conversations of the row, by their place in PACKED_ORDER; tokens used)
    ((0, 1, 2), 93 + 71 + 89),  # 253: the 319 after them does not fit; 3 tokens of padding
    ((3,), 256),  # 319 > 256: a row of its own, its first 256 tokens (63 cut)
    ((4, 5), 87 + 117),  # 204: the 152 after them does not fit; 52 of padding
    ((6,), 152),  # the last one; 104 of padding
)


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, expected):
    """PACKED_ORDER's conversations tokenized with 64-token shards, and their encodings."""
    d = tmp_path_factory.mktemp("packed")
    conversations = [expected["conversations"][i] for i in PACKED_ORDER]
    out = d / "out"
    rows = write_rows(d / "rows.jsonl", conversations)
    args = parse(rows, "--chat", "--tokenizer", ASSETS / "chatml", "--out", out, "--shard-tokens", 64)
    assert run_tokenize(args) == 0
    return out, [encode_chat(c, ASSETS / "chatml") for c in conversations]


def packed_row_by_hand(encoded, documents, width):
    """A row holding whole ``documents`` (the one of an over-long document: its head), as the
    batch fields: segment 1, 2, ... per conversation, positions from 0 in each, loss on a
    target of the same conversation whose mask is 1; zeros after the last one."""
    t, seg, pos, m = ([] for _ in range(4))
    for s, d in enumerate(documents, start=1):
        ids, mask = encoded[d]
        t += ids[:width].tolist()
        m += mask[:width].tolist()
        seg += [s] * min(ids.size, width)
        pos += list(range(min(ids.size, width)))
    pad = width - len(t)
    t, seg, pos, m = (np.array(x + [0] * pad) for x in (t, seg, pos, m))
    return {
        "inputs": t[:-1],
        "targets": t[1:],
        "segment_ids": seg[:-1],
        "positions": pos[:-1],
        "loss_mask": ((seg[:-1] > 0) & (seg[:-1] == seg[1:]) & (m[1:] == 1)).astype(np.float32),
    }


def test_chat_rows_are_whole_conversations_packed_greedily(packed_dir, caplog):
    """data.packing by_directory (the default) on a chat directory: rows of whole
    conversations, exactly as laid out by hand (greedy, padded, the over-long one cut to its
    head and counted in a warning)."""
    out, encoded = packed_dir
    assert [i.size for i, _ in encoded] == [93, 71, 89, 319, 87, 117, 152]
    width = PACKED_SEQ_LEN + 1
    want = [packed_row_by_hand(encoded, docs, width) for docs, _ in PACKED_ROWS]
    assert [int((w["segment_ids"] > 0).sum()) for w in want] == [min(n, width - 1) for _, n in PACKED_ROWS]

    def iterator(shuffle, batch=4, **kw):
        cfg = Cfg(paths=(str(out),), shuffle=shuffle)
        return make_data_iterator(
            cfg, vocab_size=512, seq_len=PACKED_SEQ_LEN, global_batch_size=batch, seed=7, **kw
        )

    with caplog.at_level("WARNING", logger="jaxtrain.data.tokens"):
        it = iterator(False)
    assert "1 of 7 documents are longer than train.seq_len + 1 = 256" in caplog.text
    assert "63 tokens not trained on" in caplog.text
    assert it.num_windows == [4] and it.packed[0].truncated == 1
    for k in (0, 1):  # no shuffle: row r of every epoch is packed row r
        batch = it.batch_at(k)
        for r, row in enumerate(want):
            for key, value in row.items():
                assert batch[key][r].tolist() == value.tolist(), (k, r, key)
    # shuffled: each epoch visits the same 4 rows in a seeded order; resume and processes as windows
    one = iterator(True)
    for k in range(3):
        got = one.batch_at(k)["inputs"].tolist()
        assert sorted(got) == sorted(w["inputs"].tolist() for w in want), k
    whole = one.batch_at(5)
    halves = [iterator(True, process_index=p, process_count=2).batch_at(5) for p in range(2)]
    for key in whole:
        assert np.array_equal(np.concatenate([h[key] for h in halves]), whole[key]), key
    one.set_state({"source": "tokens", "batch": 5})
    assert one.get_state() == {"source": "tokens", "batch": 5}
    assert all(np.array_equal(v, whole[k]) for k, v in next(one).items())
    # data.packing=windows keeps the stream's fixed windows on the same directory
    windows = make_data_iterator(
        Cfg(paths=(str(out),), shuffle=False, packing="windows"),
        vocab_size=512,
        seq_len=PACKED_SEQ_LEN,
        global_batch_size=1,
        seed=0,
    )
    assert windows.packed == [None] and windows.num_windows == [-(-(928 - 1) // PACKED_SEQ_LEN)]


def test_chat_mixed_with_plain_text_counts_every_plain_target(chat_dir, tmp_path):
    out, _, _ = chat_dir
    (tmp_path / "plain.jsonl").write_text(json.dumps({"text": "hello world " * 40}) + "\n")
    plain = tmp_path / "plain"
    tokenize(
        [str(tmp_path / "plain.jsonl")], str(plain), str(ASSETS / "chatml" / "tokenizer.json"), log=print
    )
    it = make_data_iterator(
        Cfg(paths=(str(plain), str(out)), weights=(1, 1), shuffle=False),
        vocab_size=512,
        seq_len=16,
        global_batch_size=2,
        seed=0,
    )
    batch = it.batch_at(0)
    sources = [it.window(s) for s in range(2)]
    assert sorted(c for c, _ in sources) == [0, 1] and all(w == 0 for _, w in sources)
    plain_row = [c for c, _ in sources].index(0)
    assert batch["loss_mask"][plain_row].sum() == 16  # plain window 0: every target counts
    assert batch["loss_mask"][1 - plain_row].sum() < 16  # chat window 0 opens with a system turn


def test_tokenize_chat_resumes_after_a_crash_byte_identical(chat_dir, tmp_path, monkeypatch, capsys):
    _, _, rows = chat_dir
    opts = ["--chat", "--tokenizer", ASSETS / "chatml", "--shard-tokens", 64, "--batch-mb", 0.0005]
    opts += ["--eval-fraction", 0.3]
    reference = tmp_path / "reference"
    assert run_tokenize(parse(rows, "--out", reference, *opts)) == 0
    write, written = shards.SplitWriter._write_shard, []

    def write_then_die(self, tokens, mask=None):  # dies after the 8th train shard, mid-batch
        write(self, tokens, mask)
        written.append(self.split)
        if written.count("train") == 8:
            raise KeyboardInterrupt

    monkeypatch.setattr(shards.SplitWriter, "_write_shard", write_then_die)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_tokenize(parse(rows, "--out", out, *opts))
    capsys.readouterr()
    progress = json.loads((out / "progress.json").read_text())
    assert 0 < len(progress["splits"]["train"]["state"]["shards"]) < 8
    assert progress["splits"]["train"]["tail"]["mask_file"].endswith(".mask")
    monkeypatch.setattr(shards.SplitWriter, "_write_shard", write)
    assert run_tokenize(parse(rows, "--out", out, *opts)) == 0
    assert "resuming at input 1/1 after" in capsys.readouterr().out
    snapshot = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    assert snapshot(out) == snapshot(reference)
    assert json.loads((out / "manifest.json").read_text())["splits"]["eval"]["documents"] > 0


def test_tokenize_chat_errors_name_the_row(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "tool", "content": "b"}]})
        + "\n"
    )
    args = ["--chat", "--tokenizer", ASSETS / "chatml", "--out", tmp_path / "out"]
    assert run_tokenize(parse(rows, *args)) == 2
    assert f"{rows}:2: " in capsys.readouterr().err
    rows.write_text(json.dumps({"messages": "hi"}) + "\n")
    assert run_tokenize(parse(rows, *args, "--force")) == 2
    assert f"{rows}:1: expected an object with a 'messages' field holding a list" in capsys.readouterr().err
    args = ["--chat", "--tokenizer", ASSETS / "chatml" / "tokenizer.json", "--out", tmp_path / "o2"]
    assert run_tokenize(parse(rows, *args)) == 2
    assert "--chat expects a Hugging Face tokenizer directory" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("x")
    assert (
        run_tokenize(
            parse(tmp_path / "a.txt", "--chat", "--tokenizer", ASSETS / "chatml", "--out", tmp_path / "o3")
        )
        == 2
    )
    assert "--chat reads .jsonl files" in capsys.readouterr().err


# --------------------------------------------------------------------------- the loss


@pytest.mark.composes("chat+dense")
def test_step_loss_is_the_mean_over_masked_in_targets(chat_dir):
    """One train program (data=2 mesh, 2 microbatches) on a chat batch: its loss equals numpy's
    cross-entropy of the model's own logits, averaged over the targets whose mask is 1 (rtol 1e-5,
    float32), and differs from the mean over all targets of the same documents."""
    import jax

    from jaxtrain import models
    from jaxtrain.trainer.batches import batch_to_device
    from tests.conftest import program_on_mesh, tiny_config

    out, _, _ = chat_dir
    cfg = tiny_config(
        None,
        "model.d_model=32",
        "model.mlp_dim=64",
        "model.n_layers=1",
        "model.vocab_size=320",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "train.microbatches=2",
        "mesh.data=2",
        "data.source=tokens",
        f"data.paths=[{out}]",
        "data.packing=windows",  # conversations of 71+ tokens: whole ones would be cut to their system turn
    )
    with program_on_mesh(cfg) as (program, state, data):
        rows = next(data)
        loss, count, _ = program.loss_and_grads(state.params, batch_to_device(rows, program.batch_sharding))
        model = models.merge(program.graphdef, program.abstract_params, state.params)
        logits = model(
            jax.numpy.asarray(rows["inputs"]), positions=rows["positions"], segment_ids=rows["segment_ids"]
        )
    logits = np.asarray(jax.device_get(logits), np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    ce = -np.take_along_axis(log_probs, rows["targets"][..., None], -1)[..., 0]
    mask = rows["loss_mask"]
    assert float(count) == mask.sum() > 0
    np.testing.assert_allclose(float(loss), (ce * mask).sum() / mask.sum(), rtol=1e-5)
    real = rows["segment_ids"] > 0
    assert mask.sum() < real.sum() and abs(float(loss) - (ce * real).sum() / real.sum()) > 1e-4


def test_masks_read_by_range_equal_memory_mapped(chat_dir, monkeypatch):
    """Remote directories (gs://) read shards by range instead of memory maps: same rows, same masks."""
    out, _, _ = chat_dir
    n = shards.TokenShards(out).num_tokens
    starts, length = np.array([0, 50, 63, 300, n - 10]), 40  # inside a shard, across shards, past the end
    mapped = shards.TokenShards(out).read_rows(starts, length)
    monkeypatch.setattr(shards.storage, "is_local", lambda _: False)
    ranged = shards.TokenShards(out)
    assert not ranged.local
    for a, b in zip(ranged.read_rows(starts, length), mapped):
        assert np.array_equal(a, b)
    assert mapped[2].any() and not mapped[2][-1, 10:].any()  # masks read; padding masked out
