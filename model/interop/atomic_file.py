"""Replacing a small text file all at once: a reader (or a crash) sees the old content or the
new, never a mix. The new content goes to a temporary file beside `path`, created like any
other file (the umask's mode, not mkstemp's private 0600), then renamed over `path`."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
