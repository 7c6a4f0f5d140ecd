"""Streaming document readers, one per format public corpora ship in.

The format comes from the file name: ``.jsonl`` (one JSON object per line, the
document in a string field, ``"text"`` by default), ``.parquet`` (a string column),
anything else is plain text: the whole file is one document, or, with a separator,
the pieces between separators are. ``.gz``, ``.zst``, ``.bz2`` and ``.xz`` after the
format's suffix are decompressed on the fly (``corpus.jsonl.zst``, ``book.txt.gz``).

Chat rows (``chat=True``, ``.jsonl`` only): the field holds a conversation, a list of
messages, yielded as its JSON text (``json.dumps(messages, ensure_ascii=False)``, key order
kept) so that everything downstream still handles strings; an empty list is skipped.
Preference rows (``preference=True``, ``.jsonl`` only): the object's ``prompt``, ``chosen`` and
``rejected`` (jaxtrain/data/preference.py), yielded as their JSON text.

Documents are yielded one at a time, so memory holds one document (text) or one
parquet row batch, never a file. Empty documents are skipped; blank ``.jsonl`` lines
too. A bad record raises `DataError` naming ``file:line`` (``file:row N`` in parquet).
Text must be UTF-8: an invalid byte, or a NUL byte (a binary file given as text), raises
`DataError` naming the file and the byte offset, rather than training on garbage.
``\\r`` is kept.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Iterator
from typing import IO

from . import storage
from .core import DataError
from .preference import check_row, row_text

COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
_TEXT_CHUNK = 1 << 20  # characters read at a time when splitting text by a separator


def split_name(path: str) -> tuple[str, str | None]:
    """``(format, compression)``: format ``"jsonl" | "parquet" | "text"``, compression a suffix or None."""
    name = str(path).rsplit("/", 1)[-1].lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    if compression:
        name = name[: -len(compression)]
    if name.endswith(".jsonl"):
        return "jsonl", compression
    if name.endswith(".parquet"):
        if compression:
            raise DataError(f"{path}: compressed parquet files are not supported (parquet compresses inside)")
        return "parquet", None
    return "text", compression


def _utf8_boundary(data: bytes) -> int:
    """The end of the last whole UTF-8 character in `data` (a character's bytes never split)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return len(data) if need <= back else len(data) - back
    return len(data)


def _decompressed(raw: IO[bytes], compression: str | None, path: str) -> IO[bytes]:
    if compression is None:
        return raw
    if compression == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == ".bz2":
        return bz2.BZ2File(raw, mode="rb")
    if compression == ".xz":
        return lzma.LZMAFile(raw, mode="rb")
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - zstandard is a dependency
        raise DataError(f"{path}: reading .zst needs the `zstandard` package (pip install zstandard)") from e
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.BufferedReader(reader, buffer_size=1 << 20)


def _corrupt_data_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError, zlib.error)
    try:
        import zstandard
    except ImportError:  # pragma: no cover
        return errors
    return (*errors, zstandard.ZstdError)


