"""`python -m train.data.prepare`: tokenize a corpus once into token shards that training reads
by random access, with memory that grows with neither the files nor the corpus.

    python -m train.data.prepare --source 'web/*.jsonl,books' --out data/web --workers 16
    python -m train ... train.data.source=data/web          # or train.data.mixture={...}
    python -m train.data.prepare --verify data/web          # re-hash every shard

`--source` takes what `train.data.source` takes (comma-separated files, directories, globs,
`stdlib`, `arith`), plus `.parquet` files (a `text` column, or `messages` for chats; needs
pyarrow). Files are streamed in blocks and cut into units of work (train/data/prepare_plan.py),
tokenized in parallel by `--workers` processes, each writing its unit's shards
(train/data/shards.py) and a `.done` note; `manifest.json` comes last. A re-run over unchanged
input does nothing; after an interruption (Ctrl-C, a full disk, a kill) the same command
tokenizes only the unfinished units. One preparation at a time holds an --out (its `.lock`, as a
training workdir's). Documents and their held-out split (by document key, `--heldout-fraction`)
are exactly those of the raw path, so a run from the prepared directory reads what the same run
from the files would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from model.config import check_open_fraction
from model.config.cli import ArgumentParser, finite_float, report_error
from model.interop.atomic_file import write_text_atomically
from model.interop.io_errors import os_reason
from model.interop.workdir_lock import LOCK_FILE, WorkdirInUse, claimed_workdir
from model.interop.workdir_record import tokenizer_identity
from model.tokenizers.chat import chat_tokenizer_for
from model.tokenizers.text import load_tokenizer
from train.data.config import DataConfig
from train.data.chat import templates_sha256
from train.data.corpus import PROCEDURAL_SOURCES, stdlib_documents
from train.data.documents import heldout_score
from train.data.encoder import DocumentEncoder
from train.data.manifest import (
    COUNTS,
    FORMAT,
    MANIFEST,
    PLAN,
    SPLITS,
    VERSION,
    manifest_problem,
    read_manifest,
)
from train.data.prepare_plan import UNIT_BYTES, describe_inputs, plan_units
from train.data.prepare_pool import run_in_processes
from train.data.readers import Span, read_file
from train.data.shards import SHARDS, ShardWriter, check_shards, token_dtype, verify_shards

REPORT_BYTES = 4 << 20  # a worker reports its progress every this many input bytes


class _Progress:
    """Counts the input bytes a reader reads (it stands in for the reader's hash object) and
    the tokens written, and reports them every REPORT_BYTES bytes / 64k tokens."""

    def __init__(self):
        self.bytes = self.tokens = self.reported_bytes = 0

    def update(self, block: bytes) -> None:
        self.bytes += len(block)
        if self.bytes - self.reported_bytes >= REPORT_BYTES:
            self.flush()

    def add_tokens(self, count: int) -> None:
        self.tokens += count
        if self.tokens >= 1 << 16:
            self.flush()

    def flush(self, input_bytes: int | None = None) -> None:
        done = self.bytes if input_bytes is None else input_bytes
        _worker["progress"].put((done - self.reported_bytes, self.tokens))
        self.reported_bytes, self.tokens = done, 0


def unit_documents(item: dict, unit: dict, progress: _Progress):
    """The documents of one unit of work, in the order a run reads them."""
    if item["entry"] == "stdlib":
        return stdlib_documents()
    if "path" not in item:
        return PROCEDURAL_SOURCES[item["entry"]]()
    return read_file(Path(item["path"]), item["name"], Span(*unit["span"]), digest=progress)


class _InProcessQueue:
    """In-process progress: a queue's `put` that calls `show(input_bytes, tokens)`."""

    def __init__(self, show: Callable[[int, int], None]):
        self.show = show

    def put(self, item: tuple[int, int]) -> None:
        self.show(*item)


_worker: dict = {}  # this process's tokenizer, settings and progress queue


def _init_worker(settings: dict, out: str, progress) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = load_tokenizer(settings["tokenizer"]["name"])
    _worker.update(settings=settings, out=Path(out), progress=progress, tokenizer=tokenizer)


def prepare_unit(number: int, item: dict, unit: dict) -> dict:
    """Tokenizes one unit into `shards/{split}-{number}.*` and notes it done; returns the note."""
    settings, out, tokenizer = _worker["settings"], _worker["out"], _worker["tokenizer"]
    chat = unit["span"] is not None and unit["span"][3]
    encode = DocumentEncoder(tokenizer, meta_tokens=True, assistant_only=True,
                             chat=chat_tokenizer_for(tokenizer) if chat else None)
    dtype = token_dtype(tokenizer.get_vocab_size())
    writers = {s: ShardWriter(out, f"{SHARDS}/{s}-{number:05d}", dtype, chat) for s in SPLITS}
    fraction, progress = settings["heldout_fraction"], _Progress()
    counts = {"documents": 0, "tokens": 0, "heldout_documents": 0, "chats": 0}
    for doc in unit_documents(item, unit, progress):
        example = encode(doc)
        heldout = heldout_score(doc.key) < fraction
        writers[SPLITS[heldout]].add(example["tokens"], int(example["meta_mask"].sum()),
                                     example["loss_mask"] if chat else None, doc.starts)
        counts["documents"] += doc.starts
        counts["heldout_documents"] += doc.starts and heldout
        counts["chats"] += doc.chat is not None
        counts["tokens"] += len(example["tokens"])
        progress.add_tokens(len(example["tokens"]))
    note = {"input": unit["input"], "counts": counts,
            "shards": {s: w.close() for s, w in writers.items()}}
    write_text_atomically(done_note(out, number), json.dumps(note))
    progress.flush(unit["bytes"])
    return note


def done_note(out: Path, number: int) -> Path:
    """The note of unit `number`, written when its shards are (a re-run skips the unit)."""
    return out / SHARDS / f"{number:05d}.done"


def _settings(args, tokenizer) -> dict:
    return {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_identity(tokenizer),
            "heldout_fraction": args.heldout_fraction, "unit_bytes": args.unit_bytes}


def _existing(out: Path, settings: dict, inputs: list[dict], force: bool) -> dict | None:
    """The plan of an unfinished preparation of the same input in `out` (None: start afresh).
    Raises ValueError if `out` holds something else, unless `force` (then it is removed, our
    files only)."""
    stored = None
    for name in (MANIFEST, PLAN):
        if (out / name).is_file():
            stored = _stored(out / name)
            break
    if stored is None:
        _check_empty(out)
        return None
    same = stored.get("settings") == settings and stored.get("inputs") == inputs
    if same:
        return stored
    if not force:
        old = {i.get("path", i["entry"]): i for i in stored.get("inputs", [])}
        new = {i.get("path", i["entry"]): i for i in inputs}
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        what = (stored["unreadable"] if "unreadable" in stored else
                f"input changed: {', '.join(changed[:3])}" if changed else "settings changed")
        raise ValueError(f"--out {out} holds a preparation of other data ({what}); pass "
                         "--force to replace it or choose another --out")
    for name in (MANIFEST, PLAN):
        (out / name).unlink(missing_ok=True)
    for path in (out / SHARDS).glob("*") if (out / SHARDS).is_dir() else ():
        path.unlink()
    return None


def _check_empty(out: Path) -> None:
    if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise ValueError(f"--out {out} is not empty and holds no prepared corpus; choose a "
                         "new or empty directory")


def _stored(path: Path) -> dict:
    """The manifest or plan in `path`, or {"unreadable": why} if it is not one prepare wrote
    (edited or damaged: such a directory is prepared again only with --force)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": f"its {path.name} is unreadable"}
    inputs = stored.get("inputs") if isinstance(stored, dict) else None
    if not (isinstance(inputs, list) and all(isinstance(i, dict) and "entry" in i
                                               for i in inputs)):
        problem = "inputs: not a list of inputs"
    elif path.name == MANIFEST:
        problem = manifest_problem(stored)
    else:
        problem = None if isinstance(stored.get("units"), list) else "units: missing"
    return {"unreadable": f"its {path.name} is damaged ({problem})"} if problem else stored


def run_units(out: Path, settings: dict, inputs: list[dict], units: list[dict], workers: int,
              show: Callable[[int, int], None]) -> None:
    """Tokenizes every unit without a `.done` note, in `workers` processes (1: in this one,
    train/data/prepare_pool.py); `show(input_bytes, tokens)` sees progress."""
    pending = [(n, inputs[u["input"]], u) for n, u in enumerate(units)
               if not done_note(out, n).is_file()]
    if workers <= 1 or len(pending) <= 1:
        _init_worker(settings, str(out), _InProcessQueue(show))
        for args in pending:
            prepare_unit(*args)
        return
    run_in_processes(prepare_unit, pending, workers, _init_worker, (settings, str(out)), show)


def write_manifest(out: Path, source: str, settings: dict, inputs: list[dict],
                   units: list[dict], tokenizer) -> dict:
    notes = [json.loads(done_note(out, n).read_text()) for n in range(len(units))]
    splits = {s: {**dict.fromkeys(COUNTS, 0), "shards": []} for s in SPLITS}
    sources: dict[str, dict] = {}
    for note in notes:
        entry = inputs[note["input"]]["entry"]
        totals = sources.setdefault(entry, {"documents": 0, "tokens": 0, "heldout_documents": 0})
        for key in totals:
            totals[key] += note["counts"][key]
        for split, shard in note["shards"].items():
            if shard is not None:
                for key in COUNTS:
                    splits[split][key] += shard[key]
                splits[split]["shards"].append(shard)
    dtype = token_dtype(tokenizer.get_vocab_size())
    for split in SPLITS:
        check_shards(out, splits[split]["shards"], dtype)
    chats = sum(note["counts"]["chats"] for note in notes)
    manifest = {"format": FORMAT, "version": VERSION, "source": source, "settings": settings,
                "tokenizer": settings["tokenizer"], "dtype": dtype.str,
                "heldout_fraction": settings["heldout_fraction"],
                "heldout_rule": "a document is held out iff sha256(key)[:8] / 2**64 < "
                                "heldout_fraction (train/data/documents.py)",
                "chats": chats,
                "chat_templates_sha256":
                    templates_sha256(chat_tokenizer_for(tokenizer)) if chats else None,
                "sources": sources, "splits": splits, "inputs": inputs}
    write_text_atomically(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    (out / PLAN).unlink(missing_ok=True)
    for stale in (out / SHARDS).glob("*.partial"):
        stale.unlink()
    return manifest


def verify(root: Path, log: Callable[[str], None] = print) -> None:
    """Re-hashes every shard file of `root`; a one-line ValueError names those that differ."""
    manifest = read_manifest(root)
    shards = [s for split in SPLITS for s in manifest["splits"][split]["shards"]]
    check_shards(root, shards, np.dtype(manifest["dtype"]))
    bad = verify_shards(root, shards)
    if bad:
        raise ValueError(f"{root}: {len(bad)} shard file(s) differ from the manifest "
                         f"({', '.join(bad[:3])}); prepare the corpus again with --force")
    log(f"{root}: every shard file of {len(shards)} shards matches the manifest")


def prepare(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Prepares (or finishes, or confirms) `args.out`, holding its lock (one preparation at a
    time: model/interop/workdir_lock.py); returns its manifest."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a new or empty directory")
    if not any((out / name).is_file() for name in (MANIFEST, PLAN)):
        _check_empty(out)  # before the lock file is written there
    tokenizer = load_tokenizer(args.tokenizer)
    inputs = describe_inputs(args.source)
    settings = _settings(args, tokenizer)
    with claimed_workdir(out, option="--out"):
        return _prepare(args, out, tokenizer, inputs, settings, log)


def _prepare(args, out: Path, tokenizer, inputs: list[dict], settings: dict,
             log: Callable[[str], None]) -> dict:
    stored = _existing(out, settings, inputs, args.force)
    if stored is not None and "splits" in stored:
        log(f"{out} is up to date ({_summary(stored)})")
        return stored
    units = stored["units"] if stored is not None else plan_units(inputs, args.unit_bytes)
    if any(u["span"] is not None and u["span"][3] for u in units):
        chat_tokenizer_for(tokenizer)  # chats need a template: a one-line error before any work
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    if stored is None:
        write_text_atomically(out / PLAN, json.dumps(
            {"settings": settings, "inputs": inputs, "units": units}) + "\n")
    done = sum(done_note(out, n).is_file() for n in range(len(units)))
    if done:
        log(f"resuming: {done} of {len(units)} units already prepared")
    start, tokens = time.perf_counter(), [0]
    total = sum(u["bytes"] for u in units)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not args.progress,
              desc="prepare", dynamic_ncols=True) as bar:
        def show(input_bytes: int, new_tokens: int) -> None:
            tokens[0] += new_tokens
            rate = tokens[0] / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{tokens[0] / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tokens/s",
                                refresh=False)
            bar.update(input_bytes)

        run_units(out, settings, inputs, units, args.workers, show)
    manifest = write_manifest(out, args.source, settings, inputs, units, tokenizer)
    seconds = time.perf_counter() - start
    log(f"prepared {out}: {_summary(manifest)} in {seconds:.1f}s "
        f"({tokens[0] / max(seconds, 1e-9) / 1e6:.2f}M tokens/s, {args.workers} worker(s))")
    return manifest


def _summary(manifest: dict) -> str:
    train, held = (manifest["splits"][s] for s in SPLITS)
    return (f"{train['documents'] + held['documents']} documents, "
            f"{(train['tokens'] + held['tokens']) / 1e6:.2f}M tokens, {held['documents']} "
            f"documents held out, {len(train['shards']) + len(held['shards'])} shards")


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.data.prepare", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", metavar="SPEC",
                        help="comma-separated files, directories, globs (.txt, .jsonl, "
                             ".parquet), stdlib, arith, arith_multistep")
    parser.add_argument("--out", type=Path, metavar="DIR", help="the prepared directory")
    parser.add_argument("--tokenizer", default=DataConfig.tokenizer,
                        help="as train.data.tokenizer (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizing processes (default: the cores available, %(default)s)")
    parser.add_argument("--heldout-fraction", type=finite_float,
                        default=DataConfig.heldout_fraction,
                        help="share of documents held out, by key (default: %(default)s; a run "
                             "must set the same train.data.heldout_fraction)")
    parser.add_argument("--unit-mb", type=finite_float, default=UNIT_BYTES / 2**20,
                        help="input MiB per unit of work and shard (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="replace a preparation of other input in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--verify", type=Path, metavar="DIR",
                        help="re-hash every shard of a prepared DIR against its manifest")
    args = parser.parse_args(argv)
    if args.verify is None and (not args.source or args.out is None):
        parser.error("--source and --out are required (or --verify DIR)")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    args.unit_bytes = int(args.unit_mb * 2**20)
    if args.unit_bytes < 1:
        parser.error(f"--unit-mb must be at least one byte (1/1048576), got {args.unit_mb}")
    try:
        if args.verify is not None:
            verify(args.verify)
            return 0
        check_open_fraction("--heldout-fraction", args.heldout_fraction)
        prepare(args)
    except (ValueError, WorkdirInUse) as err:
        return report_error(err)
    except OSError as err:  # disk full, read-only filesystem, ...: the finished units are kept
        where = err.filename or args.verify or args.out
        return report_error(f"{where}: {os_reason(err)}" if err.errno else err)
    except KeyboardInterrupt:
        print("error: interrupted; the units prepared so far are kept: run the same command "
              "again to finish", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
