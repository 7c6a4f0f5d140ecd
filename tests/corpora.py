"""Small corpora and tokenizers made on the fly for the tokenize / tokens-source tests."""

import gzip
import json
import random

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "δέλτα",
    "épsilon",
    "zeta",
    "η",
    "naïve",
    "日本語",
    "🙂",
    "tab\tx",
    "a\nb",
    "c\r\nd",
]


def documents(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def write_jsonl(path, docs, field="text", blank_lines=True):
    """One JSON object per line (non-ASCII kept as UTF-8), a blank line and an empty
    document in between (both skipped by readers); .gz / .zst compress it."""
    lines = []
    for i, d in enumerate(docs):
        lines.append(json.dumps({"id": i, field: d}, ensure_ascii=False))
        if blank_lines and i == 1:
            lines += ["", json.dumps({field: ""})]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    name = str(path)
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def write_parquet(path, docs, field="text", row_group_size=7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def train_bpe(path, texts, vocab_size: int = 320) -> str:
    """A byte-level BPE with EOS '</s>', trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return str(path)


def word_level(path, vocab: dict) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return str(path)


def encode_reference(tokenizer: str, docs: list[str]) -> list[list[int]]:
    """The oracle: each document encoded alone (no batching, no special tokens), plus EOS."""
    if tokenizer == "byte":
        return [list(d.encode("utf-8")) + [256] for d in docs]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("</s>")
    return [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]


def chatml_token_dirs(tmp) -> dict:
    """{"chat": ..., "dpo": ...}: token directories `jaxtrain tokenize` writes (chatml, ids < 320)
    from the chat test asset's first 12 conversations and tests/assets/dpo/pairs.jsonl."""
    import os

    from jaxtrain.data.tokenize import run_tokenize
    from tests.test_tokenize import parse

    assets = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
    chatml = os.path.join(assets, "chat", "chatml")
    with gzip.open(os.path.join(assets, "chat", "expected.json.gz"), "rt", encoding="utf-8") as f:
        conversations = json.load(f)["conversations"][:12]
    rows = tmp / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    assert (
        run_tokenize(parse(rows, "--chat", "--tokenizer", chatml, "--out", tmp / "chat", "--no-progress"))
        == 0
    )
    pairs = os.path.join(assets, "dpo", "pairs.jsonl")
    args = parse(pairs, "--preference", "--tokenizer", chatml, "--out", tmp / "pairs", "--no-progress")
    assert run_tokenize(args) == 0
    return {"chat": str(tmp / "chat"), "dpo": str(tmp / "pairs")}
