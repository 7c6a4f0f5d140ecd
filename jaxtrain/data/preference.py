"""Preference pairs -> two token sequences each, with the response tokens marked.

``jaxtrain tokenize IN.jsonl --preference --tokenizer DIR --out OUT`` reads rows
``{"prompt", "chosen", "rejected"}`` in TRL's two preference formats, row by row:

- standard (plain strings): the sequence is ``tok(prompt) + tok(response) + [EOS]``, each
  piece tokenized on its own without special tokens, as TRL's ``DPOTrainer.tokenize_row``
  does for decoder-only models; the mask is 1 on ``tok(response) + [EOS]``; EOS is
  ``tokenizer_config.json``'s ``eos_token`` where there is one (TRL's ``eos_token_id``), else
  the tokenizer's end-of-text token;
- conversational (lists of ``{"role", "content"}`` messages: ``prompt`` the conversation so
  far, ``chosen`` / ``rejected`` the assistant message(s) that continue it): the sequence is
  ``prompt + response`` rendered with the directory's chat template, tokenized as
  `encode_chat` does (jaxtrain/data/chat.py), and the mask is 1 on the tokens of the
  response's ``{% generation %}`` blocks (the assistant turns of ``chosen`` / ``rejected``,
  closing end-of-turn token included); assistant turns inside ``prompt`` are not trained on.
  Rather than cutting the rendered text at the prompt's length (TRL's string-prefix rule,
  which breaks when a template renders earlier turns differently once more follow), the
  response is what the template marks as generated, as for SFT; ``mask_by_role`` marks the
  assistant messages' content instead, for templates without generation blocks.

TRL's implicit-prompt format (``chosen`` / ``rejected`` full conversations sharing a prefix)
is not read: give the shared turns as ``prompt``. Each response must give at least one
masked token; an empty one is an error naming the row.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from . import storage
from .chat import CONFIG as CHAT_CONFIG
from .chat import TEMPLATE_FILE, TOKENIZER, ChatEncoder, overlap_mask
from .core import DataError
from .tokenizers import tokenizer_from_spec

FIELDS = ("prompt", "chosen", "rejected")


def check_row(row: Any) -> dict:
    """A preference row's three fields, all strings or all lists of messages; DataError otherwise."""
    if not isinstance(row, dict) or any(k not in row for k in FIELDS):
        raise DataError(
            'expected an object with "prompt", "chosen" and "rejected" (strings, or lists of '
            '{"role", "content"} messages)'
        )
    values = [row[k] for k in FIELDS]
    if all(isinstance(v, str) for v in values) or all(isinstance(v, list) for v in values):
        return {k: row[k] for k in FIELDS}
    kinds = ", ".join(f"{k}: {type(row[k]).__name__}" for k in FIELDS)
    raise DataError(f"expected prompt, chosen and rejected all strings or all lists of messages ({kinds})")


