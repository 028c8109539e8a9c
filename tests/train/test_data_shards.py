"""Prepared token shards (`python -m train.data.prepare`, train/data/shards.py) and what trains
from them: a prepared directory reads exactly like its raw files (train and held-out streams,
metadata switch, chat masks), hosts read disjoint records, the stream resumes exactly, mixtures
interleave sources by weight and report the realised shares, prepare resumes and never
overwrites other data, and bad prepared data fails in one line before anything compiles. The raw
path reads every file once and a long text file in bounded pieces. Tiny corpora in tmp_path;
nothing compiles (the trainer is built, never stepped)."""

from __future__ import annotations

import hashlib
import itertools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from shard_helpers import SAMPLE, prepared, write_corpus
from train_helpers import SMALL_LOOP, TINY

import train.data.pipeline as pipeline
import train.data.prepare as prepare_module
import train.data.readers as readers
from model.config import ConfigError
from model.tokenizers.chat import chat_tokenizer_for
from model.tokenizers.text import load_tokenizer
from train.__main__ import main as train_main
from train.config import DataConfig, load_run_config
from train.data.corpus import load_corpus
from train.data.documents import Document, heldout_score, split_documents
from train.data.encoder import DocumentEncoder
from train.data.packing import FEATURES
from train.data.pipeline import make_dataset
from train.data.readers import PIECE_BYTES
from train.data.shards import ShardSplit
from train.data.sources import check_data, open_data
from train.loop import Trainer
from train.run_record import check_and_record


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def batches(cfg: DataConfig, tok, n=None, **kwargs) -> list[dict]:
    kwargs = {"seq_len": 64, "batch_size": 3, "split": "train", "seed": 5, **kwargs}
    return list(itertools.islice(make_dataset(cfg, tok, **kwargs), n))


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == sorted(FEATURES)
        for k in FEATURES:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, Path, dict]:
    """(raw source, its prepared directory, manifest): several units per file (40 kB units)."""
    root = tmp_path_factory.mktemp("shards")
    source = write_corpus(root / "raw")
    manifest = prepared(source, root / "prepared")
    return source, root / "prepared", manifest


def test_prepared_directory_reads_exactly_like_its_raw_files(corpus, tok):
    source, out, manifest = corpus
    raw_docs = load_corpus(source).documents
    for meta_tokens in (True, False):
        raw = DataConfig(source=source, heldout_fraction=0.3, meta_tokens=meta_tokens)
        shards = DataConfig(source=str(out), heldout_fraction=0.3, meta_tokens=meta_tokens)
        for split, n in (("train", 40), ("heldout", None)):
            assert_same(batches(raw, tok, n, split=split), batches(shards, tok, n, split=split))
    # The manifest counts what the raw path reads: documents (the long file once, in pieces),
    # held-out documents by key, tokens per source entry.
    train, heldout = split_documents(raw_docs, 0.3)
    encode = DocumentEncoder(tok, True)
    pieces = [d for d in raw_docs if d.key == "long.txt"]
    assert len(pieces) == 4 and [(d.starts, d.ends) for d in pieces] == [
        (True, False), (False, False), (False, False), (False, True)]
    assert manifest["splits"]["heldout"]["records"] == len(heldout) > 3
    assert manifest["splits"]["train"]["records"] == len(train)
    entries = source.split(",")
    assert manifest["sources"][entries[1]] == {
        "documents": 30, "heldout_documents": sum(heldout_score(f"records.jsonl:{n}") < 0.3
                                                  for n in [*range(1, 6), *range(7, 32)]),
        "tokens": sum(len(encode(d)["tokens"]) for d in raw_docs if d.key.startswith("records"))}
    assert manifest["sources"][entries[0]]["documents"] == 13
    assert len(manifest["splits"]["train"]["shards"]) > 3  # 40 kB units: several per file


