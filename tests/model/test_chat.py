"""The chat: streaming detokenization (model/tokenizers/stream.py) against the tokenizer's own
decoding; the conversation's bounded history and its loop's commands (model/conversation.py)
with a stand-in decoder; and end to end, a release with a tokenizer and chat template imported
by `python -m model.hf import` (which copies them beside the weights) and a conversation piped
into `python -m model.chat`, checked against the template rendered by plain Jinja and the
tokenizer's own decoding."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import jinja2
import pytest
import tokenizers
from hf_step3p5_checkpoint import REPO, VOCAB
from train_helpers import SUBPROCESS_XLA_FLAGS

from model import conversation
from model.conversation import Conversation, Renderer, talk
from model.hf import main as hf_main
from model.tokenizers.stream import TextStream
from model.tokenizers.text import load_tokenizer

# ---- streaming detokenization ------------------------------------------------------------------


def test_streamed_pieces_add_up_to_the_whole_decoding():
    """Byte-level BPE (the shipped tokenizer) splits multi-byte characters over tokens: pieces
    are held back until a character is complete, and together they are the decoding."""
    tok = load_tokenizer("default").hf
    text = "naïve café: 日本語のテキスト 🙂\ndef main():\n    return 42\n"
    ids = tok.encode(text).ids
    for step in (1, 3):
        stream = TextStream(tok.decode)
        pieces = [stream.push(ids[i:i + step]) for i in range(0, len(ids), step)]
        pieces.append(stream.flush())
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)
        if step == 1:
            assert "" in pieces  # a character still incomplete after some token


def test_stream_keeps_the_space_a_sentencepiece_decoder_drops_at_the_start():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"▁hello": 0, "▁world": 1, "!": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    assert tok.decode([1]) == "world"  # what decoding the new token alone would print
    stream = TextStream(tok.decode)
    assert [stream.push([0]), stream.push([1]), stream.push([2]), stream.flush()] == [
        "hello", " world", "!", ""]


# ---- the conversation, with a stand-in decoder ---------------------------------------------------

WORDS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"] + [
    f"w{i}" for i in range(VOCAB - 4)]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|endoftext|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def word_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizer of VOCAB words, its four role and end tokens special."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens(WORDS[:4])
    return tok


def rendered(messages) -> str:
    """The chat template by plain Jinja, generation prompt on (the reference)."""
    return jinja2.Environment().from_string(TEMPLATE).render(messages=messages,
                                                             add_generation_prompt=True)


class StandInDecoder:
    """Decoder.generate's interface: replies `reply` token by token through on_tokens."""

    def __init__(self, max_len: int, reply: list[int]):
        self.spec = SimpleNamespace(max_len=max_len, draft=0)
        self.reply, self.prompts = reply, []

    def generate(self, prompts, max_new_tokens, *, on_tokens=None, **kwargs):
        self.prompts.append(prompts[0])
        for token in self.reply[:max_new_tokens]:
            if on_tokens:
                on_tokens([[token]])
        return SimpleNamespace(tokens=[self.reply[:max_new_tokens]], tokens_per_second=1.0)


def stand_in_chat(max_len: int, reply: list[int], max_new_tokens: int = 4,
                  system: str | None = "w1") -> Conversation:
    tok = word_tokenizer()
    renderer = Renderer(rendered, lambda text: tok.encode(text).ids,
                        lambda ids: tok.decode(ids, skip_special_tokens=True), frozenset({0}))
    return Conversation(StandInDecoder(max_len, reply), renderer,
                        max_new_tokens=max_new_tokens, system=system)


def test_replies_stream_and_the_history_drops_its_oldest_exchanges_to_fit():
    chat = stand_in_chat(max_len=24, reply=[10, 11, 0])  # "w6 w7" then the end token
    streamed = []
    first = chat.reply("w2 w3", on_text=streamed.append)
    assert "".join(streamed) == first["reply"] == "w6 w7"
    system = [{"role": "system", "content": "w1"}]
    assert first["prompt"] == rendered(system + [{"role": "user", "content": "w2 w3"}])
    assert first["prompt_tokens"] == 8 and first["dropped_turns"] == 0
    # 20 tokens may be prompt (24 less 4 new): the system turn takes 3, an exchange 8, a new
    # message with the generation prompt 5
    second = chat.reply("w4 w5")
    third = chat.reply("w8 w9")
    assert [second["prompt_tokens"], second["dropped_turns"]] == [16, 0]
    assert [third["prompt_tokens"], third["dropped_turns"]] == [16, 1]
    kept = [{"role": "user", "content": "w4 w5"}, {"role": "assistant", "content": "w6 w7"}]
    assert third["prompt"] == rendered(system + kept + [{"role": "user", "content": "w8 w9"}])
    assert chat.decoder.prompts[-1] == word_tokenizer().encode(third["prompt"]).ids


def test_a_message_that_cannot_fit_is_refused_and_not_kept():
    chat = stand_in_chat(max_len=16, reply=[10, 0])
    chat.reply("w2")
    with pytest.raises(ValueError, match=r"takes 17 tokens with the template, more than the 12"):
        chat.reply(" ".join(["w3"] * 11))
    assert len(chat.exchanges) == 1
    with pytest.raises(ValueError, match="--max-new-tokens: 16 new tokens"):
        stand_in_chat(max_len=16, reply=[0], max_new_tokens=16)


