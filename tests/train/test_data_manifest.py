"""A prepared directory is not trusted: its manifest is checked field by field and against
itself (train/data/manifest.py) wherever it is opened, opening it reads no shard and keeps a few
numbers per shard, and a damaged shard is named when it is read, the first batch before
anything compiles. Also the one-line errors for a tokenizer directory without a tokenizer.json
and a preparation that did not finish. Tiny corpora in tmp_path; nothing compiles."""

from __future__ import annotations

import gc
import hashlib
import json
import shlex
import shutil
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from shard_helpers import prepared, write_corpus
from train_helpers import SMALL_LOOP, TINY, small_run

import train.data.prepare as prepare_module
from model.interop.workdir_record import tokenizer_identity
from model.tokenizers.text import load_tokenizer
from train.__main__ import main as train_main
from train.config import DataConfig
from train.data.corpus import load_corpus
from train.data.manifest import FORMAT, VERSION
from train.data.shards import ShardSplit
from train.data.sources import check_data, open_data
from train.loop import Trainer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("manifest")
    source = write_corpus(root / "raw")
    prepared(source, root / "prepared")
    return source, root / "prepared"


def edited_copy(good: Path, out: Path, edit) -> Path:
    shutil.copytree(good, out)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def train_split(m: dict) -> dict:
    return m["splits"]["train"]


# (edit, what the error names): each once read a wrong number of records, or failed with a
# KeyError / TypeError / IndexError after the compile.
DAMAGE = [
    (lambda m: train_split(m).update(records=train_split(m)["records"] + 10),
     "splits.train.records: "),
    (lambda m: train_split(m).update(records=5), "splits.train.records: 5, but its "),
    (lambda m: train_split(m)["shards"].pop(), "splits.train.records: "),
    (lambda m: m.pop("splits"), "splits: missing"),
    (lambda m: m.pop("tokenizer"), "tokenizer: missing"),
    (lambda m: m.update(dtype="garbage"), "dtype: expected one of ('<u2', '<u4'), got 'garbage'"),
    (lambda m: train_split(m)["shards"][0].update(stem="../../elsewhere"),
     "splits.train.shards[0].stem: expected 'shards/train-<unit>'"),
    (lambda m: train_split(m)["shards"][0].update(tokens="many"),
     "splits.train.shards[0].tokens: expected a count"),
]


def test_a_damaged_manifest_is_refused_by_field_wherever_it_is_opened(corpus, tmp_path, tok,
                                                                       capsys):
    source, good = corpus
    for number, (edit, needle) in enumerate(DAMAGE):
        out = edited_copy(good, tmp_path / f"case{number}", edit)
        cfg = DataConfig(source=str(out), heldout_fraction=0.3)
        with pytest.raises(ValueError) as err:
            check_data(open_data(cfg, tok), cfg, tok, loss_mask="auto", heldout=True)
        message = str(err.value)
        assert "\n" not in message and f"{out / 'manifest.json'}: {needle}" in message, message
        assert "edited or damaged" in message
        assert prepare_module.main(["--verify", str(out)]) == 2
        assert needle in one_line(capsys)
    # A re-run of prepare does not take it for its own finished work (nor crash on it).
    with pytest.raises(ValueError, match=r"its manifest.json is damaged \(splits.train.records"):
        prepared(source, tmp_path / "case0")
    # The manifest's dtype must be the tokenizer's (a wider one would read other ids).
    out = edited_copy(good, tmp_path / "wide", lambda m: m.update(dtype="<u4"))
    with pytest.raises(ValueError, match=r"dtype: '<u4' does not hold the tokenizer's 4096 ids"):
        open_data(DataConfig(source=str(out), heldout_fraction=0.3), tok)
    # Through the command line: exit 2, one line naming the field, before any work, and no
    # workdir left behind.
    workdir = tmp_path / "run"
    code = train_main(["--config", str(TINY), "--workdir", str(workdir), *SMALL_LOOP,
                       f"train.data.source={tmp_path / 'case1'}", "train.data.heldout_fraction=0.3"])
    assert code == 2 and "splits.train.records: 5, but its" in one_line(capsys)
    assert not workdir.exists()