def test_hosts_read_disjoint_records_and_the_stream_resumes(corpus, tok, monkeypatch):
    _, out, manifest = corpus
    cfg = DataConfig(source=str(out), heldout_fraction=0.3)
    read = []
    original = ShardSplit.record
    monkeypatch.setattr(ShardSplit, "record", lambda self, i: read.append(i) or original(self, i))
    batches(cfg, tok, 20, shard_index=1, shard_count=3)
    assert read and all(i % 3 == 1 for i in read)  # host 1 of 3 reads only its records
    monkeypatch.undo()
    # Held-out: the hosts' streams split the documents between them.
    whole = batches(cfg, tok, split="heldout", batch_size=1)
    parts = [batches(cfg, tok, split="heldout", batch_size=1, shard_index=i, shard_count=2)
             for i in range(2)]
    tokens = lambda bs: sorted(int(t) for b in bs for t in b["tokens"][b["segment_ids"] > 0])
    assert tokens(parts[0] + parts[1]) == tokens(whole)
    # Exact resume from the iterator's (JSON) state, across epochs of the train split.
    shape = {"seq_len": 1024, "batch_size": 4}
    reference = batches(cfg, tok, 45, **shape)
    assert sum(b["tokens"].size for b in reference) > 2 * manifest["splits"]["train"]["tokens"]
    for k in (0, 7, 33):
        it = make_dataset(cfg, tok, split="train", seed=5, **shape)
        list(itertools.islice(it, k))
        state = json.loads(json.dumps(it.get_state()))
        resumed = make_dataset(cfg, tok, split="train", seed=5, **shape)
        resumed.set_state(state)
        assert_same(list(itertools.islice(resumed, 10)), reference[k:k + 10])
    # A split pickles without its memory maps (grain worker processes) and reads the same.
    split = ShardSplit(out, manifest["splits"]["train"]["shards"], np.dtype("<u2"))
    expected = [np.array(split.record(i)[0]) for i in (0, 5, len(split) - 1)]
    copy = pickle.loads(pickle.dumps(split))
    assert not copy._maps
    for i, e in zip((0, 5, len(split) - 1), expected):
        np.testing.assert_array_equal(copy.record(i)[0], e)