class Interrupting(io.StringIO):
    """Output that raises KeyboardInterrupt (Ctrl-C) at its `count`-th write of `at`."""

    def __init__(self, at: str, count: int):
        super().__init__()
        self.at, self.count = at, count

    def write(self, text):
        if text == self.at:
            self.count -= 1
            if self.count == 0:
                raise KeyboardInterrupt
        return super().write(text)


def test_the_loop_handles_commands_interrupts_and_the_end_of_input(monkeypatch):
    chat = stand_in_chat(max_len=64, reply=[10, 11, 0], system=None)
    monkeypatch.setattr(conversation, "MAX_MESSAGE_CHARS", 30)
    stdin = io.StringIO("w2\n\n/reset\nw3\n" + "w4 " * 20 + "\nw5\n/exit\nw9\n")
    out, err = Interrupting(at=" w7", count=3), io.StringIO()  # Ctrl-C during the 3rd reply
    talk(chat, stdin, first="w1", out=out, err=err)
    assert out.getvalue() == "w6 w7\nw6 w7\nw6\nw6 w7\n"  # w1, w2, the interrupted w3, w5
    assert err.getvalue() == ("[history cleared]\n[reply interrupted; not kept]\n"
                              "error: a message may have at most 30 characters\n")
    assert [m[0]["content"] for m in chat.exchanges] == ["w5"]  # after /reset; w3 not kept
    assert stdin.readline() == "w9\n"  # /exit stopped reading

    chat.reset()
    lines = io.StringIO()
    talk(chat, io.StringIO("w2\nw3"), json_lines=True, out=lines, err=io.StringIO())  # then EOF
    turns = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert [t["user"] for t in turns] == ["w2", "w3"] and turns[1]["reply"] == "w6 w7"


# ---- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release(hf_source, tmp_path_factory):
    """The hand-written Step 3.5 checkpoint with the word tokenizer, TEMPLATE and the end
    token as a release ships them."""
    root = tmp_path_factory.mktemp("release")
    shutil.copytree(hf_source[0], root / "hf")
    word_tokenizer().save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    (root / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return root / "hf"


def test_import_copies_the_tokenizer_and_chat_template(release, tmp_path, capsys):
    assert hf_main(["import", str(release), "--out", str(tmp_path / "model")]) == 0
    assert capsys.readouterr().out.endswith("; tokenizer and chat template copied\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "model" / name).read_bytes() == (release / name).read_bytes()
    damaged = tmp_path / "damaged"
    shutil.copytree(release, damaged)
    (damaged / "tokenizer_config.json").write_text("{not json")
    assert hf_main(["import", str(damaged), "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer_config.json: not a readable JSON file" in err and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_a_conversation_piped_through_model_chat(release, tmp_path):
    """Three exchanges (the third drops the first to fit --max-len), an over-long message
    refused, /reset, then /exit before the last line. Every turn's prompt is the template
    over the kept history, its reply the tokenizer's decoding of the reply's ids."""
    assert hf_main(["import", str(release), "--out", str(tmp_path / "model")]) == 0
    # 34 of the 40 positions may be prompt: the system turn takes 4 tokens, a message of 8
    # words 10 (+ 1 for the generation prompt), a reply of k <= 6 tokens k + 2, so the second
    # turn fits whatever the replies (27 + k1) and the third only without the first (39 + k1
    # + k2 whole, 27 + k2 without); 30 words never fit.
    users = [" ".join(f"w{i + j}" for j in range(8)) for i in (5, 13, 21)] + ["w40"]
    stdin = "\n".join(users[:3] + ["w1 " * 30, "/reset", users[3], "/exit", "w41"]) + "\n"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": SUBPROCESS_XLA_FLAGS,
           "JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(),
                                                     f"stepjax-test-xla-cache-{os.getuid()}")}
    done = subprocess.run(
        [sys.executable, "-m", "model.chat", "--workdir", str(tmp_path / "model"), "--system",
         "w2 w3", "--max-len", "40", "--max-new-tokens", "6", "--json"],
        input=stdin, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    turns = [json.loads(line) for line in done.stdout.splitlines()]
    tok = word_tokenizer()
    system = [{"role": "system", "content": "w2 w3"}]
    history = []
    for turn, dropped in zip(turns, (0, 0, 1, 0)):
        assert turn["dropped_turns"] == dropped
        history = history[2 * dropped:]
        user = {"role": "user", "content": turn["user"]}
        assert turn["prompt"] == rendered(system + history + [user])
        assert turn["prompt_tokens"] == len(tok.encode(turn["prompt"]).ids) <= 40 - 6
        assert turn["reply"] == tok.decode(turn["token_ids"], skip_special_tokens=True)
        assert 1 <= len(turn["token_ids"]) <= 6
        history += [user, {"role": "assistant", "content": turn["reply"]}]
        if turn["user"] == users[2]:
            history = []  # /reset follows the over-long message
    assert [t["user"] for t in turns] == users
    assert "error: the message takes" in done.stderr and "[history cleared]" in done.stderr