class PreferenceEncoder:
    """One tokenizer (a Hugging Face directory, or a tokenizer.json / ``byte`` for plain-string
    rows only): preference rows -> ``[(chosen ids, mask), (rejected ids, mask)]`` each."""

    def __init__(self, tokenizer: str, *, mask_by_role: bool = False):
        self.spec = os.fspath(tokenizer)
        self.directory = self.spec if storage.is_dir(self.spec) else None
        self.mask_by_role = bool(mask_by_role)
        self.tokenizer = tokenizer_from_spec(
            storage.join(self.directory, TOKENIZER) if self.directory is not None else self.spec
        )
        self._chat: ChatEncoder | None = None
        self.eos_id = self._eos_id()

    def _eos_id(self) -> int:
        """The EOS appended to plain-string responses: tokenizer_config.json's ``eos_token`` (as
        TRL appends ``tokenizer.eos_token_id``), else the tokenizer's end-of-text token."""
        path = storage.join(self.directory, CHAT_CONFIG) if self.directory is not None else None
        if path is not None and storage.is_file(path):
            try:
                token = json.loads(storage.read_bytes(path)).get("eos_token")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise DataError(f"{path}: not a JSON object ({e})") from e
            if isinstance(token, dict):
                token = token.get("content")
            lookup = getattr(self.tokenizer, "token_id", None)
            found = lookup(token) if isinstance(token, str) and lookup is not None else None
            if found is not None:
                return int(found)
        return int(self.tokenizer.eos_id)

    @property
    def chat(self) -> ChatEncoder:
        """The directory's chat template (read at the first conversational row)."""
        if self._chat is None:
            if self.directory is None:
                raise DataError(
                    f"--tokenizer={self.spec!r}: conversational rows (lists of messages) need a Hugging "
                    f"Face tokenizer directory with a chat template ({CHAT_CONFIG})"
                )
            self._chat = ChatEncoder(self.directory, mask_by_role=self.mask_by_role)
            self._chat.tokenizer = self.tokenizer  # one tokenizer for both kinds of rows
        return self._chat

    def fingerprint(self) -> dict:
        """What, besides tokenizer.json, decides the ids and masks (for the manifest)."""
        digests = {}
        for name in (CHAT_CONFIG, TEMPLATE_FILE):
            path = storage.join(self.directory, name) if self.directory is not None else None
            if path is not None and storage.is_file(path):
                digests[name] = hashlib.sha256(storage.read_bytes(path)).hexdigest()
        return {
            "format": "pairs",
            "sequences": ["chosen", "rejected"],
            "files_sha256": digests,
            "mask": "role" if self.mask_by_role else "generation",
        }

    def _chat_pieces(self, row: dict) -> list:
        """Each response's (text, spans of its generation blocks): the prompt's own blocks
        (assistant turns before the response) are dropped."""
        chat = self.chat
        prompt_blocks = len(chat.render(row["prompt"])[1]) if row["prompt"] else 0
        pieces = []
        for key in ("chosen", "rejected"):
            if not row[key]:
                raise DataError(f"{key}: an empty list; expected the assistant message(s) of the response")
            text, spans = chat.render([*row["prompt"], *row[key]])
            pieces.append((text, spans[prompt_blocks:]))
        return pieces

    def encode(self, rows: list[dict]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per row, ``[(chosen ids int64, mask uint8), (rejected ids, mask)]``, tokenized as one
        batch. A DataError names the field; the caller adds the row's file and line."""
        texts: list[str] = []
        plans = []  # per row: ("plain", first text index) or ("chat", first index, spans)
        for row in rows:
            if isinstance(row["prompt"], str):
                plans.append(("plain", len(texts), None))
                texts += [row["prompt"], row["chosen"], row["rejected"]]
            else:
                pieces = self._chat_pieces(row)
                plans.append(("chat", len(texts), [spans for _, spans in pieces]))
                texts += [text for text, _ in pieces]
        ids = _encode_texts(self.tokenizer, texts)
        out = []
        for kind, at, spans in plans:
            if kind == "plain":
                prompt = ids[at][0]
                pair = [
                    self._plain(prompt, ids[at + 1 + j][0], k) for j, k in enumerate(("chosen", "rejected"))
                ]
            else:
                pair = []
                for j, key in enumerate(("chosen", "rejected")):
                    seq, offsets = ids[at + j]
                    mask = overlap_mask(offsets, spans[j])
                    if not mask.any():
                        raise DataError(f"{key}: the template marks no token of the response as generated")
                    pair.append((seq, mask))
            out.append(pair)
        return out

    def _plain(self, prompt: np.ndarray, response: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
        if not response.size:
            raise DataError(f"{key}: an empty response; expected at least one token")
        eos = np.array([self.eos_id], dtype=np.int64)
        seq = np.concatenate([prompt, response, eos])
        mask = np.concatenate([np.zeros(prompt.size, np.uint8), np.ones(response.size + 1, np.uint8)])
        return seq, mask


def _encode_texts(tokenizer, texts: list[str]) -> list[tuple[np.ndarray, list]]:
    """(ids int64, character offsets) of each text, as one batch."""
    if not texts:
        return []
    if hasattr(tokenizer, "encode_with_offsets"):
        return [(np.asarray(e.ids, dtype=np.int64), e.offsets) for e in tokenizer.encode_with_offsets(texts)]
    return [(ids.astype(np.int64), None) for ids in tokenizer.encode_batch(texts)]


def row_text(row: dict) -> str:
    """The row as the reader hands it on (JSON text, key order kept)."""
    return json.dumps(row, ensure_ascii=False)
