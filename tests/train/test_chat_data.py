"""Chat SFT data (train/data/chat.py, model.tokenizers.chat.chat_tokenizer_for): the assistant
mask of the shipped template with and without its {% generation %} blocks against hand-written
renderings, a Hugging Face directory's template, chat jsonl records refused by line, masks
packed in step with the tokens, train.loss_mask, and the shipped arithmetic chats (not stale,
no RL held-out problem)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
from train_helpers import REPO

from model.config import ConfigError
from model.tokenizers.chat import ChatTokenizer, chat_tokenizer_for
from model.tokenizers.text import SHIPPED, load_tokenizer, train_bpe
from train.config import DataConfig, TrainConfig, load_run_config
from train.data.chat_arith import SHIPPED as SHIPPED_CHATS
from train.data.chat_arith import chat_arith_records, jsonl_text
from train.data.chat_arith import main as chat_arith_main
from train.data.corpus import load_documents
from train.data.documents import Document
from train.data.encoder import DocumentEncoder
from train.data.pipeline import make_dataset
from train.run_record import check_and_record

EOT = "<|endoftext|>"
CHAT = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 37 + 58?"},
    {"role": "assistant", "content": "95"},
    {"role": "user", "content": "12-40="},
    {"role": "assistant", "content": "It is\n -28. "},
    {"role": "user", "content": "Nothing?"},
    {"role": "assistant", "content": ""},
]
# CHAT rendered by the shipped template, cut into (text, trained) pieces by hand.
CHAT_PIECES = [
    (f"<|system|>\nYou are a calculator.{EOT}\n<|user|>\nWhat is 37 + 58?{EOT}\n<|assistant|>\n",
     False),
    (f"95{EOT}", True),
    (f"\n<|user|>\n12-40={EOT}\n<|assistant|>\n", False),
    (f"It is\n -28. {EOT}", True),
    (f"\n<|user|>\nNothing?{EOT}\n<|assistant|>\n", False),
    (EOT, True),
    ("\n", False),
]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "37+58?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"x": "37+58"}}}]},
    {"role": "tool", "content": "95"},
    {"role": "assistant", "content": "95"},
]
CALL = '<tool_call>{"name": "calc", "arguments": {"x": "37+58"}}</tool_call>'
TOOL_PIECES = [
    ("<|system|>\nUse tools.\n\nTools:\n" + json.dumps(TOOLS[0]) + f"{EOT}\n<|user|>\n37+58?"
     f"{EOT}\n<|assistant|>\n", False),
    (CALL + EOT, True),
    (f"\n<|tool|>\n95{EOT}\n<|assistant|>\n", False),
    (f"95{EOT}", True),
    ("\n", False),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def without_generation(chat: ChatTokenizer) -> ChatTokenizer:
    """The same template with its {% generation %} lines dropped: the mask then comes from
    rendering the conversation turn by turn."""
    source = chat.templates["default"]
    tags = ("{%- generation %}", "{%- endgeneration %}")
    stripped = "\n".join(line for line in source.split("\n") if line.strip() not in tags)
    assert stripped.count("\n") == source.count("\n") - 2
    return ChatTokenizer(chat.hf, {"default": stripped}, chat.special_tokens, chat.eos_ids)


def pieces(chat: ChatTokenizer, ids, mask) -> list[tuple[str, bool]]:
    """Decoded runs of equally masked tokens."""
    edges = [0, *(np.flatnonzero(np.diff(mask.astype(int))) + 1), len(ids)]
    return [(chat.decode(ids[a:b]), bool(mask[a])) for a, b in zip(edges, edges[1:])]


# ---- the assistant mask ----------------------------------------------------------------------


@pytest.mark.parametrize("generation", [True, False], ids=["generation", "turn-by-turn"])
def test_shipped_template_masks_exactly_assistant_content_and_end_of_turn(tok, generation):
    chat = chat_tokenizer_for(tok)
    chat = chat if generation else without_generation(chat)
    for messages, tools, expected in ((CHAT, None, CHAT_PIECES), (TOOL_CHAT, TOOLS, TOOL_PIECES)):
        assert chat.render(messages, tools=tools) == "".join(text for text, _ in expected)
        ids, mask = chat.encode_chat(messages, tools=tools)
        assert pieces(chat, ids, mask) == expected
        # the closing <|endoftext|> is the special token (what a decoder stops on), and so are
        # the user turns' ones; the ids are the text tokenizer's
        closing = np.flatnonzero(ids == tok.eos_id)
        assert len(closing) == sum(text.count(EOT) for text, _ in expected)
        assert ids.max() < tok.vocab_size


def test_generation_prompt_is_not_trained(tok):
    chat = chat_tokenizer_for(tok)
    ids, mask = chat.encode_chat(CHAT[:4], add_generation_prompt=True)
    assert chat.decode(ids).endswith(f"12-40={EOT}\n<|assistant|>\n")
    assert [text for text, trained in pieces(chat, ids, mask) if trained] == [f"95{EOT}"]


def chatml_directory(path, tokenizer_config: dict | None = None):
    """A Hugging Face style directory: a small byte-level BPE with ChatML's specials and a
    ChatML template with {% generation %}."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}"
                "{% endgeneration %}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}"
                "{{ '\\n' }}{% endfor %}")
    hf = train_bpe(["system user assistant What is 37 + 58? 95 calculator"] * 4, 300)
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path.mkdir()
    hf.save(str(path / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", **(tokenizer_config or {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_tokenizer_directory_renders_with_its_own_template(tmp_path):
    text = load_tokenizer(str(chatml_directory(tmp_path / "model")))
    chat = chat_tokenizer_for(text)
    ids, mask = chat.encode_chat(CHAT[:3])
    assert text.decode(ids) == ("<|im_start|>system\nYou are a calculator.<|im_end|>\n"
                                "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n"
                                "<|im_start|>assistant\n95<|im_end|>\n")
    assert [t for t, trained in pieces(chat, ids, mask) if trained] == ["95<|im_end|>"]
    assert chat.vocab_size == text.vocab_size and ids.max() < text.vocab_size


def test_tokenizers_without_a_chat_template_are_refused(tmp_path):
    bare = tmp_path / "tokenizer.json"
    shutil.copy(SHIPPED["default"], bare)
    for spec in ("arith_chars", str(bare)):
        with pytest.raises(ValueError) as err:
            chat_tokenizer_for(load_tokenizer(spec))
        assert "has no chat template" in str(err.value) and "\n" not in str(err.value)
    directory = chatml_directory(tmp_path / "model")
    vocab = load_tokenizer(str(directory)).vocab_size  # the ChatML BPE + appended meta tokens
    chatml_directory(tmp_path / "declared", {"added_tokens_decoder": {
        str(vocab): {"content": "<think>", "special": True}}})
    with pytest.raises(ValueError, match=r"declares 1 token\(s\) that tokenizer.json lacks"):
        chat_tokenizer_for(load_tokenizer(str(tmp_path / "declared")))


# ---- chat jsonl -------------------------------------------------------------------------------


def write_chats(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def test_chat_records_become_chat_documents(tmp_path):
    source = write_chats(tmp_path / "chats.jsonl", [
        {"messages": CHAT[:3], "lang": "EN"}, "", {"messages": TOOL_CHAT, "tools": TOOLS}])
    first, second = load_documents(source)
    assert first == Document("chats.jsonl:1", "You are a calculator.\nWhat is 37 + 58?\n95",
                             {"source": "chats.jsonl", "lang": "EN"},
                             chat={"messages": CHAT[:3], "tools": None})
    assert second.key == "chats.jsonl:3" and second.chat == {"messages": TOOL_CHAT, "tools": TOOLS}


@pytest.mark.parametrize("records, needles", [
    ([{"messages": CHAT[:3]}, {"messages": [{"role": "bot", "content": "x"}]}],
     ("chats.jsonl:2", "role 'bot'")),
    ([{"messages": CHAT[:3]}, {"text": "plain"}], ("chats.jsonl:2", "'messages'")),
    ([{"messages": []}], ("chats.jsonl:1", "non-empty list 'messages'")),
    ([{"messages": CHAT[:3]}, "", {"messages": [{"role": "user", "content": 5}]}],
     ("chats.jsonl:3", "messages[0]: content must be a str")),
    ([{"messages": CHAT[:3], "tools": "calc"}], ("chats.jsonl:1", "'tools'")),
    ([{"messages": CHAT[:3]}, '{"messages": [oops'], ("chats.jsonl:2", "malformed JSON")),
    ([["not", "an", "object"]], ("chats.jsonl:1", "expected a JSON object")),
    ([{"text": "plain"}, {"messages": CHAT[:3]}], ("chats.jsonl:2", "string field 'text'")),
])
def test_bad_chat_records_are_refused_by_line(tmp_path, records, needles):
    source = write_chats(tmp_path / "chats.jsonl", records)
    with pytest.raises(ValueError) as err:
        load_documents(source)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    for needle in needles:
        assert needle in message, message


def test_a_template_failure_names_the_record(tmp_path, tok):
    directory = chatml_directory(tmp_path / "model")
    template = "{{ raise_exception('roles must alternate') }}"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": template}))
    source = write_chats(tmp_path / "chats.jsonl", [{"messages": CHAT[:3]}] * 3)
    data = make_dataset(DataConfig(source=source, heldout_fraction=0.5),
                        load_tokenizer(str(directory)), seq_len=16, batch_size=1, split="train")
    with pytest.raises(ValueError, match=r"^chats.jsonl:\d: chat template of .*tokenizer_config"
                                         r".json \('default'\): roles must alternate"):
        next(data)  # (grain appends a note on its traceback filtering after the message)


# ---- packing and train.loss_mask -------------------------------------------------------------


def chat_source(tmp_path, count: int = 12) -> str:
    records = [{"messages": [CHAT[0], {"role": "user", "content": f"What is {i} + {i}?"},
                             {"role": "assistant", "content": str(2 * i)}] + CHAT[3:5] * (i % 3)}
               for i in range(count)]
    return write_chats(tmp_path / "chats.jsonl", records)


@pytest.mark.parametrize("loss_mask", ["auto", "assistant", "all"])
def test_packed_masks_stay_aligned_with_the_tokens(tmp_path, tok, loss_mask):
    """The held-out stream (fixed order, one pass) is the chats' encodings back to back, each
    token with its own mask bit, whatever the row boundaries cut."""
    cfg = DataConfig(source=chat_source(tmp_path), heldout_fraction=0.5, meta_tokens=True)
    docs = [d for d in load_documents(cfg.source) if
            int.from_bytes(hashlib.sha256(d.key.encode()).digest()[:8], "big") < 0.5 * 2**64]
    assert 2 <= len(docs) <= 10
    batches = list(make_dataset(cfg, tok, seq_len=24, batch_size=2, split="heldout",
                                loss_mask=loss_mask))
    rows = [{k: b[k][r] for k in b} for b in batches for r in range(len(b["tokens"]))]
    real = [row["segment_ids"] > 0 for row in rows]
    tokens = np.concatenate([row["tokens"][w] for row, w in zip(rows, real)])
    trained = np.concatenate([row["loss_mask"][w] for row, w in zip(rows, real)])
    chat = chat_tokenizer_for(tok)
    encoded = [chat.encode_chat(d.chat["messages"]) for d in docs]
    np.testing.assert_array_equal(tokens, np.concatenate([ids for ids, _ in encoded]))
    expected = np.concatenate([m if loss_mask != "all" else np.ones_like(m) for _, m in encoded])
    np.testing.assert_array_equal(trained, expected)
    assert not any(row["meta_mask"].any() or row["loss_mask"][~w].any()
                   for row, w in zip(rows, real))  # chats take no metadata prefix
    assert trained.sum() < len(trained) or loss_mask == "all"


def test_plain_documents_train_on_every_token_next_to_chats(tmp_path, tok):
    chat = chat_tokenizer_for(tok)
    encode = DocumentEncoder(tok, True, chat, assistant_only=True)
    plain = encode(Document("a.txt", "x = 1\n", {"type": "Code"}))
    assert plain["loss_mask"].all() and plain["meta_mask"].any()
    conversation = encode(Document("c.jsonl:1", "", {}, chat={"messages": CHAT, "tools": None}))
    ids, mask = chat.encode_chat(CHAT)
    np.testing.assert_array_equal(conversation["tokens"], ids)
    np.testing.assert_array_equal(conversation["loss_mask"], mask)
    assert not conversation["meta_mask"].any()


def test_loss_mask_values(tmp_path, tok):
    with pytest.raises(ConfigError, match=r"^train.loss_mask: got 'prompt', allowed values"):
        TrainConfig(loss_mask="prompt")
    (tmp_path / "a.txt").write_text("plain text " * 20)
    (tmp_path / "b.txt").write_text("more text " * 20)
    cfg = DataConfig(source=f"{tmp_path}/*.txt", heldout_fraction=0.01, shuffle=False)
    with pytest.raises(ConfigError) as err:
        make_dataset(cfg, tok, seq_len=16, batch_size=1, split="train", loss_mask="assistant")
    assert str(err.value).startswith("train.loss_mask: 'assistant' trains on the assistant turns")
    assert "\n" not in str(err.value)
    batch = next(make_dataset(cfg, tok, seq_len=16, batch_size=2, split="train"))  # auto: all
    assert batch["loss_mask"].all()
    with pytest.raises(ValueError, match="'arith_chars' has no chat template"):
        make_dataset(DataConfig(source=chat_source(tmp_path)), load_tokenizer("arith_chars"),
                     seq_len=16, batch_size=1, split="train")


def test_the_run_record_holds_the_chat_template(tmp_path, tok):
    cfg = DataConfig(source=chat_source(tmp_path))
    chat = chat_tokenizer_for(tok)
    record = dict(resuming=False, allow_data_change=False, write=True)
    assert check_and_record(tmp_path, tok, cfg, chat, **record) is None
    edited = ChatTokenizer(chat.hf, {"default": chat.templates["default"] + " "},
                           chat.special_tokens, chat.eos_ids)
    with pytest.raises(ValueError, match="data changed since the run started: chat template "
                                         r"\(content changed\)"):
        check_and_record(tmp_path, tok, cfg, edited, **{**record, "resuming": True})
    assert check_and_record(tmp_path, tok, cfg, chat, **{**record, "resuming": True}) is None


# ---- the shipped arithmetic chats ------------------------------------------------------------


def test_shipped_chats_are_not_stale():
    assert SHIPPED_CHATS.read_text(encoding="utf-8") == jsonl_text(chat_arith_records()), (
        "regenerate: python -m train.data.chat_arith --out train/data/assets/chat_arith.jsonl "
        "--force")
    assert SHIPPED_CHATS.stat().st_size < 300_000


def test_shipped_chats_hold_no_rl_heldout_problem():
    """Parsed back from the text and checked against the split rule written out here: a problem
    `a op b` is held out when sha256("arith:a op b=")'s first 8 bytes < 0.05 * 2**64."""
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
    problems = []
    for line in SHIPPED_CHATS.read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        for question, answer in zip(messages[1::2], messages[2::2]):
            assert (question["role"], answer["role"]) == ("user", "assistant")
            a, op, b = re.search(r"(\d+) ?([+-]) ?(\d+)", question["content"]).groups()
            assert answer["content"] == str(apply[op](int(a), int(b)))
            problems.append(f"{a}{op}{b}=")
    assert len(problems) == len(set(problems)) > 1000
    held = [p for p in problems
            if int.from_bytes(hashlib.sha256(f"arith:{p}".encode()).digest()[:8], "big")
            < 0.05 * 2**64]
    assert held == []


def test_chat_arith_cli(tmp_path, capsys):
    out = tmp_path / "chats.jsonl"
    assert chat_arith_main(["--out", str(out), "--conversations", "5"]) == 0
    assert out.read_text() == jsonl_text(chat_arith_records(5))
    assert len(load_documents(str(out))) == 5
    with pytest.raises(SystemExit):
        chat_arith_main(["--out", str(out)])
    assert "exists; pass --force" in capsys.readouterr().err


def test_sft_chat_arith_config_fits_its_data():
    run = load_run_config(REPO / "configs" / "sft_chat_arith.yaml")
    assert (run.train.loss_mask, run.train.data.tokenizer) == ("auto", "default")
    assert (REPO / run.train.data.source).resolve() == SHIPPED_CHATS.resolve()
    assert load_tokenizer(run.train.data.tokenizer).vocab_size <= run.model.vocab_size
