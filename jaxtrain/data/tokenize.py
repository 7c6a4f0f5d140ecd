"""`jaxtrain tokenize INPUT... --out DIR --tokenizer (byte | PATH/tokenizer.json)`: raw
corpora -> token shards (the format: jaxtrain/data/shards.py).

One pass, streaming: a reader thread parses documents (jaxtrain/data/documents.py) into
batches of about ``--batch-mb`` of text; the main thread tokenizes each batch (HF
``tokenizers`` encodes a batch on all cores, outside the GIL, while the reader parses
the next), appends EOS to every document, routes it to ``train`` or ``eval``, and
writes a shard whenever ``--shard-tokens`` tokens have gathered. Memory is bounded by
the shard size (one pending shard per split) plus two batches, never by the corpus.

Resuming: whenever a shard is finished, the run saves ``progress.json``: how far into
the inputs it got (file index, documents read from that file) and, per split, the
finished shards and the not-yet-full tail (saved as ``*.partial-N.*`` files). A rerun
of the same command (same tokenizer, options and input paths; the input files it had
finished unchanged in size) takes up from there: finished shards are kept as they
are, and the shards it writes next are byte-identical to an uninterrupted run's. A bad
input (unreadable file, malformed line, missing field, an id >= vocab size) stops the
run with ``file:line``, after saving progress up to the last good document; fix that
line and rerun to go on.

Chat (``--chat``, ``--tokenizer`` a Hugging Face tokenizer directory): each ``.jsonl`` row's
``messages`` (``--text-field``) is one conversation, rendered with the directory's chat
template and masked by jaxtrain/data/chat.py; a conversation is one document (its ids as the
template writes them, no EOS appended: the template ends each turn), and the mask goes to a
``.mask`` file beside each token shard (jaxtrain/data/shards.py). ``--mask-by-role`` masks
the assistant messages' content, for templates without ``{% generation %}`` blocks. The
directory also keeps a copy of ``tokenizer_config.json`` (the template).

Preference pairs (``--preference``): each ``.jsonl`` row ``{"prompt", "chosen", "rejected"}``
(plain strings, or lists of messages rendered with the directory's chat template) becomes two
documents in a row, the chosen sequence then the rejected one, each with a mask that is 1 on
its response tokens (jaxtrain/data/preference.py); the manifest's ``preference`` entry marks
the directory as pairs (version 3), which only ``train.objective: dpo`` reads.

The output directory is complete when ``manifest.json`` exists (written last).
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from . import shards, storage
from .chat import CONFIG as CHAT_CONFIG
from .chat import ChatEncoder
from .core import DataError
from .documents import DocumentReader, split_name
from .preference import PreferenceEncoder
from .tokenizers import tokenizer_from_spec

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB per shard at uint16
DEFAULT_BATCH_MB = 4.0
PROGRESS = "progress.json"
_OURS_SUFFIXES = (".tokens", ".docs", ".mask", ".tmp")
_OURS_NAMES = (shards.MANIFEST, PROGRESS, shards.TOKENIZER_COPY, CHAT_CONFIG)


def cores() -> int:
    """Threads the tokenizer encodes a batch with (``RAYON_NUM_THREADS``, else this process's CPUs)."""
    env = os.environ.get("RAYON_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))


def expand_inputs(inputs: list[str] | tuple[str, ...]) -> list[str]:
    """Files, directories (every file below, sorted) and globs, in the order given; each file once."""
    if not inputs:
        raise DataError("tokenize: no INPUT given; expected files, directories or globs")
    files: dict[str, None] = {}
    for item in map(os.fspath, inputs):
        if storage.has_glob(item):
            found = storage.glob_files(item)
            if not found:
                raise DataError(f"{item}: glob matches no files")
        elif storage.is_file(item):
            found = [item]
        elif storage.is_dir(item):
            found = storage.glob_files(storage.join(item, "**", "*"))
            if not found:
                raise DataError(f"{item}: directory holds no files")
        else:
            raise DataError(f"{item}: no such file or directory")
        files.update(dict.fromkeys(found))
    return list(files)


class _Batch:
    __slots__ = ("texts", "where", "position", "bytes_done", "error")

    def __init__(self, texts, where, position, bytes_done, error=None):
        self.texts: list[str] = texts
        self.where: list[tuple[int, int]] = where  # (file index, line) per document
        self.position: tuple[int, int] = position  # (file index, documents read from it) after the batch
        self.bytes_done = bytes_done
        self.error: DataError | None = error


class _Reader(threading.Thread):
    """Parses documents into batches on a queue (two at most), from a resume position."""

    def __init__(
        self, files, sizes, start, *, batch_bytes, text_field, separator, chat=False, preference=False
    ):
        super().__init__(daemon=True, name="jaxtrain-tokenize-reader")
        self.files, self.sizes, self.start_at = files, sizes, start
        self.batch_bytes, self.text_field, self.separator = batch_bytes, text_field, separator
        self.chat, self.preference = chat, preference
        self.out: queue.Queue = queue.Queue(maxsize=2)
        self.stopped = threading.Event()

    def _put(self, item) -> bool:
        while not self.stopped.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        first, skip = self.start_at
        texts, where, size = [], [], 0
        position = (first, skip)
        done = sum(self.sizes[:first])
        try:
            for fi in range(first, len(self.files)):
                reader = DocumentReader(
                    self.files[fi],
                    text_field=self.text_field,
                    separator=self.separator,
                    chat=self.chat,
                    preference=self.preference,
                )
                n = 0
                for line, text in reader:
                    n += 1
                    if fi == first and n <= skip:
                        continue
                    texts.append(text)
                    where.append((fi, line))
                    position = (fi, n)
                    size += len(text)
                    if size >= self.batch_bytes:
                        if not self._put(_Batch(texts, where, position, done + reader.bytes_read)):
                            return
                        texts, where, size = [], [], 0
                done += self.sizes[fi]
                position = (fi + 1, 0)
        except DataError as e:
            self._put(_Batch(texts, where, position, done, error=e))
            return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises
            self._put(_Batch(texts, where, position, done, error=e))
            return
        if texts:
            self._put(_Batch(texts, where, position, done))
        self._put(None)


class _Progress:
    """A rich progress bar over input bytes, with MB/s and tokens/s; silent when off."""

    def __init__(self, enabled: bool, total_bytes: int):
        self.bar = None
        self.start = time.perf_counter()
        if not enabled:
            return
        # only with --progress: a quiet tokenize (scripts, tests) never loads rich's widgets
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("tokenize"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[mbps]:.1f} MB/s"),
            TextColumn("{task.fields[tps]:,.0f} tokens/s"),
            TextColumn("{task.fields[tokens]:,} tokens"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.bar.start()
        self.task = self.bar.add_task("tokenize", total=max(total_bytes, 1), mbps=0.0, tps=0.0, tokens=0)

    def update(self, bytes_done: int, bytes_this_run: int, tokens: int, tokens_this_run: int) -> None:
        if self.bar is None:
            return
        dt = max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(
            self.task,
            completed=bytes_done,
            mbps=bytes_this_run / dt / 1e6,
            tps=tokens_this_run / dt,
            tokens=tokens,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _with_eos(ids: np.ndarray, lengths: np.ndarray, eos: int, dtype: np.dtype) -> np.ndarray:
    """Concatenated documents -> the same with EOS after each one."""
    ends = np.cumsum(lengths + 1)
    out = np.empty(int(ends[-1]) if ends.size else 0, dtype=dtype)
    is_eos = np.zeros(out.size, dtype=bool)
    is_eos[ends - 1] = True
    out[is_eos] = eos
    out[~is_eos] = ids
    return out


def _encode_chat(chat: ChatEncoder, texts: list[str], where: list[tuple[int, int]], files: list[str]):
    """Conversations (JSON text) -> (ids, lengths, mask, which conversations are kept: those of
    at least one token); or the error naming the first one the template refuses."""
    rendered = []
    for text, (fi, line) in zip(texts, where):
        try:
            rendered.append(chat.render(json.loads(text)))
        except DataError as e:
            return DataError(f"{files[fi]}:{line}: {e}")
    encoded = chat.encode_rendered(rendered)
    kept = np.array([i for i, (ids, _) in enumerate(encoded) if ids.size], dtype=np.int64)
    lengths = np.array([encoded[i][0].size for i in kept], dtype=np.int64)
    if not kept.size:
        return np.zeros(0, np.int64), lengths, np.zeros(0, np.uint8), kept
    ids = np.concatenate([encoded[i][0] for i in kept])
    return ids, lengths, np.concatenate([encoded[i][1] for i in kept]), kept


def _encode_pairs(
    encoder: PreferenceEncoder, texts: list[str], where: list[tuple[int, int]], files: list[str]
):
    """Preference rows (JSON text) -> (ids, lengths, mask, kept rows): two documents per row,
    the chosen sequence then the rejected one; or the error naming the first bad row."""
    rows = [json.loads(t) for t in texts]
    try:
        encoded = encoder.encode(rows)
    except DataError:  # find the row (one at a time only on this error path)
        for row, (fi, line) in zip(rows, where):
            try:
                encoder.encode([row])
            except DataError as e:
                return DataError(f"{files[fi]}:{line}: {e}")
        raise
    sequences = [seq for pair in encoded for seq in pair]
    lengths = np.array([ids.size for ids, _ in sequences], dtype=np.int64)
    ids = np.concatenate([ids for ids, _ in sequences]) if sequences else np.zeros(0, np.int64)
    mask = np.concatenate([m for _, m in sequences]) if sequences else np.zeros(0, np.uint8)
    return ids, lengths, mask, np.arange(len(rows), dtype=np.int64)


def _encode(tok, batch: _Batch, files: list[str], eval_fraction: float, chat=None) -> dict | DataError:
    """A batch's documents -> ``{split: (ids, lengths, mask or None)}``, or the error naming the
    first document with an id >= the vocab size (checked before anything is written) or, with
    ``chat`` (a ChatEncoder), the first conversation its template refuses (a
    PreferenceEncoder: the first preference row it refuses)."""
    if eval_fraction > 0:
        route = np.fromiter((shards.to_eval(t, eval_fraction) for t in batch.texts), bool, len(batch.texts))
    else:
        route = np.zeros(len(batch.texts), bool)
    encoded = {}
    for split, selected in (("train", ~route), ("eval", route)):
        index = np.flatnonzero(selected)
        if not index.size:
            continue
        texts, mask = [batch.texts[i] for i in index], None
        if chat is None:
            ids, lengths = tok.encode_flat(texts)
        else:
            encode = _encode_pairs if isinstance(chat, PreferenceEncoder) else _encode_chat
            got = encode(chat, texts, [batch.where[i] for i in index], files)
            if isinstance(got, DataError):
                return got
            ids, lengths, mask, kept = got
            index = index[kept]
            if isinstance(chat, PreferenceEncoder):  # two documents per row
                index = np.repeat(index, 2)
        if ids.size and int(ids.max()) >= tok.vocab_size:
            bad = int(np.argmax(ids >= tok.vocab_size))
            fi, line = batch.where[int(index[np.searchsorted(np.cumsum(lengths), bad, side="right")])]
            return DataError(
                f"{files[fi]}:{line}: tokenizer {tok.name!r} produced id {int(ids[bad])} "
                f">= its vocab size {tok.vocab_size}"
            )
        encoded[split] = (ids, lengths, mask)
    return encoded


def tokenize(
    inputs: list[str] | tuple[str, ...],
    out: str,
    tokenizer: str,
    *,
    chat: bool = False,
    preference: bool = False,
    mask_by_role: bool = False,
    text_field: str | None = None,
    separator: str | None = None,
    eval_fraction: float = 0.0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_bytes: int = int(DEFAULT_BATCH_MB * 2**20),
    force: bool = False,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Tokenize ``inputs`` into the token directory ``out``; returns its manifest plus a
    ``"run"`` entry (seconds, bytes and tokens this run, cores). See the module docstring.
    ``chat``: rows of conversations, ``tokenizer`` a Hugging Face tokenizer directory;
    ``text_field`` defaults to ``"messages"`` then, else ``"text"``. ``preference``: rows of
    preference pairs (module docstring)."""
    if text_field is None:
        text_field = "messages" if chat else "text"
    _check_options(eval_fraction, shard_tokens, batch_bytes, text_field)
    if chat and preference:
        raise DataError(
            "--chat with --preference: --preference reads {prompt, chosen, rejected} rows, rendering "
            "lists of messages with the chat template itself; drop --chat"
        )
    if mask_by_role and not (chat or preference):
        raise DataError("--mask-by-role: masks conversations; expected --chat or --preference too")
    files = expand_inputs(inputs)
    sizes = [storage.file_size(f) for f in files]
    if preference:
        encoder = _preference_encoder(tokenizer, files, mask_by_role)
    else:
        encoder = _chat_encoder(tokenizer, files, mask_by_role) if chat else None
    tok = encoder.tokenizer if encoder is not None else tokenizer_from_spec(tokenizer)
    if not 0 <= tok.eos_id < tok.vocab_size:
        raise DataError(
            f"--tokenizer={tokenizer!r}: EOS id {tok.eos_id} outside its vocab size {tok.vocab_size}"
        )
    fingerprint = {
        "format": shards.FORMAT,
        "version": shards.PAIR_VERSION if preference else shards.MASK_VERSION if chat else shards.VERSION,
        "tokenizer": {
            "name": tok.name,
            "sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "dtype": shards.token_dtype_name(tok.vocab_size),
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "separator": separator,
        "eval_fraction": float(eval_fraction),
        "inputs": [{"path": f, "bytes": s} for f, s in zip(files, sizes)],
        "chat": _chat_fingerprint(encoder, tokenizer) if chat else None,
    }
    if preference:
        fingerprint["preference"] = encoder.fingerprint()
    resume = _prepare_out(out, fingerprint, force=force, log=log)
    if resume == "complete":
        manifest = shards.read_manifest(out)
        log(f"{out}: already tokenized (manifest.json matches these inputs); nothing to do")
        return {**manifest, "run": {"seconds": 0.0, "bytes": 0, "tokens": 0, "cores": cores()}}
    if getattr(tok, "json_bytes", None) is not None:
        storage.write_atomic(storage.join(out, shards.TOKENIZER_COPY), tok.json_bytes)
    if encoder is not None and storage.is_file(storage.join(tokenizer, CHAT_CONFIG)):
        config = storage.read_bytes(storage.join(tokenizer, CHAT_CONFIG))
        storage.write_atomic(storage.join(out, CHAT_CONFIG), config)
    splits = _Splits(out, fingerprint)
    if isinstance(resume, dict):
        splits.restore(resume)
        log(
            f"{out}: resuming at input {splits.position[0] + 1}/{len(files)} after {splits.position[1]:,} "
            f"documents ({', '.join(f'{s}: {len(w.shards)} shards kept' for s, w in splits.writers.items())})"
        )
    run_start, start_tokens = time.perf_counter(), splits.total_tokens
    start_bytes = sum(sizes[: splits.position[0]])
    reader = _Reader(
        files,
        sizes,
        splits.position,
        batch_bytes=batch_bytes,
        text_field=text_field,
        separator=separator,
        chat=chat,
        preference=preference,
    )
    bar = _Progress(progress, sum(sizes))
    _encode_all(reader, splits, tok, files, eval_fraction, bar, start_bytes, encoder)
    seconds = time.perf_counter() - run_start
    run = {
        "seconds": seconds,
        "bytes": sum(sizes) - start_bytes,
        "tokens": splits.total_tokens - start_tokens,
        "cores": cores(),
    }
    manifest = _write_manifest(out, fingerprint, splits, len(files))
    log(_summary(manifest, run, len(files), out))
    return {**manifest, "run": run}


def _chat_encoder(tokenizer: str, files: list[str], mask_by_role: bool) -> ChatEncoder:
    for f in files:
        if split_name(f)[0] != "jsonl":
            raise DataError(f'{f}: --chat reads .jsonl files (one {{"messages": [...]}} per line)')
    if not storage.is_dir(tokenizer):
        raise DataError(
            f"--tokenizer={tokenizer!r}: --chat expects a Hugging Face tokenizer directory "
            f"({CHAT_CONFIG} with a chat_template, and tokenizer.json)"
        )
    return ChatEncoder(tokenizer, mask_by_role=mask_by_role)


def _preference_encoder(tokenizer: str, files: list[str], mask_by_role: bool) -> PreferenceEncoder:
    for f in files:
        if split_name(f)[0] != "jsonl":
            raise DataError(
                f'{f}: --preference reads .jsonl files (one {{"prompt", "chosen", "rejected"}} per line)'
            )
    return PreferenceEncoder(tokenizer, mask_by_role=mask_by_role)


def _chat_fingerprint(encoder: ChatEncoder, tokenizer: str) -> dict:
    """What, besides tokenizer.json, decides a chat directory's ids and masks."""
    config = storage.read_bytes(storage.join(tokenizer, CHAT_CONFIG))
    return {
        "tokenizer_config_sha256": hashlib.sha256(config).hexdigest(),
        "template_sha256": hashlib.sha256(encoder.source.encode("utf-8")).hexdigest(),
        "mask": "role" if encoder.mask_by_role else "generation",
    }


def _summary(manifest: dict, run: dict, n_files: int, out: str) -> str:
    """The closing line: what the directory holds, and this run's throughput."""
    split_text = ", ".join(
        f"{s}: {v['tokens']:,} tokens / {v['documents']:,} documents / {len(v['shards'])} shards"
        for s, v in manifest["splits"].items()
    )
    seconds = max(run["seconds"], 1e-9)
    return (
        f"tokenized {n_files} file(s) -> {out} ({split_text}); this run {run['bytes'] / 1e6:,.1f} MB in "
        f"{run['seconds']:.1f} s: {run['bytes'] / 1e6 / seconds:,.1f} MB/s, "
        f"{run['tokens'] / seconds:,.0f} tokens/s on {run['cores']} cores"
    )


def _check_options(eval_fraction, shard_tokens, batch_bytes, text_field) -> None:
    if not isinstance(eval_fraction, (int, float)) or not 0 <= eval_fraction < 1:
        raise DataError(f"--eval-fraction={eval_fraction!r}: expected a number in [0, 1)")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(f"--shard-tokens={shard_tokens!r}: expected a positive integer")
    if batch_bytes < 1:
        raise DataError(f"--batch-mb: expected a positive size, got {batch_bytes} bytes")
    if not text_field:
        raise DataError("--text-field='': expected a field name")


class _Splits:
    """The train and eval shard writers of one output directory, and the progress file that
    lets a killed run resume: the input position after the last batch written, the writers'
    states and their unfinished tails (a new generation each time, the old ones removed)."""

    def __init__(self, out: str, fingerprint: dict):
        self.out, self.fingerprint = out, fingerprint
        dtype, shard_tokens = fingerprint["dtype"], fingerprint["shard_tokens"]
        self.chat = fingerprint.get("chat") is not None or fingerprint.get("preference") is not None
        self.writers = {
            split: shards.SplitWriter(out, split, dtype=dtype, shard_tokens=shard_tokens, masked=self.chat)
            for split in shards.SPLITS
        }
        self.np_dtype = shards.TOKEN_DTYPES[dtype]
        self.position, self.generation = (0, 0), 0

    @property
    def total_tokens(self) -> int:
        return sum(w.total_tokens for w in self.writers.values())

    def restore(self, resume: dict) -> None:
        self.position, self.generation = tuple(resume["position"]), resume["generation"]
        for split, w in self.writers.items():
            w.restore(resume["splits"][split]["state"], resume["splits"][split]["tail"])

    def add(self, encoded: dict, eos_id: int) -> int:
        """Append each split's documents (EOS after each; a conversation as it is, with its
        mask); returns the shards written."""
        written = 0
        for split, (ids, lengths, mask) in encoded.items():
            if mask is None:
                docs = _with_eos(ids, lengths, eos_id, self.np_dtype)
                written += self.writers[split].add(docs, lengths + 1)
            else:
                written += self.writers[split].add(ids.astype(self.np_dtype), lengths, mask)
        return written

    def checkpoint(self, at: tuple[int, int]) -> None:
        self.generation += 1
        state = {
            **self.fingerprint,
            "position": list(at),
            "generation": self.generation,
            "splits": {
                split: {"state": w.state(), "tail": w.save_tail(f"{split}.partial-{self.generation}")}
                for split, w in self.writers.items()
            },
        }
        storage.write_atomic(storage.join(self.out, PROGRESS), json.dumps(state, indent=1).encode())
        _remove_stale_tails(self.out, keep=self.generation)


def _encode_all(reader: _Reader, splits: _Splits, tok, files, eval_fraction, bar, start_bytes, chat) -> None:
    """Tokenize every batch the reader thread yields into the splits, checkpointing after
    each batch that wrote a shard; on an input error, checkpoint the last good batch and raise."""
    start_tokens = splits.total_tokens
    reader.start()
    try:
        while (batch := reader.out.get()) is not None:
            if batch.texts:
                encoded = _encode(tok, batch, files, eval_fraction, chat)
                if isinstance(encoded, DataError):
                    splits.checkpoint(splits.position)  # the last batch fully processed
                    raise encoded
                written = splits.add(encoded, tok.eos_id)
                splits.position = batch.position
                if written:
                    splits.checkpoint(splits.position)
            total = splits.total_tokens
            bar.update(batch.bytes_done, batch.bytes_done - start_bytes, total, total - start_tokens)
            if batch.error is not None:
                splits.checkpoint(batch.position)
                raise batch.error
        for w in splits.writers.values():
            w.finish()
    finally:
        reader.stopped.set()
        bar.close()


def _write_manifest(out: str, fingerprint: dict, splits: _Splits, n_files: int) -> dict:
    """The finished directory's manifest.json (the progress file and stale tails removed)."""
    manifest = {
        **fingerprint,
        "splits": {split: w.summary() for split, w in splits.writers.items() if w.shards},
    }
    if "train" not in manifest["splits"]:
        raise DataError(f"tokenize: {n_files} input file(s) hold no non-empty document for the train split")
    storage.write_atomic(storage.join(out, shards.MANIFEST), json.dumps(manifest, indent=1).encode())
    if storage.exists(storage.join(out, PROGRESS)):
        storage.remove(storage.join(out, PROGRESS))
    _remove_stale_tails(out, keep=None)
    return manifest


def _remove_stale_tails(out: str, keep: int | None) -> None:
    for name in storage.list_dir(out):
        if ".partial-" in name:
            generation = name.split(".partial-")[1].split(".")[0]
            if keep is None or generation != str(keep):
                storage.remove(storage.join(out, name))


def _resumable(state: dict, fingerprint: dict) -> bool:
    """Same options and tokenizer, the same input paths, and the inputs it had finished
    unchanged in size. The file it stopped in, and later ones, may have changed (say,
    to fix the line it reported): documents it already read are taken as they were."""
    if any(state.get(k) != v for k, v in fingerprint.items() if k != "inputs"):
        return False
    before, now = state["inputs"], fingerprint["inputs"]
    finished = int(state["position"][0])
    return [i["path"] for i in before] == [i["path"] for i in now] and before[:finished] == now[:finished]


def _prepare_out(out: str, fingerprint: dict, *, force: bool, log) -> str | dict | None:
    """``"complete"`` (same manifest), a progress dict (resume), or None (a fresh run)."""
    names = storage.list_dir(out)
    if names and not force:
        manifest_path, progress_path = storage.join(out, shards.MANIFEST), storage.join(out, PROGRESS)
        if shards.MANIFEST in names:
            try:
                existing = json.loads(storage.read_bytes(manifest_path))
                same = {k: existing.get(k) for k in fingerprint} == fingerprint
            except (json.JSONDecodeError, UnicodeDecodeError):
                same = False
            if same:
                return "complete"
            raise DataError(
                f"--out {out}: holds a finished token directory of other inputs, tokenizer or options; "
                "pass --force to replace it"
            )
        if PROGRESS in names:
            try:
                state = json.loads(storage.read_bytes(progress_path))
                same = _resumable(state, fingerprint)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
                same = False
            if same:
                return state
            raise DataError(
                f"--out {out}: holds an unfinished tokenize run of other inputs (paths, or sizes of the "
                "files it had finished), tokenizer or options; rerun that command to finish it, or pass "
                "--force to start over"
            )
        raise DataError(
            f"--out {out}: exists and is not empty; expected a new or empty directory (or --force)"
        )
    if names and force:
        for name in names:
            if name in _OURS_NAMES or name.endswith(_OURS_SUFFIXES) or ".partial-" in name:
                storage.remove(storage.join(out, name))
        left = storage.list_dir(out)
        if left:
            log(f"{out}: --force removed the previous token files; left {len(left)} other file(s) alone")
    storage.make_dirs(out)
    return None


# --------------------------------------------------------------------------- CLI


def add_tokenize_parser(subparsers) -> argparse.ArgumentParser:
    """The ``tokenize`` subcommand, for ``jaxtrain``'s subparsers."""
    t = subparsers.add_parser(
        "tokenize",
        help="tokenize raw corpora (.txt, .jsonl[.gz|.zst], .parquet; local or remote) into token "
        "shards for data.source=tokens; rerun after a kill to resume",
    )
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs (gs://... too)")
    t.add_argument(
        "--out", required=True, help="output directory (new, empty, or this command's own to resume)"
    )
    t.add_argument(
        "--tokenizer",
        required=True,
        help="'byte' or a Hugging Face tokenizer.json (path or URL); with --chat, the tokenizer directory",
    )
    t.add_argument(
        "--chat",
        action="store_true",
        help='.jsonl rows {"messages": [{"role", "content"}, ...]}: render the tokenizer directory\'s chat '
        "template; the loss counts only the assistant's tokens ({% generation %} blocks)",
    )
    t.add_argument(
        "--preference",
        action="store_true",
        help='.jsonl rows {"prompt", "chosen", "rejected"} (strings, or lists of messages rendered with '
        "the tokenizer directory's chat template): preference pairs for train.objective=dpo",
    )
    t.add_argument(
        "--mask-by-role",
        action="store_true",
        help="with --chat or --preference: mask the assistant messages' content (for templates "
        "without {% generation %})",
    )
    t.add_argument(
        "--text-field",
        default=None,
        help="the document's field in .jsonl / column in .parquet (default 'text'; 'messages' with --chat)",
    )
    t.add_argument(
        "--separator",
        default=None,
        help="plain-text files: split documents at this string (escapes such as '\\n\\n' allowed); "
        "default: one document per file",
    )
    t.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help="fraction of documents held out as the eval split, chosen by a hash of their text",
    )
    t.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,}); memory holds about 2 per split",
    )
    t.add_argument("--batch-mb", type=float, default=DEFAULT_BATCH_MB, help="text per tokenizer batch, MB")
    t.add_argument("--force", action="store_true", help="replace token files already in --out")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t.set_defaults(func=run_tokenize)
    return t


def run_tokenize(args: argparse.Namespace) -> int:
    """Exit code: 0 done (or already done), 2 bad input (one ``jaxtrain: error:`` line on stderr)."""
    separator = getattr(args, "separator", None)
    try:
        if separator is not None:
            separator = codecs.decode(separator, "unicode_escape")
        tokenize(
            args.inputs,
            args.out,
            args.tokenizer,
            chat=getattr(args, "chat", False),
            preference=getattr(args, "preference", False),
            mask_by_role=getattr(args, "mask_by_role", False),
            text_field=getattr(args, "text_field", None),
            separator=separator,
            eval_fraction=getattr(args, "eval_fraction", 0.0),
            shard_tokens=getattr(args, "shard_tokens", DEFAULT_SHARD_TOKENS),
            batch_bytes=int(getattr(args, "batch_mb", DEFAULT_BATCH_MB) * 2**20),
            force=getattr(args, "force", False),
            progress=getattr(args, "progress", True) and sys.stdout.isatty(),
        )
    except DataError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"jaxtrain: error: tokenize: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0