class DocumentReader:
    """Iterate ``(line, text)`` over one file's non-empty documents.

    ``line`` is where the document is (1-based line, or row for parquet), for messages.
    ``bytes_read`` is how far into the (compressed) file reading has got, for progress.
    """

    def __init__(
        self,
        path: str,
        *,
        text_field: str = "text",
        separator: str | None = None,
        chat: bool = False,
        preference: bool = False,
    ):
        self.path = str(path)
        self.format, self.compression = split_name(self.path)
        if chat and self.format != "jsonl":
            raise DataError(
                f'{self.path}: chat data is read from .jsonl files (one {{"messages": [...]}} per line)'
            )
        if preference and self.format != "jsonl":
            raise DataError(
                f'{self.path}: preference pairs are read from .jsonl files (one {{"prompt", "chosen", '
                '"rejected"}} per line)'
            )
        self.text_field = text_field
        self.chat = chat
        self.preference = preference
        if separator == "":
            raise DataError("separator='': expected a non-empty string or None (one document per file)")
        self.separator = separator
        self._raw: IO[bytes] | None = None
        self._parquet_fraction = 0.0
        self._line = 0  # the last line read, for messages about corrupt data
        self.size = storage.file_size(self.path)

    @property
    def bytes_read(self) -> int:
        if self.format == "parquet":
            return int(self.size * self._parquet_fraction)
        if self._raw is None or self._raw.closed:
            return self.size if self._raw is not None else 0
        try:
            return min(self.size, self._raw.tell())
        except (OSError, ValueError):
            return 0

    def __iter__(self) -> Iterator[tuple[int, str]]:
        try:
            raw = storage.open_read(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: cannot open ({e.strerror or e})") from e
        self._raw = raw
        with raw:
            try:
                if self.format == "parquet":
                    yield from self._parquet(raw)
                    return
                stream = _decompressed(raw, self.compression, self.path)
                if self.format == "jsonl":
                    yield from self._jsonl(stream)
                elif self.separator is None:
                    text = self._decode(stream.read(), 0)
                    if text:
                        yield 1, text
                else:
                    yield from self._split_text(stream)
            except _corrupt_data_errors() as e:  # truncated or corrupt (compressed) data
                where = f" after line {self._line}" if self._line else ""
                raise DataError(f"{self.path}: unreadable{where} ({type(e).__name__}: {e})") from e

    def _jsonl(self, stream: IO[bytes]) -> Iterator[tuple[int, str]]:
        field = self.text_field
        for lineno, line in enumerate(stream, start=1):
            self._line = lineno
            if not line.strip():
                continue
            try:
                record = json.loads(self._decode(line, None, lineno))
            except json.JSONDecodeError as e:
                raise DataError(f"{self.path}:{lineno}: invalid JSON ({e.msg})") from e
            if self.preference:
                try:
                    yield lineno, row_text(check_row(record))
                except DataError as e:
                    raise DataError(f"{self.path}:{lineno}: {e}") from None
                continue
            text = record.get(field) if isinstance(record, dict) else None
            if self.chat:
                if not isinstance(text, list):
                    raise DataError(
                        f"{self.path}:{lineno}: expected an object with a {field!r} field holding a list of "
                        "messages ({'role': ..., 'content': ...})"
                    )
                if text:
                    yield lineno, json.dumps(text, ensure_ascii=False)
                continue
            if not isinstance(text, str):
                raise DataError(f"{self.path}:{lineno}: expected an object with a string {field!r} field")
            if text:
                yield lineno, text

    def _decode(self, data: bytes, offset: int | None, lineno: int | None = None) -> str:
        """UTF-8 text of `data` (at byte `offset` of the decompressed file, or on `lineno`);
        invalid or NUL bytes are a DataError naming where they are."""
        where = f"{self.path}:{lineno}" if lineno is not None else self.path

        def at(i: int) -> str:
            return f"byte {offset + i}" if offset is not None else f"byte {i} of the line"

        nul = data.find(b"\0")
        if nul >= 0:
            raise DataError(f"{where}: NUL byte at {at(nul)}; this looks like a binary file, not text")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 at {at(e.start)} ({e.reason})") from None

    def _split_text(self, stream: IO[bytes]) -> Iterator[tuple[int, str]]:
        sep, pending, line, offset, carry = self.separator, "", 1, 0, b""
        while True:
            chunk = stream.read(_TEXT_CHUNK)
            final = not chunk
            data = carry + chunk
            # Decode whole characters only: up to 3 bytes of a split character wait for the next chunk.
            cut = len(data) if final else _utf8_boundary(data)
            pending += self._decode(data[:cut], offset)
            offset, carry = offset + cut, data[cut:]
            pieces = pending.split(sep)
            pending = "" if final else pieces.pop()  # may end in part of a separator
            for piece in pieces:
                if piece:
                    yield line, piece
                line += piece.count("\n") + sep.count("\n")
            if final:
                return

    def _parquet(self, raw: IO[bytes]) -> Iterator[tuple[int, str]]:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(
                f"{self.path}: reading .parquet needs the `pyarrow` package (pip install pyarrow)"
            ) from e
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:  # pyarrow raises ArrowInvalid etc.
            raise DataError(f"{self.path}: not a readable parquet file ({e})") from e
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise DataError(f"{self.path}: no column {self.text_field!r}; columns are {names}")
        total = max(1, pf.metadata.num_rows)
        row = 0
        batches = pf.iter_batches(batch_size=1024, columns=[self.text_field])
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # pyarrow's ArrowInvalid / OSError on a corrupt row group
                raise DataError(f"{self.path}: unreadable after row {row} ({type(e).__name__}: {e})") from e
            if batch is None:
                return
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.path}:row {row}: expected a string in column {self.text_field!r}, "
                        f"got {type(text).__name__}"
                    )
                if text:
                    yield row, text
            self._parquet_fraction = row / total
