"""What a training workdir was trained on: `DIR/run_record.json`.

    {"tokenizer": {"name": "default", "sha256": "c483..."},
     "data": {"source": "stdlib", "fingerprint": {"stdlib": {...}, "a.jsonl": {...}}}}

`python -m train` writes it when a run starts (train/loop.py) and checks it on resume; loading
the workdir with another tokenizer (`python -m rl --init-from`, `python -m model.generate
--tokenizer`) is refused, since a model reads another tokenizer's ids as noise. The tokenizer's
`sha256` is `TextTokenizer.fingerprint()` (its vocabulary), so the same name with another file
behind it is caught too. Workdirs written before the record existed have none: nothing is
checked for them.
"""

from __future__ import annotations

import json
from pathlib import Path

from model.interop.atomic_file import write_text_atomically
from model.tokenizers.text import TextTokenizer

RECORD_FILE = "run_record.json"


def read_record(workdir: Path) -> dict | None:
    """The workdir's record, or None if it has none (a workdir of an older stepjax)."""
    path = Path(workdir) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err}); move it away to resume unchecked") \
            from None


def write_record(workdir: Path, record: dict) -> None:
    write_text_atomically(Path(workdir) / RECORD_FILE,
                          json.dumps(record, indent=2, sort_keys=True) + "\n")


def tokenizer_identity(tokenizer: TextTokenizer) -> dict:
    return {"name": tokenizer.name, "sha256": tokenizer.fingerprint()}


def describe_tokenizer(identity: dict) -> str:
    return f"{identity.get('name')!r} (sha256 {str(identity.get('sha256'))[:12]})"


def tokenizer_mismatch(workdir: Path, tokenizer: TextTokenizer) -> str | None:
    """None if `tokenizer` is the one the workdir recorded (or it recorded none), else one
    clause naming both: "tokenizer 'b' (sha256 ...) is not the one DIR was trained with, 'a'
    (sha256 ...)"."""
    recorded = (read_record(workdir) or {}).get("tokenizer")
    if recorded is None or recorded.get("sha256") == tokenizer.fingerprint():
        return None
    return (f"tokenizer {describe_tokenizer(tokenizer_identity(tokenizer))} is not the one "
            f"{workdir} was trained with, {describe_tokenizer(recorded)}")
