"""Data pipeline: corpus loading and splits, the tokenizer, packing, meta tokens, determinism,
resumption, sharding, bad inputs, and (with a tiny model) that packed documents never see each
other. Most tests use small corpora written to tmp_path; two use the real stdlib corpus."""

from __future__ import annotations

import collections
import itertools
import json
import json.decoder
from pathlib import Path

import grain
from grain.experimental import WindowShuffleIterDataset
import jax
import numpy as np
import pytest

from model.tokenizers.text import (
    DEFAULT_PATH,
    EOS,
    META_CLOSE,
    META_OPEN,
    TextTokenizer,
    load_tokenizer,
    train_bpe,
)
from train.config import DataConfig
from train.data import pipeline as data_module
from train.data.corpus import load_documents, meta_string, stdlib_documents
from train.data.documents import Document, heldout_score, split_documents
from train.data.packing import FEATURES, pack, unpack
from train.data.encoder import DocumentEncoder
from train.data.pipeline import host_records, make_dataset
from train.data.shuffle import WindowShuffle

REPO = Path(__file__).resolve().parents[2]
SAMPLE = Path(json.decoder.__file__).read_text()  # real Python source for small documents
LENGTHS = (15, 60, 400, 1500, 40, 3000, 7, 900)  # characters; ~3.6 characters per token


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return load_tokenizer("default")


def sample_text(i: int) -> str:
    start = (i * 337) % (len(SAMPLE) - 3000)
    return f"# document {i}\n" + SAMPLE[start:start + LENGTHS[i % len(LENGTHS)]]


@pytest.fixture
def corpus(tmp_path) -> str:
    """24 .txt documents and 24 .jsonl documents (with metadata) of varied lengths."""
    for i in range(24):
        (tmp_path / f"doc{i:02d}.txt").write_text(sample_text(i))
    with open(tmp_path / "records.jsonl", "w") as f:
        for i in range(24, 48):
            f.write(json.dumps({"text": sample_text(i), "type": "Web", "lang": "EN",
                                "source": f"site{i}", "id": i}) + "\n")
    return f"{tmp_path}/*.txt,{tmp_path / 'records.jsonl'}"


def batches_of(iterator, n=None) -> list[dict]:
    """The next n batches (all of a finite iterator when n is None)."""
    return list(itertools.islice(iterator, n))


def stream_documents(batches: list[dict], eos_id: int) -> list[dict]:
    """Concatenates the rows' segments in order and cuts after every end-of-text token."""
    rows = [{k: b[k][r] for k in FEATURES} for b in batches for r in range(len(b["tokens"]))]
    tokens = np.concatenate([s["tokens"] for row in rows for s in unpack(row)])
    meta = np.concatenate([s["meta_mask"] for row in rows for s in unpack(row)])
    ends = np.flatnonzero(tokens == eos_id) + 1
    assert ends.size and ends[-1] == len(tokens), "stream does not end with a whole document"
    return [{"tokens": t, "meta_mask": m}
            for t, m in zip(np.split(tokens, ends[:-1]), np.split(meta, ends[:-1]))]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in FEATURES:
            np.testing.assert_array_equal(x[k], y[k])


def test_stdlib_corpus_split_is_stable_and_disjoint():
    docs = stdlib_documents()
    keys = [d.key for d in docs]
    assert keys == sorted(keys) and len(docs) > 200
    excluded = {"test", "tests", "site-packages"}
    assert not any(part in excluded for k in keys for part in k.split("/"))
    assert all(d.meta == {"type": "Code", "lang": "python", "source": d.key} for d in docs)
    train, heldout = split_documents(docs, 0.05)
    assert {d.key for d in train}.isdisjoint(d.key for d in heldout)
    assert len(train) + len(heldout) == len(docs)
    assert 0.02 < len(heldout) / len(docs) < 0.09
    assert [d.key for d in split_documents(stdlib_documents(), 0.05)[1]] == [d.key for d in heldout]


def test_heldout_split_fraction_and_hash_is_pinned():
    # sha256-based, so the split never depends on PYTHONHASHSEED or the machine
    assert heldout_score("json/decoder.py") == pytest.approx(0.2311743, abs=1e-6)
    docs = [Document(f"dir/file{i}.py", "x", {}) for i in range(4000)]
    for fraction in (0.05, 0.3):
        train, heldout = split_documents(docs, fraction)
        assert abs(len(heldout) / len(docs) - fraction) < 0.02
        assert {d.key for d in train}.isdisjoint(d.key for d in heldout)
    # growing the fraction only moves documents into the held-out split
    small = {d.key for d in split_documents(docs, 0.05)[1]}
    assert small <= {d.key for d in split_documents(docs, 0.3)[1]}