def write_shards(root: Path, count: int, tok) -> Path:
    """A prepared directory of `count` one-record train shards (and one held-out), laid out as
    train/data/shards.py documents (written here, not by prepare: thousands of units would
    take prepare minutes of fsyncs)."""
    (root / "shards").mkdir(parents=True)
    rng = np.random.default_rng(0)

    def shard(split: str, unit: int) -> dict:
        stem = f"shards/{split}-{unit:05d}"
        files = {"tokens": rng.integers(3, 4096, 50).astype("<u2").tobytes(),
                 "index": np.array([[50, 0]], "<i8").tobytes()}
        for kind, data in files.items():
            (root / f"{stem}.{kind}").write_bytes(data)
        return {"stem": stem, "records": 1, "documents": 1, "tokens": 50, "mask": False,
                "sha256": {k: hashlib.sha256(d).hexdigest() for k, d in files.items()}}

    splits = {}
    for split, units in (("train", range(count)), ("heldout", [count])):
        shards = [shard(split, u) for u in units]
        splits[split] = {"documents": len(shards), "records": len(shards),
                         "tokens": 50 * len(shards), "shards": shards}
    identity = tokenizer_identity(tok)
    (root / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "tokenizer": identity, "dtype": "<u2",
        "heldout_fraction": 0.05, "chats": 0, "chat_templates_sha256": None, "splits": splits,
        "settings": {}, "inputs": []}))
    return root


def test_opening_reads_no_shard_and_keeps_a_few_numbers_per_shard(tmp_path, tok):
    """What a run holds after opening a prepared directory must not grow with the corpus
    beyond a few numbers per shard, and opening must not read the shards: a 1 TB corpus opens
    as fast as a small one. Shards are named `shards/...`: an open of one is seen by Python's
    audit hook on file opens (every open, whatever module makes it)."""
    opened, recording = [], False
    sys.addaudithook(lambda event, args: recording and event == "open" and opened.append(args[0]))
    held = {}
    for count in (10, 400):
        root = write_shards(tmp_path / f"shards{count}", count, tok)
        cfg = DataConfig(source=str(root))
        gc.collect()
        tracemalloc.start()
        recording = True
        data = open_data(cfg, tok)
        check_data(data, cfg, tok, loss_mask="auto", heldout=True)
        recording = False
        gc.collect()
        held[count] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert data.sources[str(root)].split_sizes(0.05) == (count, 1)
        del data
    assert not [p for p in opened if "/shards/" in str(p)], opened[:3]
    # The manifest's entries took ~900 bytes a shard when they were kept.
    per_shard = (held[400] - held[10]) / 390
    assert per_shard < 300, f"{per_shard:.0f} bytes held per shard"


def test_damaged_shards_are_named_when_read_and_the_first_batch_before_compiling(corpus,
                                                                                  tmp_path, tok):
    _, good = corpus
    out = tmp_path / "data"
    shutil.copytree(good, out)
    manifest = json.loads((out / "manifest.json").read_text())
    stem = manifest["splits"]["train"]["shards"][0]["stem"]
    tokens = np.fromfile(out / f"{stem}.tokens", "<u2")
    tokens[::7] = 65000  # same size: only --verify's hashes or the reader can see it
    tokens.tofile(out / f"{stem}.tokens")
    run = small_run(f"train.data.source={out}", "train.data.heldout_fraction=0.3", vocab=4096)
    workdir = tmp_path / "run"
    workdir.mkdir()
    with pytest.raises(ValueError, match=rf"^{out / stem}.tokens: record 0 holds token id 65000, "
                                         r"outside the tokenizer's 4096 ids; the shard is "
                                         r"damaged: check the directory with `python -m "
                                         rf"train.data.prepare --verify {out}`$"):
        Trainer(run, workdir)  # builds the run, compiles nothing
    # An index that does not end where its tokens do: named when the shard is first mapped.
    index = np.fromfile(out / f"{stem}.index", "<i8")
    index[-2] += 1
    index.tofile(out / f"{stem}.index")
    split = ShardSplit(out, manifest["splits"]["train"]["shards"], np.dtype("<u2"), 4096)
    with pytest.raises(ValueError, match=rf"^{out / stem}.index: corrupt index \(ends at token "):
        split.record(0)


def test_a_tokenizer_directory_without_a_tokenizer_json_says_so(tmp_path):
    with pytest.raises(ValueError, match=rf"^train.data.tokenizer: '{tmp_path}' is a directory "
                                         "without a tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_an_unfinished_preparation_says_how_to_finish_it(corpus, tmp_path):
    source, _ = corpus
    out = tmp_path / "half"
    calls = []

    def interrupted(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(args)
        return original(*args)

    original = prepare_module.prepare_unit
    prepare_module.prepare_unit = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            prepared(source, out)
    finally:
        prepare_module.prepare_unit = original
    with pytest.raises(ValueError) as err:
        load_corpus(str(out))
    command = shlex.join(["python", "-m", "train.data.prepare", "--source", source, "--out",
                          str(out), "--tokenizer", "default", "--heldout-fraction", "0.3",
                          "--unit-mb", str(40_000 / 2**20)])
    assert str(err.value) == (f"train.data.source: {out} is a preparation that did not finish "
                              f"(no manifest.json yet); finish it by running `{command}` again")
