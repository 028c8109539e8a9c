"""What a workdir records of its run: the tokenizer and data it trains on, recorded at the first
start and checked when it resumes (`model.interop.workdir_record` holds the file's layout), and
the resolved run config, `WORKDIR/config.yaml` (`write_run_config`).

A resumed run whose tokenizer is another (same name, other vocabulary) is refused; one whose
data files changed is refused unless the user allows it (`python -m train --allow-data-change`),
which records the new data. A workdir of an older stepjax has no record: it resumes unchecked
and gets one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from model.config import config_yaml
from model.interop.atomic_file import write_text_atomically
from model.interop.workdir_record import (
    read_record,
    tokenizer_identity,
    tokenizer_mismatch,
    write_record,
)
from model.tokenizers.chat import ChatTokenizer
from model.tokenizers.text import TextTokenizer
from train.data.config import DataConfig
from train.data.chat import templates_sha256
from train.data.fingerprint import data_changes, data_fingerprint

ALLOW_FLAG = "--allow-data-change"
CONFIG_FILE = "config.yaml"
CHAT_TEMPLATE = "chat template"  # the fingerprint's entry for the templates rendering chats


def check_and_record(workdir: Path, tokenizer: TextTokenizer, data: DataConfig,
                     chat: ChatTokenizer | None = None, *, resuming: bool,
                     allow_data_change: bool, write: bool,
                     fingerprint: dict | None = None) -> str | None:
    """Raises ValueError (one line) if a resumed run's tokenizer or data differ from the
    record; writes the record (`write`: this process writes the workdir) unless it is
    unchanged. `chat`: the chat tokenizer rendering the run's raw chat data, whose templates
    are part of the data (another template is other text; a prepared directory's fingerprint
    covers the template it was rendered with). `fingerprint`: the data's, if already taken
    when the data was opened (train/data/sources.py). Returns a one-line note for the user,
    or None."""
    if fingerprint is None:
        fingerprint = {k: v for source in (data.mixture or [data.source])
                       for k, v in data_fingerprint(source).items()}
    fingerprint = dict(fingerprint)
    if chat is not None:
        fingerprint[CHAT_TEMPLATE] = {"sha256": templates_sha256(chat)}
    source = {"mixture": dict(data.mixture)} if data.mixture else {"source": data.source}
    current = {"tokenizer": tokenizer_identity(tokenizer),
               "data": {**source, "fingerprint": fingerprint}}
    recorded = read_record(workdir) if resuming else None
    note = None
    if resuming and recorded is None:
        note = (f"note: {workdir} has no record of its tokenizer and data (written by an older "
                "stepjax); resuming unchecked and recording the current ones")
    elif recorded is not None:
        mismatch = tokenizer_mismatch(workdir, tokenizer)
        if mismatch:
            raise ValueError(f"cannot resume: {mismatch}; restore that tokenizer or use "
                             "another --workdir")
        changes = data_changes(recorded.get("data", {}).get("fingerprint", {}),
                               current["data"]["fingerprint"])
        if changes and not allow_data_change:
            raise ValueError(f"cannot resume {workdir}: its data changed since the run started: "
                             f"{_listed(changes)}; restore the data, or pass {ALLOW_FLAG} to "
                             "continue on the new data")
        if changes:
            note = (f"note: {workdir} continues on changed data ({_listed(changes)}); recorded "
                    "the new data fingerprint")
        elif recorded == current:
            return None
    if write:
        write_record(workdir, current)
    return note


def _listed(changes: list[str], shown: int = 3) -> str:
    more = len(changes) - shown
    return ", ".join(changes[:shown]) + (f" and {more} more" if more > 0 else "")


def write_run_config(workdir: Path, values: Mapping[str, Any], command: str) -> None:
    """`WORKDIR/config.yaml`: the resolved config of the run `command` starts (every field,
    defaults and derived sizes included), which `command --config` reads back to the same run.
    Rewritten at every start, atomically: a resumed run's config has passed the checkpoint's
    check by then, so the file changes only where a resume may (run length, logging, ...)."""
    header = (f"The resolved config of this run, written by {command} at its latest start;\n"
              f"{command} --config {Path(workdir) / CONFIG_FILE} ... reads it back.")
    write_text_atomically(Path(workdir) / CONFIG_FILE, config_yaml(values, header))
