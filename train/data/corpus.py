"""Documents for training: the embedded stdlib corpus and local `.txt` / `.jsonl` files (plain
text, or chats rendered with the tokenizer's chat template: train/data/chat.py).

    docs = load_documents("stdlib")       # or "a.jsonl,books/*.txt", "arith,arith_multistep"
    train, heldout = split_documents(docs, 0.05)          # train.data.documents

A `Document` is its text plus human-readable metadata (report A.3: content type, language,
domain, source) and a stable `key` that decides its split. Loading is eager and validated up
front, so a bad input fails at start-up with one line naming the culprit, not mid-run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterator, Mapping

from train.data.arithmetic import arithmetic_documents
from train.data.chat import chat_document
from train.data.documents import Document
from train.data.multistep import multistep_documents

META_FIELDS = ("type", "lang", "domain", "source")  # order of the fields in the meta string
SUFFIXES = (".txt", ".jsonl")
# Directories of the standard library that are not "the library": third-party packages and the
# (large, repetitive) regression-test suites.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                              "__pycache__"})
# Machine-generated codec tables (encodings/cp1252.py, ...): ~10% of the library's bytes, all
# hex literals; they would teach the model little and skew the tokenizer.
GENERATED_MARKER = "with gencodec.py"
# The procedural tasks' SFT documents (warm-start data for RL), by source name.
PROCEDURAL_SOURCES = {"arith": arithmetic_documents, "arith_multistep": multistep_documents}


def meta_string(meta: Mapping[str, str]) -> str:
    """The human-readable metadata M of report A.3, e.g. `type=Code lang=python source=json/x.py`.
    Values are single-lined so M never spans lines."""
    return " ".join(f"{k}={' '.join(str(meta[k]).split())}" for k in META_FIELDS if meta.get(k))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> list[Document]:
    """The running Python's standard-library `.py` sources (no tests, site-packages or generated
    codec tables), sorted by relative path: real code on every machine, no download."""
    root = stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    docs = []
    for rel in sorted(p.relative_to(root).as_posix() for p in paths):
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        if text.strip() and GENERATED_MARKER not in text[:300]:
            docs.append(Document(rel, text, {"type": "Code", "lang": "python", "source": rel}))
    if not docs:
        raise ValueError(f"train.data.source: no .py files found in the standard library at {root}")
    return docs


def resolve_files(entry: str) -> list[tuple[Path, str]]:
    """One comma-separated item of `DataConfig.source`: a file, a directory (its `.txt` /
    `.jsonl` files, recursively) or a glob -> sorted (path, name) pairs, never empty. `name` is
    the path relative to the entry's base directory (the glob's fixed prefix, the directory, or
    the file's own directory), so splits and metadata do not depend on where the data lives."""
    if glob.has_magic(entry):
        base = Path(*(_prefix_parts(entry) or ["."]))
        files = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"train.data.source: glob {entry!r} matched no files")
    elif Path(entry).is_dir():
        base = Path(entry)
        files = sorted(p for p in base.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"train.data.source: directory {entry!r} has no .txt/.jsonl files")
    elif Path(entry).is_file():
        base, files = Path(entry).parent, [Path(entry)]
    else:
        raise ValueError(f"train.data.source: {entry!r} does not exist")
    for path in files:
        if path.suffix not in SUFFIXES:
            raise ValueError(f"train.data.source: {str(path)!r} is neither .txt nor .jsonl")
    return [(path, path.relative_to(base).as_posix()) for path in files]


def _prefix_parts(pattern: str) -> list[str]:
    """Leading path components of a glob pattern that hold no wildcard."""
    parts = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return parts


def read_txt(path: Path, name: str) -> Iterator[Document]:
    """The whole file is one document."""
    text = _read_text(path)
    if text.strip():
        yield Document(name, text, {"type": "Text", "source": name})


def read_jsonl(path: Path, name: str) -> Iterator[Document]:
    """One document per line: plain text `{"text": ..., "type"?, "lang"?, "domain"?, "source"?}`
    or a chat `{"messages": [...], "tools"?: [...]}` (train/data/chat.py). The file's first
    record decides which; every record must then be of that kind. Other fields are ignored,
    `source` defaults to the file's name."""
    is_chat = None
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: malformed JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if _SURROGATE_ESCAPE.search(line):
            _check_unicode(record, where)
        is_chat = "messages" in record if is_chat is None else is_chat
        meta = {"source": name}
        meta.update({k: str(record[k]) for k in META_FIELDS if record.get(k) not in (None, "")})
        if is_chat:
            try:
                yield chat_document(record, f"{name}:{number}", meta)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            continue
        if not isinstance(record.get("text"), str):
            raise ValueError(f"{where}: expected an object with a string field 'text' (or a "
                             "chat file, whose first record has 'messages')")
        if record["text"].strip():
            yield Document(f"{name}:{number}", record["text"], meta)


# JSON can spell a lone UTF-16 surrogate (`"\ud800"`), which no tokenizer reads as text; a
# cheap look at the line first, the exact check only where one may be.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_unicode(record: dict, where: str) -> None:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where}: a string holds a lone UTF-16 surrogate "
                         f"({err.object[err.start]!r}), which is not text; fix or remove it"
                         ) from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None


def load_documents(source: str) -> list[Document]:
    """`source`: `stdlib`, `arith` / `arith_multistep` (the procedural tasks of
    `train.data.arithmetic` / `train.data.multistep`: SFT warm-start data for RL) and/or
    comma-separated `.txt`/`.jsonl` paths, directories, globs."""
    entries = [e.strip() for e in source.split(",") if e.strip()]
    if not entries:
        raise ValueError("train.data.source: empty; use 'stdlib' or paths/globs of .txt/.jsonl")
    docs, seen = [], set()
    for entry in entries:
        if entry == "stdlib":
            docs += stdlib_documents()
            continue
        if entry in PROCEDURAL_SOURCES:
            docs += PROCEDURAL_SOURCES[entry]()
            continue
        files = [(p, name) for p, name in resolve_files(entry) if p.resolve() not in seen]
        seen.update(p.resolve() for p, _ in files)
        found = [d for p, name in files
                 for d in (read_txt if p.suffix == ".txt" else read_jsonl)(p, name)]
        if files and not found:
            raise ValueError(f"train.data.source: {entry!r} holds no non-empty documents")
        docs += found
    return docs
