"""Tokenizers: UTF-8 bytes, or a Hugging Face ``tokenizers`` JSON file (local or remote).

Each has ``name``, ``eos_id``, ``vocab_size`` (ids are ``< vocab_size``), ``sha256``
(a fingerprint of what maps text to ids: the JSON file's bytes) and
``encode_batch(texts) -> list of id arrays``; special tokens (BOS etc.) are never added.
"""

from __future__ import annotations

import hashlib
import itertools
import re

import numpy as np

from . import storage
from .core import DataError

BYTE_EOS_ID = 256
EOS_TOKEN_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
# What "byte" means, hashed as its fingerprint: change it and token dirs no longer match.
_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_SPEC = b"jaxtrain byte tokenizer v1: UTF-8 bytes are ids 0..255, EOS is 256"


def _scrubbed(texts: list[str]) -> list[str]:
    """Lone surrogates (JSON allows ``"\\ud83d"``; UTF-8 cannot hold them) -> U+FFFD, as for
    invalid UTF-8 bytes when reading."""
    return [_SURROGATE.sub("\ufffd", t) for t in texts]


def _utf8(texts: list[str]) -> list[bytes]:
    try:
        return [t.encode("utf-8") for t in texts]
    except UnicodeEncodeError:
        return [t.encode("utf-8") for t in _scrubbed(texts)]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; EOS = 256."""

    name = "byte"
    eos_id = BYTE_EOS_ID
    vocab_size = BYTE_EOS_ID + 1
    sha256 = hashlib.sha256(_BYTE_SPEC).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype=np.uint8).astype(np.int32) for b in _utf8(texts)]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All documents' ids concatenated (unsigned ints), and each document's length."""
        raw = _utf8(texts)
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        return np.frombuffer(b"".join(raw), dtype=np.uint8), lengths


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file; special tokens (BOS etc.) are not added."""

    def __init__(self, path: str, *, data: bytes | None = None):
        try:
            import tokenizers
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise DataError(
                f"tokenizer={path!r} needs the `tokenizers` package; install it or use 'byte'"
            ) from e
        if data is None:
            if not storage.is_file(path):
                raise DataError(
                    f"data.tokenizer={path!r}: no such file; expected 'byte' or a tokenizers JSON file"
                )
            data = storage.read_bytes(path)
        try:
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust side raises a bare Exception
            raise DataError(f"data.tokenizer={path!r}: not a tokenizers JSON file ({e})") from e
        self.name = path
        self.json_bytes = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        for token in EOS_TOKEN_CANDIDATES:
            eos = self._tok.token_to_id(token)
            if eos is not None:
                self.eos_id = int(eos)
                break
        else:
            raise DataError(
                f"data.tokenizer={path!r} has no end-of-text token; expected one of "
                f"{list(EOS_TOKEN_CANDIDATES)}"
            )

    def token_id(self, token: str) -> int | None:
        """The id of `token` (a vocabulary or added token), or None when it has none."""
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def _encode(self, texts: list[str], *, offsets: bool = False):
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets that only chat
        # masks use; both run over all cores (Rust threads, outside the GIL).
        encode = (
            self._tok.encode_batch
            if offsets
            else getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        )
        try:
            return encode(texts, add_special_tokens=False)
        except TypeError:  # what the Rust side raises for a str UTF-8 cannot hold
            return encode(_scrubbed(texts), add_special_tokens=False)

    def encode_with_offsets(self, texts: list[str]) -> list:
        """`tokenizers` Encodings: ``.ids`` and ``.offsets``, each token's ``(start, end)`` in
        characters of its text (a lone surrogate, scrubbed to U+FFFD, keeps its one character)."""
        return self._encode(texts, offsets=True)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._encode(texts)]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All documents' ids concatenated (unsigned ints), and each document's length."""
        encodings = self._encode(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        flat = itertools.chain.from_iterable(e.ids for e in encodings)
        return np.fromiter(flat, dtype=np.uint32, count=int(lengths.sum())), lengths


def tokenizer_from_spec(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a path (local or remote) to a tokenizers JSON file."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def load_tokenizer(spec: str, *, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a path to a tokenizers JSON file; checks the EOS id fits the model."""
    if spec == "byte":
        if vocab_size < BYTE_EOS_ID + 1:
            raise DataError(
                f"model.vocab_size={vocab_size} is too small for data.tokenizer='byte'; "
                f"expected >= {BYTE_EOS_ID + 1} (256 bytes + EOS)"
            )
        return ByteTokenizer()
    tok = HFTokenizer(spec)
    if tok.eos_id >= vocab_size:
        raise DataError(f"data.tokenizer={spec!r}: EOS id {tok.eos_id} >= model.vocab_size={vocab_size}")
    return tok
