"""Chat data: `encode_chat` against transformers, masks by role, `jaxtrain tokenize --chat` and
the masked loss.

Oracles: transformers 5's ``apply_chat_template(..., return_assistant_tokens_mask=True)`` ids
and masks, saved by tests/assets/make_chat_assets.py (3 templates x 120 conversations), exact;
hand-written masks for small cases; numpy's cross-entropy for the loss (rtol 1e-6, float32)."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.data import DataError, encode_chat
from jaxtrain.data.chat import ChatEncoder, overlap_mask
from tests.conftest import REPO

ASSETS = Path(__file__).parent / "assets" / "chat"
TEMPLATES = ("chatml", "llama3", "gemma")


@pytest.fixture(scope="module")
def expected():
    with gzip.open(ASSETS / "expected.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


def mask_text(mask) -> str:
    return "".join(map(str, np.asarray(mask).tolist()))


@pytest.mark.parametrize("name", TEMPLATES)
def test_encode_chat_equals_transformers(expected, name):
    conversations, rows = expected["conversations"], expected["encoded"][name]
    assert len(conversations) == len(rows) == 120
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