def write_chats(path: Path, count: int = 12) -> Path:
    chat = [{"role": "system", "content": "You add numbers."}]
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"messages": chat + [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": str(2 * i)}]}) + "\n")
    return path


@pytest.mark.parametrize("loss_mask", ["auto", "all"])
def test_prepared_chats_keep_their_assistant_masks(tmp_path, tok, loss_mask):
    source = str(write_chats(tmp_path / "chats.jsonl"))
    manifest = prepared(source, tmp_path / "out", fraction=0.5)
    assert manifest["chats"] == 12 and manifest["splits"]["train"]["shards"][0]["mask"]
    # No row shuffle: its window would have the raw path render ~6k chats first (~1 min).
    for split in ("train", "heldout"):
        raw = batches(DataConfig(source=source, heldout_fraction=0.5, shuffle=False), tok, 8,
                      split=split, loss_mask=loss_mask)
        assert_same(raw, batches(DataConfig(source=str(tmp_path / "out"), heldout_fraction=0.5,
                                            shuffle=False), tok, 8, split=split,
                                 loss_mask=loss_mask))
    assert (loss_mask == "all") == all(b["loss_mask"][b["segment_ids"] > 0].all() for b in raw)


def test_parquet_text_and_chat_columns(tmp_path, tok, monkeypatch):
    import pyarrow as pa  # the dev extra installs it (stepjax[parquet] for users)
    import pyarrow.parquet as pq

    texts = [SAMPLE[i * 90:i * 90 + 40 + i] for i in range(25)]
    pq.write_table(pa.table({"text": texts, "lang": ["EN"] * 25}), tmp_path / "t.parquet",
                   row_group_size=4)
    chats = [json.loads(line)
             for line in write_chats(tmp_path / "c.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"messages": [c["messages"] for c in chats]}), tmp_path / "c.parquet")
    manifest = prepared(f"{tmp_path}/*.parquet", tmp_path / "out", fraction=0.4, unit_bytes=200)
    assert manifest["sources"][f"{tmp_path}/*.parquet"]["documents"] == 37
    assert manifest["chats"] == 12
    # Every record is the encoder's output for the row's document, keyed name:row.
    chat_tok = chat_tokenizer_for(tok)
    expected = [Document(f"c.parquet:{i + 1}", "", {"source": "c.parquet"},
                         chat={"messages": c["messages"], "tools": None})
                for i, c in enumerate(chats)]
    expected += [Document(f"t.parquet:{i + 1}", t, {"source": "t.parquet", "lang": "EN"})
                 for i, t in enumerate(texts)]
    encode = DocumentEncoder(tok, True, chat_tok, assistant_only=True)
    out = open_data(DataConfig(source=str(tmp_path / "out"), heldout_fraction=0.4), tok)
    (source,) = out.sources.values()
    for split, docs in zip(("train", "heldout"), split_documents(expected, 0.4)):
        read = source.example_fn(split, tok, True, True)
        assert len(source.split_records(split, 0.4)) == len(docs)
        for i, doc in enumerate(docs):
            for k, v in encode(doc).items():
                np.testing.assert_array_equal(read(i)[k], v, err_msg=f"{doc.key} {k}")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"t.parquet: reading .parquet needs pyarrow; pip "
                                         r"install 'stepjax\[parquet\]'$"):
        list(readers.read_parquet(tmp_path / "t.parquet", "t.parquet"))


def test_prepare_reruns_resumes_and_never_overwrites_other_data(tmp_path, monkeypatch, capsys):
    source = write_corpus(tmp_path / "raw")
    reference = prepared(source, tmp_path / "reference")
    out, logs = tmp_path / "out", []
    # Interrupted after three units: the re-run prepares only the others.
    calls = []
    original = prepare_module.prepare_unit

    def interrupted(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(prepare_module, "prepare_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepared(source, out)
    assert not (out / "manifest.json").exists()
    calls.clear()
    monkeypatch.setattr(prepare_module, "prepare_unit",
                        lambda *a: calls.append(a[0]) or original(*a))
    manifest = prepared(source, out, log=logs.append)
    units = len(json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"])
    assert logs[0].startswith("resuming: 3 of ") and calls[0] == 3 and len(calls) >= units - 3
    assert manifest["splits"] == reference["splits"]  # the same shards, byte for byte (sha256)
    assert not list(out.rglob("*.partial")) and not (out / "plan.json").exists()
    calls.clear()  # unchanged input: nothing to do, nothing written
    stamp = (out / "manifest.json").stat().st_mtime_ns
    prepared(source, out, log=logs.append)
    assert not calls and "is up to date" in logs[-1]
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    # Changed input: refused (one line, exit 2) unless --force.
    (tmp_path / "raw" / "doc03.txt").write_text("changed\n")
    code = prepare_module.main(["--source", source, "--out", str(out), "--workers", "1",
                                "--heldout-fraction", "0.3", "--unit-mb", str(40_000 / 2**20)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "doc03.txt" in err[0] and "--force" in err[0], err
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    assert prepared(source, out, force=True)["splits"] != reference["splits"]
    (tmp_path / "mine").mkdir()  # a directory holding anything else is never written to
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not empty and holds no prepared corpus"):
        prepared(source, tmp_path / "mine", force=True)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_bad_prepared_data_is_one_line_before_any_work(corpus, tmp_path, tok, capsys):
    source, good, _ = corpus
    out = tmp_path / "copy"
    prepared(source, out)
    shard = next((out / "shards").glob("train-*.tokens"))
    data = lambda **kw: DataConfig(**{"source": str(out), "heldout_fraction": 0.3, **kw})

    def refused(cfg, *needles, tokenizer=tok):
        with pytest.raises(ValueError) as err:
            check_data(open_data(cfg, tokenizer), cfg, tokenizer, loss_mask="auto",
                       heldout=True)
        message = str(err.value)
        assert "\n" not in message and all(n in message for n in needles), message

    refused(data(heldout_fraction=0.05), f"train.data.source {str(out)!r}: prepared with "
            "--heldout-fraction 0.3; set train.data.heldout_fraction=0.3")
    refused(data(), "prepared with tokenizer 'default'", "train.data.tokenizer=default",
            tokenizer=load_tokenizer("arith_chars"))
    refused(data(source=f"{good},{source}"), "combine several with train.data.mixture")
    refused(DataConfig(mixture={str(good): 1.0, str(out): 2.0}, heldout_fraction=0.05),
            f"train.data.mixture {str(good)!r}", "--heldout-fraction 0.3")
    for weight in (0, None, ""):  # `a:` in YAML is None
        with pytest.raises(ConfigError, match=rf"^train.data.mixture\['a'\]: must be a positive "
                                              rf"number, got {weight!r}$"):
            DataConfig(mixture={"a": weight, "b": 1})
    with pytest.raises(ConfigError, match="takes the place of train.data.source"):
        DataConfig(mixture={"a": 1}, source="b.txt")
    content = shard.read_bytes()
    shard.write_bytes(content[:-2])
    refused(data(), str(shard), "corrupt shard", "re-run `python -m train.data.prepare`")
    shard.unlink()
    refused(data(), str(shard), "shard file missing")
    # Through the command line: exit 2, one line, nothing written, nothing compiled.
    workdir = tmp_path / "run"
    code = train_main(["--config", str(TINY), "--workdir", str(workdir), *SMALL_LOOP,
                       f"train.data.source={out}", "train.data.heldout_fraction=0.3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "shard file missing" in err[0], err
    assert not (workdir / "run_record.json").exists()
    # A shard whose bytes changed at the same size: the manifest's hashes catch it.
    shard.write_bytes(content[:-2] + bytes(255 - b for b in content[-2:]))
    assert prepare_module.main(["--verify", str(out)]) == 2
    assert "differ from the manifest" in capsys.readouterr().err


def test_a_resume_refuses_shards_prepared_again(corpus, tmp_path, tok):
    source, _, _ = corpus
    out = tmp_path / "data"
    prepared(source, out)
    cfg = DataConfig(source=str(out), heldout_fraction=0.3)
    record = dict(resuming=False, allow_data_change=False, write=True)
    fingerprint = open_data(cfg, tok).fingerprint
    assert check_and_record(tmp_path, tok, cfg, fingerprint=fingerprint, **record) is None
    Path(source.split(",")[1]).write_text('{"text": "other data"}\n')
    prepared(source, out, force=True)
    changed = open_data(cfg, tok).fingerprint
    with pytest.raises(ValueError, match=rf"its data changed since the run started: {out} "
                                         r"\(documents 43 -> 14, tokens \d+ -> \d+\)"):
        check_and_record(tmp_path, tok, cfg, fingerprint=changed, **{**record, "resuming": True})


def test_mixture_interleaves_sources_by_weight_and_reports_the_shares(tmp_path, tok,
                                                                     monkeypatch):
    """Two prepared sources of disjoint tokens ('a' and 'b' runs), weights 1:3: every row comes
    from one source, in proportion 1:3 up to the row shuffle's window; the realised shares are
    counted right and resume with the state; held-out rows come from both; the trainer reports
    the shares as metrics data/mix/<source>."""
    monkeypatch.setattr(pipeline, "SHUFFLE_WINDOW_TOKENS", 1024)  # a few rows: quick to fill
    dirs, letters = {}, {}
    for letter, count in (("a", 4), ("b", 9)):
        raw = tmp_path / f"raw_{letter}"
        raw.mkdir()
        texts = [letter * (150 + 70 * i) for i in range(count)]
        for i, text in enumerate(texts):
            (raw / f"{i}.txt").write_text(text)
        letters[letter] = {t for text in texts for t in tok.encode(text).tolist()}
        dirs[letter] = tmp_path / letter
        prepared(str(raw), dirs[letter], fraction=0.2)
    cfg = DataConfig(mixture={str(dirs["a"]): 1.0, str(dirs["b"]): 3.0}, heldout_fraction=0.2,
                     meta_tokens=False)
    assert not letters["a"] & letters["b"]
    kinds = lambda bs: ["a" if r <= letters["a"] else "b" if r <= letters["b"] else "?"  # noqa
                        for b in bs for t, s in zip(b["tokens"], b["segment_ids"])
                        if (r := set(t[s > 0].tolist()) - {tok.eos_id})]
    it = make_dataset(cfg, tok, seq_len=32, batch_size=8, split="train", seed=1)
    kind = kinds(itertools.islice(it, 50))
    # 400 rows, 1:3 exactly as mixed; the row shuffle's 32-row window moves a few across
    assert "?" not in kind and abs(kind.count("a") - 100) <= 32
    assert it.mixture_shares() == {"a": kind.count("a") / 400, "b": kind.count("b") / 400}
    state = json.loads(json.dumps(it.get_state()))
    resumed = make_dataset(cfg, tok, seq_len=32, batch_size=8, split="train", seed=1)
    resumed.set_state(state)
    assert_same(list(itertools.islice(resumed, 3)), list(itertools.islice(it, 3)))
    assert resumed.mixture_shares() == it.mixture_shares()
    # The held-out stream mixes the held-out splits (1.txt and 2.txt of each, by key).
    assert set(kinds(batches(cfg, tok, split="heldout", seq_len=32, batch_size=2))) == {"a", "b"}
    # The trainer reads the mixture the CLI override names and reports its shares as metrics
    # (nothing compiled: the state is only built at the first step).
    run = load_run_config(TINY, [*SMALL_LOOP, "train.data.heldout_fraction=0.2",
                                 f"train.data.mixture={{{dirs['a']}: 1, {dirs['b']}: 3}}"])
    (tmp_path / "run").mkdir()
    trainer = Trainer(run, tmp_path / "run")
    for step in range(3):
        trainer.next_batch(step)
    shares = trainer.mixture_shares()
    assert sorted(shares) == ["data/mix/a", "data/mix/b"]
    assert shares["data/mix/a"] == pytest.approx(1 - shares["data/mix/b"])
    assert abs(shares["data/mix/a"] - 0.25) <= 3 / 12  # 12 rows: within one interleaving cycle


def test_raw_files_are_read_once_and_long_texts_in_pieces(tmp_path, tok, monkeypatch):
    source = write_corpus(tmp_path)
    opened = []
    original = readers.blocks
    monkeypatch.setattr(readers, "blocks", lambda path, *a, **k: opened.append(Path(path).name)
                        or original(path, *a, **k))
    cfg = DataConfig(source=source, heldout_fraction=0.3)
    data = open_data(cfg, tok)
    check_data(data, cfg, tok, loss_mask="auto", heldout=True)
    fingerprint = data.fingerprint
    list(itertools.islice(make_dataset(cfg, tok, seq_len=64, batch_size=2, split="train",
                                       data=data), 5))
    assert sorted(opened) == sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    for path in tmp_path.iterdir():  # the fingerprint was taken on the same read
        assert fingerprint[str(path)] == {"bytes": path.stat().st_size,
                                          "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    # The long file: pieces of at most PIECE_BYTES, cut after newlines, that make up the file;
    # encoded as one document: metadata before the first, end-of-text after the last only.
    pieces = [d for d in data.sources[source].documents if d.key == "long.txt"]
    text = (tmp_path / "long.txt").read_text()
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\rc\n")  # read with universal newlines
    assert [d.text for d in load_corpus(str(tmp_path / "crlf.txt")).documents] == ["a\nb\nc\n"]
    assert "".join(d.text for d in pieces) == text
    assert all(len(d.text.encode()) <= PIECE_BYTES and d.text.endswith("\n") for d in pieces[:-1])
    encode = DocumentEncoder(tok, True)
    examples = [encode(d) for d in pieces]
    assert [int(e["meta_mask"].sum()) > 0 for e in examples] == [True, False, False, False]
    assert [int((e["tokens"] == tok.eos_id).sum()) for e in examples] == [0, 0, 0, 1]
    assert tok.decode(np.concatenate([e["tokens"][~e["meta_mask"]] for e in examples])) == (
        text + "<|endoftext|>")