def test_local_files_and_metadata(corpus, tmp_path):
    docs = load_documents(corpus)
    assert len(docs) == 48
    assert docs[0].meta == {"type": "Text", "source": "doc00.txt"}
    assert docs[0].text == sample_text(0)
    assert docs[24].key == "records.jsonl:1"  # relative: the split does not depend on tmp_path
    assert meta_string(docs[30].meta) == "type=Web lang=EN source=site30"
    # the same file named twice (here by a glob and a path) is read once
    assert len(load_documents(f"{corpus},{tmp_path / 'doc00.txt'}")) == 48


def test_default_tokenizer(tok):
    assert DEFAULT_PATH.is_file() and DEFAULT_PATH.stat().st_size < 1_000_000
    assert tok.get_vocab_size() == tok.vocab_size == 4096
    assert [tok.hf.token_to_id(t) for t in (EOS, META_OPEN, META_CLOSE)] == [
        tok.eos_id, tok.meta_open_id, tok.meta_close_id]
    source = SAMPLE + "\n# ünïcødé ✓ 中文\n\tx = '<|endoftext|>'\n"
    ids = tok.encode(source)
    assert ids.dtype == np.int32 and tok.decode(ids) == source
    assert len(source) / len(ids) > 2.5  # merges were learned on Python code
    # a special token's spelling inside a document is text, never a boundary
    assert tok.eos_id not in ids.tolist()
    assert tok.meta_open_id not in tok.encode("<|meta|>").tolist()
    batch = tok.encode_batch(["def f():", "pass"])
    assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in ("def f():", "pass")]


def test_foreign_tokenizer_gets_missing_special_tokens(tmp_path):
    hf = train_bpe(["hello world, hello there"] * 4, vocab_size=300)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    plain = load_tokenizer(str(path))
    assert plain.vocab_size == hf.get_vocab_size()  # all three already present
    # a tokenizer without our special tokens (and "</s>" as its end of text) gets them appended
    spec = json.loads(path.read_text())
    spec["added_tokens"] = [dict(spec["added_tokens"][0], content="</s>")]
    spec["model"]["vocab"] = {("</s>" if k == EOS else k): v
                              for k, v in spec["model"]["vocab"].items()
                              if k not in (META_OPEN, META_CLOSE)}
    path.write_text(json.dumps(spec))
    foreign = load_tokenizer(str(path))
    assert foreign.hf.id_to_token(foreign.eos_id) == "</s>"
    assert foreign.vocab_size == max(foreign.meta_open_id, foreign.meta_close_id) + 1


