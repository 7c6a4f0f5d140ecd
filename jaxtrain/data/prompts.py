"""Prompts for reinforcement learning (data.source=prompts, train.objective=grpo).

Each line of a ``data.paths`` JSONL file is one row: ``prompt`` (a string, used as it is) or
``messages`` (a conversation, rendered with the chat template of the ``data.tokenizer``
directory and its generation prompt, as ``apply_chat_template(add_generation_prompt=True)``
does), and any other fields, handed to the reward functions (trainer/rewards.py). The text
is tokenized with the directory's ``tokenizer.json`` without special tokens (a template
writes its own); a prompt longer than ``max_prompt_len`` tokens keeps its last ones (cut
from the left, as TRL does), and `truncated` counts them.

Order: prompt slot ``j`` (batch ``k`` holds slots ``k*P .. k*P + P - 1``) is row
``perm_e[j mod N]`` of the N rows, ``perm_e`` a permutation drawn from ``(seed, e)`` for
epoch ``e = j // N`` (the identity with ``data.shuffle: false``): every batch is a pure
function of the seed and its index, so the position is the batch index alone, as for the
other sources. Every process reads the whole global batch of prompts (the rollout samples
the global batch; each process then places its own rows).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import storage
from .chat import TOKENIZER, ChatEncoder
from .core import DataError, DataIterator
from .text import expand_paths
from .tokenizers import HFTokenizer


class PromptRow:
    """One prompt: its text as the model sees it, its token ids, and the row's other fields."""

    __slots__ = ("index", "text", "ids", "fields")

    def __init__(self, index: int, text: str, ids: np.ndarray, fields: dict[str, Any]):
        self.index, self.text, self.ids, self.fields = index, text, ids, fields


def read_rows(paths) -> list[dict]:
    """Every JSONL row of `paths` (files or globs), in order; a bad line names file and line."""
    rows = []
    for path in expand_paths(paths):
        text = storage.read_bytes(path).decode("utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise DataError(f"{path}:{n}: expected an object with either 'prompt' or 'messages'")
            if "prompt" in row and not isinstance(row["prompt"], str):
                raise DataError(f"{path}:{n}: 'prompt' must be a string, got {type(row['prompt']).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"data.paths={list(paths)}: no prompt rows")
    return rows


class PromptIterator(DataIterator):
    """Global batches of `PromptRow`s (module docstring); `global_batch_size` counts prompts."""

    source = "prompts"

    def __init__(self, data_cfg, *, max_prompt_len: int, global_batch_size: int, seed: int):
        super().__init__(vocab_size=2, seq_len=1, global_batch_size=global_batch_size, seed=seed)
        directory = data_cfg.tokenizer
        if not storage.is_file(storage.join(directory, TOKENIZER)):
            raise DataError(
                f"data.tokenizer={directory!r}: data.source=prompts needs a Hugging Face tokenizer "
                f"directory (with {TOKENIZER})"
            )
        self.tokenizer = HFTokenizer(storage.join(directory, TOKENIZER))
        raw = read_rows(data_cfg.paths)
        chat = ChatEncoder(directory, mask_by_role=True) if any("messages" in r for r in raw) else None
        texts = [
            r["prompt"] if "prompt" in r else chat.render(r["messages"], add_generation_prompt=True)[0]
            for r in raw
        ]
        ids = self.tokenizer.encode_batch(texts)
        self.truncated = sum(len(i) > max_prompt_len for i in ids)
        self.rows = [
            PromptRow(
                n,
                text,
                i[-max_prompt_len:].astype(np.int32),
                {k: v for k, v in r.items() if k not in ("prompt", "messages")},
            )
            for n, (r, text, i) in enumerate(zip(raw, texts, ids))
        ]
        if any(len(r.ids) == 0 for r in self.rows):
            raise DataError("data.paths: a prompt has no tokens; expected non-empty prompts")
        self.shuffle = bool(getattr(data_cfg, "shuffle", True))

    def describe(self) -> str:
        return (
            f"prompts: {len(self.rows)} rows, {self.global_batch_size} per step; {self.truncated} longer "
            "than grpo.max_prompt_len, cut from the left"
        )

    def row_indices(self, k: int) -> np.ndarray:
        """The prompt rows of global batch `k`, in order."""
        n = len(self.rows)
        slots = np.arange(k * self.global_batch_size, (k + 1) * self.global_batch_size, dtype=np.int64)
        out = np.empty_like(slots)
        for epoch in np.unique(slots // n):
            at = slots // n == epoch
            perm = (
                np.random.default_rng([self.seed, int(epoch)]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            out[at] = perm[slots[at] % n]
        return out

    def batch_at(self, k: int) -> list[PromptRow]:
        return [self.rows[i] for i in self.row_indices(k)]
