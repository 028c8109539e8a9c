"""Streaming readers of corpus files, over the whole file or one span of it, never holding more
than a block of the file's bytes beyond the documents they yield:

    .txt      the file is one document, yielded in pieces of at most PIECE_BYTES (cut after a
              newline where one is near), so a file of any size tokenizes in bounded memory
    .jsonl    one document per line: text `{"text": ..., "type"?, "lang"?, "domain"?,
              "source"?}` or a chat `{"messages": [...], "tools"?: [...]}` (train/data/chat.py)
    .parquet  one document per row, from a `text` or a `messages` column (needs pyarrow)

    for doc in read_file(path, "a.jsonl"): ...                       # the whole file
    for doc in read_file(path, "a.jsonl", Span(start, stop, first_line, chat=False)): ...

A jsonl or parquet file's first record decides whether the file holds chats; every record must
then be of that kind. Fields other than the text, chat and META_FIELDS are ignored; `source`
defaults to the file's name. Every bad record is a one-line ValueError naming file and line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from train.data.chat import chat_document
from train.data.documents import Document

META_FIELDS = ("type", "lang", "domain", "source")  # order of the fields in the meta string
BLOCK_BYTES = 1 << 20  # bytes read at a time
PIECE_BYTES = 1 << 16  # a text file is cut into pieces of at most this many bytes
PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Span:
    """Part of a file: bytes [start, stop) of a text file (both at line starts) whose first
    line is line `first`, or row groups [start, stop) of a parquet file whose first row is row
    `first` (1-based, as keys count). `chat`: the file's kind, decided by its first record."""

    start: int
    stop: int
    first: int = 1
    chat: bool | None = None


def blocks(path: Path, start: int = 0, stop: int | None = None,
           digest: Any = None) -> Iterator[bytes]:
    """The bytes [start, stop) of `path` in blocks; `digest` (a hashlib object) sees them all."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            left = float("inf") if stop is None else stop - start
            while left > 0 and (block := f.read(int(min(BLOCK_BYTES, left)))):
                left -= len(block)
                if digest is not None:
                    digest.update(block)
                yield block
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None


def split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (without their newline) of a stream of byte blocks."""
    pending: list[bytes] = []
    for chunk in chunks:
        parts = chunk.split(b"\n")
        pending.append(parts[0])
        if len(parts) > 1:
            yield b"".join(pending)
            yield from parts[1:-1]
            pending = [parts[-1]]
    if tail := b"".join(pending):
        yield tail


def split_pieces(chunks: Iterator[bytes], limit: int = PIECE_BYTES) -> Iterator[bytes]:
    """The stream cut into pieces of at most `limit` bytes: after the last newline in the
    piece's second half, else at the last UTF-8 character boundary. Greedy from the start, so
    the pieces after any piece boundary depend only on the bytes after it."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        pos = 0
        while len(buffer) - pos > limit:
            end = pos + limit
            cut = buffer.rfind(b"\n", pos + limit // 2, end) + 1 or _char_boundary(buffer, end)
            yield buffer[pos:cut]
            pos = cut
        buffer = buffer[pos:]
    if buffer:
        yield buffer


def _char_boundary(data: bytes, at: int) -> int:
    """The largest index <= `at` that does not split a UTF-8 character."""
    for cut in range(at, max(at - 4, 0), -1):
        if data[cut] & 0xC0 != 0x80:  # not a continuation byte
            return cut
    return at


def _decode(data: bytes, where: str, offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {offset + err.start})") \
            from None


def read_txt(path: Path, name: str, span: Span | None = None,
             digest: Any = None) -> Iterator[Document]:
    size = path.stat().st_size
    offset = 0 if span is None else span.start
    stop = size if span is None else span.stop
    for piece in split_pieces(blocks(path, offset, stop, digest)):
        # Universal newlines, as Python reads text files (\r\n and \r become \n).
        text = _decode(piece, str(path), offset).replace("\r\n", "\n").replace("\r", "\n")
        starts, ends = offset == 0, offset + len(piece) == size
        offset += len(piece)
        if starts and ends and not text.strip():
            continue  # a blank file holds no document
        yield Document(name, text, {"type": "Text", "source": name}, starts=starts, ends=ends)


def read_jsonl(path: Path, name: str, span: Span | None = None,
               digest: Any = None) -> Iterator[Document]:
    span = span or Span(0, path.stat().st_size)
    chat = span.chat
    for number, raw in enumerate(split_lines(blocks(path, span.start, span.stop, digest)),
                                 start=span.first):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: malformed JSON ({err.msg})") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not UTF-8 text ({err.reason})") from None
        if _SURROGATE_ESCAPE.search(raw):
            _check_unicode(record, where)
        chat = record_is_chat(record) if chat is None else chat
        doc = record_document(record, f"{name}:{number}", name, chat, where)
        if doc is not None:
            yield doc


# JSON can spell a lone UTF-16 surrogate (`"\ud800"`), which no tokenizer reads as text; a
# cheap look at the line first, the exact check only where one may be.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(record: Any, where: str) -> None:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where}: a string holds a lone UTF-16 surrogate "
                         f"({err.object[err.start]!r}), which is not text; fix or remove it"
                         ) from None


def read_parquet(path: Path, name: str, span: Span | None = None,
                 digest: Any = None) -> Iterator[Document]:
    table = parquet_file(path)
    span = span or Span(0, table.num_row_groups)
    columns = parquet_columns(table, path)
    chat = parquet_is_chat(columns) if span.chat is None else span.chat
    batches = table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns,
                                 row_groups=range(span.start, span.stop))
    number = span.first
    for batch in batches:
        for record in batch.to_pylist():
            doc = record_document(record, f"{name}:{number}", name, chat, f"{path}:row {number}")
            number += 1
            if doc is not None:
                yield doc


def parquet_file(path: Path):
    """A pyarrow ParquetFile; a one-line error if pyarrow is missing or the file unreadable."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading .parquet needs pyarrow; pip install "
                         "'stepjax[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for unreadable files
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None


def parquet_columns(table, path: Path) -> list[str]:
    names = table.schema_arrow.names
    if "text" not in names and "messages" not in names:
        raise ValueError(f"{path}: expected a 'text' column (or 'messages' for chats), found "
                         f"{names}")
    return [c for c in ("text", "messages", "tools", *META_FIELDS) if c in names]


def parquet_is_chat(columns: list[str]) -> bool:
    """A parquet file holds chats if it has a `messages` column and no `text` column."""
    return "messages" in columns and "text" not in columns


def record_is_chat(record: Any) -> bool:
    return isinstance(record, dict) and "messages" in record


def record_document(record: Any, key: str, name: str, chat: bool,
                    where: str) -> Document | None:
    """One jsonl/parquet record as a Document (None for an empty text); a bad record ->
    ValueError prefixed with `where`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    meta = {"source": name}
    meta.update({k: str(record[k]) for k in META_FIELDS if record.get(k) not in (None, "")})
    if chat:
        try:
            return chat_document(record, key, meta)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if not isinstance(record.get("text"), str):
        raise ValueError(f"{where}: expected an object with a string field 'text' (or a "
                         "chat file, whose first record has 'messages')")
    return Document(key, record["text"], meta) if record["text"].strip() else None


READERS: dict[str, Callable[..., Iterator[Document]]] = {
    ".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}


def read_file(path: Path, name: str, span: Span | None = None,
              digest: Any = None) -> Iterator[Document]:
    """The documents of `path` (or of its `span`), keyed by `name` (relative path); `digest`
    sees every byte read (the whole file when `span` is None)."""
    return READERS[path.suffix](path, name, span, digest)
