"""`manifest.json` of a prepared directory (train/data/shards.py): read once when a run, a
re-run of `python -m train.data.prepare` or `--verify` opens the directory, and checked field by
field and against itself before anything trusts it.

    manifest = read_manifest(Path("data/web"))   # one-line ValueError naming the bad field
    manifest["splits"]["train"]["records"]       # = the sum over its shards' entries

Every field a reader uses is checked for its kind and range, every shard entry for the name
prepare gives it (`shards/{split}-{unit}`: nothing outside the directory) and its counts, and the
split totals for being the sums of their shards' (a total raised, lowered or a shard entry
deleted is refused: the run would read records that do not exist, or silently fewer). The shard
files themselves are checked against these counts by `shards.check_shards` (sizes) and when first
mapped (train/data/shards.py), `--verify` by their sha256.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

FORMAT = "stepjax-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"  # what an unfinished preparation is doing (train/data/prepare.py)
SPLITS = ("train", "heldout")
TOKEN_DTYPES = ("<u2", "<u4")  # shards.token_dtype's choices
COUNTS = ("records", "documents", "tokens")  # a split's totals, the sums of its shards'
_SHA256 = re.compile(r"[0-9a-f]{64}")
UNIT = r"(\d{5}|[1-9]\d{5,})"  # a unit number as prepare writes it, `{number:05d}`


def is_prepared(entry: str) -> bool:
    """Whether a `train.data.source` entry is a prepared directory."""
    return (Path(entry) / MANIFEST).is_file()


def unfinished_preparation(directory: Path) -> str | None:
    """If `directory` is a preparation that has not finished (a plan, no manifest yet): how to
    finish it, in one line; else None."""
    try:
        plan = json.loads((Path(directory) / PLAN).read_text())
        settings, entries = plan["settings"], [i["entry"] for i in plan["inputs"]]
        command = shlex.join([
            "python", "-m", "train.data.prepare", "--source", ",".join(dict.fromkeys(entries)),
            "--out", str(directory), "--tokenizer", settings["tokenizer"]["name"],
            "--heldout-fraction", str(settings["heldout_fraction"]),
            "--unit-mb", str(settings["unit_bytes"] / 2**20)])  # exact: a power of 2
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # a damaged plan: no command to offer
        command = "python -m train.data.prepare with the --source and --out it was started with"
    return (f"{directory} is a preparation that did not finish (no {MANIFEST} yet); finish it "
            f"by running `{command}` again")


def read_manifest(root: Path) -> dict:
    """The checked manifest of `root` (ValueError, one line, naming the first bad field)."""
    return load_manifest(root)[0]


def load_manifest(root: Path) -> tuple[dict, str]:
    """(the checked manifest of `root`, the sha256 of its bytes)."""
    path = Path(root) / MANIFEST
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err}); re-run `python -m train.data.prepare`") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a manifest of `python -m train.data.prepare`")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path}: format version {manifest.get('version')}, this stepjax reads "
                         f"{VERSION}; re-run `python -m train.data.prepare`")
    problem = manifest_problem(manifest)
    if problem:
        raise ValueError(f"{path}: {problem}; the manifest was edited or damaged: prepare the "
                         "corpus again (`python -m train.data.prepare ... --force`)")
    return manifest, hashlib.sha256(data).hexdigest()


def prepared_fingerprint(root: Path, manifest: dict | None = None,
                         sha256: str | None = None) -> dict[str, dict]:
    """The data fingerprint (train/data/fingerprint.py) of a prepared directory: its manifest's
    sha256 (which covers every shard's) and its size. `manifest`, `sha256`: as `load_manifest`
    returned them, if the caller read it already."""
    if manifest is None or sha256 is None:
        manifest, sha256 = load_manifest(root)
    splits = [manifest["splits"][s] for s in SPLITS]
    return {str(root): {"sha256": sha256, "documents": sum(s["documents"] for s in splits),
                        "tokens": sum(s["tokens"] for s in splits)}}


def _count(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a parsed manifest ("field: problem"), or None."""
    tokenizer = manifest.get("tokenizer")
    if not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("name"), str)
            and isinstance(tokenizer.get("sha256"), str)):
        return _bad("tokenizer", "{name, sha256}", tokenizer)
    if manifest.get("dtype") not in TOKEN_DTYPES:
        return _bad("dtype", f"one of {TOKEN_DTYPES}", manifest.get("dtype"))
    fraction = manifest.get("heldout_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 < fraction < 1:
        return _bad("heldout_fraction", "a number in (0, 1)", fraction)
    if not _count(manifest.get("chats")):
        return _bad("chats", "a count", manifest.get("chats"))
    templates = manifest.get("chat_templates_sha256")
    if manifest["chats"] and not isinstance(templates, str):
        return _bad("chat_templates_sha256", "the templates' sha256", templates)
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        return _bad("splits", "{train, heldout}", splits)
    for split in SPLITS:
        problem = _split_problem(splits.get(split), split)
        if problem:
            return f"splits.{split}{problem}"
    return None


def _split_problem(split: dict, name: str) -> str | None:
    if not isinstance(split, dict):
        return _bad("", "{documents, records, tokens, shards}", split)
    for key in COUNTS:
        if not _count(split.get(key)):
            return _bad(f".{key}", "a count", split.get(key))
    shards = split.get("shards")
    if not isinstance(shards, list):
        return _bad(".shards", "a list", shards)
    stems = set()
    for i, shard in enumerate(shards):
        problem = _shard_problem(shard, name)
        if problem:
            return f".shards[{i}]{problem}"
        if shard["stem"] in stems:
            return f".shards[{i}].stem: {shard['stem']!r} is listed twice"
        stems.add(shard["stem"])
    for key in COUNTS:
        total = sum(shard[key] for shard in shards)
        if split[key] != total:
            return f".{key}: {split[key]}, but its {len(shards)} shard(s) hold {total}"
    return None


def _shard_problem(shard: dict, split: str) -> str | None:
    if not isinstance(shard, dict):
        return _bad("", "a shard entry", shard)
    stem = shard.get("stem")
    if not (isinstance(stem, str) and re.fullmatch(rf"shards/{split}-{UNIT}", stem)):
        return _bad(".stem", f"'shards/{split}-<unit>'", stem)
    if not _count(shard.get("records"), 1):
        return _bad(".records", "a count >= 1", shard.get("records"))
    for key in ("documents", "tokens"):
        if not _count(shard.get(key)):
            return _bad(f".{key}", "a count", shard.get(key))
    if shard["documents"] > shard["records"]:
        return f".documents: {shard['documents']}, more than its {shard['records']} records"
    if not isinstance(shard.get("mask"), bool):
        return _bad(".mask", "true or false", shard.get("mask"))
    kinds = ["tokens", "index", *(["mask"] if shard["mask"] else [])]
    digests = shard.get("sha256")
    if not (isinstance(digests, dict) and sorted(digests) == sorted(kinds) and all(
            isinstance(d, str) and _SHA256.fullmatch(d) for d in digests.values())):
        return _bad(".sha256", f"a sha256 for each of {kinds}", digests)
    return None


def _bad(field: str, expected: str, value) -> str:
    if value is None:
        return f"{field}: missing"
    text = repr(value)
    return f"{field}: expected {expected}, got {text if len(text) <= 60 else text[:57] + '...'}"