def test_packing_invariants():
    lengths = [3, 13, 2, 16, 40, 1, 7, 33, 5, 16, 17]
    examples = [{"tokens": np.arange(1, n + 1, dtype=np.int32) + 100 * i,
                 "meta_mask": np.arange(n) < min(2, n - 1),
                 "loss_mask": (np.arange(n) + i) % 3 != 0} for i, n in enumerate(lengths)]
    seq_len = 16
    rows = list(pack(grain.MapDataset.source(examples).to_iter_dataset(), seq_len))
    assert len(rows) == -(-sum(lengths) // seq_len)  # concat-then-split: no padding but the end
    stream, segments_per_doc = [], collections.Counter()
    for r, row in enumerate(rows):
        assert {k: (row[k].shape, row[k].dtype) for k in FEATURES} == {
            k: ((seq_len,), np.bool_ if k.endswith("_mask") else np.int32) for k in FEATURES}
        seg, pos = row["segment_ids"], row["positions"]
        used = int(np.count_nonzero(seg))
        assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0), "padding only at the end"
        assert np.all(row["tokens"][used:] == 0) and not row["meta_mask"][used:].any()
        assert not row["loss_mask"][used:].any()
        assert used == seq_len or r == len(rows) - 1
        assert seg[0] == 1 and np.all(np.diff(seg[:used]) >= 0) and np.all(np.diff(seg[:used]) <= 1)
        for sid in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == sid)
            np.testing.assert_array_equal(where, np.arange(where[0], where[-1] + 1))
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            piece = row["tokens"][where]
            doc = set((piece - 1) // 100)
            assert len(doc) == 1, "a segment never holds two documents"
            segments_per_doc[doc.pop()] += 1
        stream += [(int(t), bool(m), bool(w)) for t, m, w in zip(
            row["tokens"][:used], row["meta_mask"][:used], row["loss_mask"][:used])]
    # every token of every document exactly once, in order, with its meta and loss flags
    assert stream == [(int(t), bool(m), bool(w)) for ex in examples
                      for t, m, w in zip(ex["tokens"], ex["meta_mask"], ex["loss_mask"])]
    for i, n in enumerate(lengths):  # long documents are split into seq_len-sized pieces (or more)
        assert segments_per_doc[i] >= -(-n // seq_len)
    assert segments_per_doc[4] >= 3


def test_heldout_stream_is_the_encoded_documents(tok, corpus):
    cfg = DataConfig(source=corpus, heldout_fraction=0.4)
    batches = batches_of(make_dataset(cfg, tok, seq_len=64, batch_size=3, split="heldout"))
    assert all(b[k].shape == (3, 64) for b in batches for k in FEATURES)
    used = np.concatenate([np.count_nonzero(b["segment_ids"], axis=1) for b in batches])
    last = int(np.flatnonzero(used)[-1])  # padding only after the last document: the short final
    assert np.all(used[:last] == 64) and np.all(used[last + 1:] == 0)  # batch is completed
    heldout = split_documents(load_documents(corpus), 0.4)[1]
    expected = [DocumentEncoder(tok, True)(d) for d in heldout]
    got = stream_documents(batches, tok.eos_id)
    assert len(got) == len(expected) > 5
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g["tokens"], e["tokens"])
        np.testing.assert_array_equal(g["meta_mask"], e["meta_mask"])
    # finite and deterministic
    again = batches_of(make_dataset(cfg, tok, seq_len=64, batch_size=3, split="heldout"))
    assert_same_batches(batches, again)


def test_meta_mask_marks_exactly_the_metadata_prefix(tok, corpus):
    docs = load_documents(corpus)
    for doc in (docs[3], docs[30]):
        ex = DocumentEncoder(tok, True)(doc)
        close = int(np.flatnonzero(ex["tokens"] == tok.meta_close_id)[0])
        np.testing.assert_array_equal(ex["meta_mask"], np.arange(len(ex["tokens"])) <= close)
        prefix = tok.decode(ex["tokens"][:close + 1])
        assert prefix == f"{META_OPEN}{meta_string(doc.meta)}{META_CLOSE}"
        assert tok.decode(ex["tokens"][close + 1:]) == doc.text + EOS
        plain = DocumentEncoder(tok, False)(doc)
        assert not plain["meta_mask"].any()
        np.testing.assert_array_equal(plain["tokens"], np.append(tok.encode(doc.text), tok.eos_id))
    assert "type=Web lang=EN source=site30" in meta_string(docs[30].meta)
    # through the pipeline: one metadata prefix per document, none when switched off
    for meta_tokens in (True, False):
        cfg = DataConfig(source=corpus, heldout_fraction=0.4, meta_tokens=meta_tokens)
        got = stream_documents(batches_of(make_dataset(cfg, tok, seq_len=64, batch_size=2,
                                                       split="heldout")), tok.eos_id)
        for g in got:
            n_meta = int(g["meta_mask"].sum())
            assert g["meta_mask"][:n_meta].all()  # a prefix
            assert (n_meta > 2) == meta_tokens
            assert (g["tokens"][0] == tok.meta_open_id) == meta_tokens


def test_train_stream_is_deterministic_and_resumes(tok, corpus, monkeypatch):
    # small shuffle windows so the stream below crosses windows and epochs
    monkeypatch.setattr(data_module, "SHUFFLE_WINDOW_TOKENS", 6 * 64)
    cfg = DataConfig(source=corpus, heldout_fraction=0.1)
    make = lambda seed=7: make_dataset(cfg, tok, seq_len=64, batch_size=4, split="train", seed=seed)
    first = batches_of(make(), 100)
    assert_same_batches(first, batches_of(make(), 100))
    assert not np.array_equal(first[0]["tokens"], batches_of(make(seed=8), 1)[0]["tokens"])
    assert sum(int(b["tokens"].size) for b in first) > 2 * sum(  # more than two epochs seen
        len(DocumentEncoder(tok, True)(d)["tokens"])
        for d in split_documents(load_documents(corpus), 0.1)[0])
    assert all((b["segment_ids"] > 0).all() for b in first)  # endless stream: no padding
    for k in (0, 5, 23):
        it = make()
        batches_of(it, k)
        state = json.loads(json.dumps(it.get_state()))  # as stored in the checkpoint
        resumed = make()
        resumed.set_state(state)
        assert_same_batches(batches_of(resumed, 8), first[k:k + 8])
    with pytest.raises(ValueError, match="seq_len 64 -> 32"):
        make_dataset(cfg, tok, seq_len=32, batch_size=4, split="train", seed=7).set_state(state)


def test_row_shuffle_permutes_windows_and_resumes_from_its_and_grains_states():
    rows = grain.MapDataset.range(50).to_iter_dataset()
    shuffled = lambda: WindowShuffle(rows, window_size=8, seed=3)  # noqa: E731
    ours = list(shuffled())
    assert ours != list(range(50)) and ours == list(shuffled())
    for start in range(0, 50, 8):  # every window: a permutation of its own rows
        assert sorted(ours[start:start + 8]) == list(range(start, min(start + 8, 50)))
    for k in (0, 5, 8, 13, 49, 50):
        it = iter(shuffled())
        list(itertools.islice(it, k))
        resumed = iter(shuffled())
        resumed.set_state(json.loads(json.dumps(it.get_state())))
        assert list(resumed) == ours[k:]
    # A state of grain's WindowShuffleIterDataset (checkpoints written with it): the rest of its
    # window exactly as grain goes on, then our windows.
    theirs = iter(WindowShuffleIterDataset(rows, window_size=8, seed=3))
    list(itertools.islice(theirs, 13))
    resumed = iter(shuffled())
    resumed.set_state(json.loads(json.dumps(theirs.get_state())))
    rest = list(resumed)
    assert rest[:3] == list(itertools.islice(theirs, 3)) and rest[3:] == ours[16:]


@pytest.mark.slow
def test_worker_processes_give_the_same_stream_and_resume_with_any_count(tok, corpus):
    """train.data.num_workers > 0 reads and tokenises in grain worker processes: the stream and
    its checkpointed position are the in-process pipeline's whatever the number of workers, so a
    run resumes exactly with another count (train/data/example_stream.py)."""
    make = lambda workers: make_dataset(DataConfig(source=corpus, num_workers=workers), tok,
                                        seq_len=64, batch_size=2, split="train", seed=3)
    reference = batches_of(make(0), 12)
    workers = make(2)
    assert_same_batches(batches_of(workers, 6), reference[:6])
    in_process = make(0)  # 2 workers -> none
    in_process.set_state(json.loads(json.dumps(workers.get_state())))
    assert_same_batches(batches_of(in_process, 3), reference[6:9])
    resumed = make(1)  # none -> 1 worker
    resumed.set_state(json.loads(json.dumps(in_process.get_state())))
    assert_same_batches(batches_of(resumed, 3), reference[9:])
    # A position saved by an older stepjax with workers had their count in its shape.
    old = {**in_process.get_state(), "pipeline": {**in_process.pipeline, "num_workers": 2}}
    with pytest.raises(ValueError, match="older stepjax with train.data.num_workers=2"):
        make(0).set_state(old)


def test_hosts_get_disjoint_shards_covering_the_documents(tok, corpus):
    docs = load_documents(corpus)
    for split, chosen in zip(("train", "heldout"), split_documents(docs, 0.5)):
        records = grain.MapDataset.source(chosen)
        full = {d.key for d in chosen}
        shards = [{d.key for d in host_records(records, split, i, 2)} for i in range(2)]
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == full
        assert abs(len(shards[0]) - len(shards[1])) <= 1
    cfg = DataConfig(source=corpus, heldout_fraction=0.5)
    streams = [stream_documents(batches_of(make_dataset(
        cfg, tok, seq_len=64, batch_size=2, split="heldout", shard_index=i, shard_count=2)),
        tok.eos_id) for i in range(2)]
    whole = stream_documents(batches_of(make_dataset(cfg, tok, seq_len=64, batch_size=2,
                                                     split="heldout")), tok.eos_id)
    as_keys = lambda docs: collections.Counter(tuple(d["tokens"].tolist()) for d in docs)
    assert not (as_keys(streams[0]) & as_keys(streams[1]))
    assert as_keys(streams[0]) + as_keys(streams[1]) == as_keys(whole)


@pytest.mark.parametrize("make_source, culprit", [
    (lambda p: str(p / "missing.txt"), "missing.txt"),
    (lambda p: str(p / "nothing" / "*.jsonl"), "nothing/*.jsonl"),
    (lambda p: (p / "empty_dir").mkdir() or str(p / "empty_dir"), "empty_dir"),
    (lambda p: (p / "blank.txt").write_text("  \n") and str(p / "blank.txt"), "blank.txt"),
    (lambda p: (p / "notes.md").write_text("hi") and str(p / "notes.md"), "notes.md"),
    (lambda p: (p / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
     and str(p / "bad.jsonl"), "bad.jsonl:2"),
    (lambda p: (p / "notext.jsonl").write_text('{"body": "x"}\n') and str(p / "notext.jsonl"),
     "notext.jsonl:1"),
    (lambda p: (p / "latin1.txt").write_bytes(b"caf\xe9") and str(p / "latin1.txt"), "latin1.txt"),
])
def test_bad_sources_name_the_culprit(tmp_path, make_source, culprit):
    source = make_source(tmp_path)
    with pytest.raises(ValueError, match=culprit.replace("*", r"\*")) as err:
        load_documents(source)
    assert "\n" not in str(err.value)


def test_bad_tokenizers_and_empty_splits_name_the_culprit(tmp_path, tok):
    with pytest.raises(ValueError, match="no_such_tokenizer.json"):
        load_tokenizer(str(tmp_path / "no_such_tokenizer.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_tokenizer(str(tmp_path / "broken.json"))
    (tmp_path / "one.txt").write_text("just one document")
    cfg = DataConfig(source=str(tmp_path / "one.txt"))
    split = "heldout" if heldout_score("one.txt") >= 0.05 else "train"
    with pytest.raises(ValueError, match=f"{split} split"):
        make_dataset(cfg, tok, seq_len=16, batch_size=1, split=split)


def test_stdlib_pipeline_batches(tok):
    data = make_dataset(DataConfig(), tok, seq_len=128, batch_size=4, split="train", seed=0)
    batch = next(data)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: ((4, 128), np.bool_ if k.endswith("_mask") else np.int32) for k in FEATURES}
    assert 0 <= batch["tokens"].min() and batch["tokens"].max() < tok.vocab_size


@pytest.mark.slow
def test_packed_documents_do_not_attend_to_each_other(tok, corpus):
    """Perturbing one packed document changes its own logits and no other document's."""
    from model.config import load_config
    from model.lm import CausalLM

    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        "d_model=32", "num_layers=2", "layout=FS", "num_dense_layers=1", "head_dim=8", "window=8",
        "dense_hidden=64", "moe.expert_hidden=16", "moe.shared_hidden=16", "mtp.num_heads=0",
        "swiglu_limits=[0, 7.0]", "swiglu_limits_shared=[0, 16.0]"])
    docs = [d for i, d in enumerate(load_documents(corpus)) if i in (0, 6, 1, 4)]  # short ones
    examples = grain.MapDataset.source(docs).map(DocumentEncoder(tok, True)).to_iter_dataset()
    row = next(iter(pack(examples, 64)))
    tokens, seg, pos = (row[k][None] for k in ("tokens", "segment_ids", "positions"))
    target = 2  # a document in the middle: others before and after it
    assert seg.min() == 1 and seg.max() > target, "need a row holding several documents"
    inside = seg[0] == target
    perturbed = np.where(inside, (tokens + 1000) % tok.vocab_size, tokens)

    lm = CausalLM(cfg)
    fast = {"xla_backend_optimization_level": 0}  # compile time dominates on CPU
    variables = jax.jit(lambda key: lm.init(key, tokens), compiler_options=fast)(jax.random.key(0))
    apply = jax.jit(lambda v, t: lm.apply(v, t, segment_ids=seg, positions=pos).logits,
                    compiler_options=fast)
    base, moved = np.asarray(apply(variables, tokens)), np.asarray(apply(variables, perturbed))
    np.testing.assert_allclose(moved[0, ~inside], base[0, ~inside], atol=1e-5, rtol=1e-5)
    assert np.abs(moved[0, inside] - base[0, inside]).max() > 1e-3
