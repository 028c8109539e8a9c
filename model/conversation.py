"""A multi-turn conversation with a model: what `python -m model.chat` (and
`python -m model.generate --chat` without a prompt) runs.

    chat = Conversation(decoder, renderer, max_new_tokens=512, system="Be brief.")
    turn = chat.reply("Hello", on_text=print)   # streams the reply; turn["reply"] is all of it
    talk(chat, sys.stdin, json_lines=False)     # the interactive loop

Every turn renders the whole conversation (system message, earlier exchanges, the new user
message) through the chat template (model/tokenizers/chat.py, sandboxed Jinja) and decodes the
reply from it with KV caches of `decoder.spec.max_len` positions (model/inference/decode.py),
streaming the text as tokens are committed. The history is bounded by those positions: a turn's
prompt may take at most max_len - max_new_tokens - draft of them, and when the conversation
would exceed that the oldest exchanges are dropped (the system message stays) and the turn
says how many; a message that does not fit even alone is refused and not kept. The prompt is
re-read from the start every turn (no cache survives between turns): simple, and exact for
templates that render earlier turns differently once a reply exists (e.g. dropping reasoning).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple, TextIO

import jax

from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.parallel.device_mesh import use_decode_mesh
from model.tokenizers.stream import TextStream

MAX_MESSAGE_CHARS = 1 << 20  # a message or --prompt-file longer than this is refused
EXIT_COMMANDS = ("/exit", "/quit")


class Renderer(NamedTuple):
    """A model's tokenizer as a conversation uses it."""

    render: Callable[[list[dict]], str]  # messages -> the template's text, generation prompt on
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]  # special tokens skipped
    stop_ids: frozenset[int]


def read_prompt_file(path: str) -> str:
    """The text of --prompt-file `path` (UTF-8, at most MAX_MESSAGE_CHARS characters)."""
    file = Path(path)
    try:
        if file.stat().st_size > 4 * MAX_MESSAGE_CHARS:
            raise ValueError(f"--prompt-file: {path} is {file.stat().st_size} bytes, more than "
                             f"a prompt may be ({MAX_MESSAGE_CHARS} characters)")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompt-file: cannot read {path} ({err})") from None
    if len(text) > MAX_MESSAGE_CHARS:
        raise ValueError(f"--prompt-file: {path} has {len(text)} characters, more than "
                         f"{MAX_MESSAGE_CHARS}")
    return text


class Conversation:
    """The history of one chat and the decoder that continues it (see the module docstring)."""

    def __init__(self, decoder: Decoder, renderer: Renderer, *, max_new_tokens: int,
                 sampling: Sampling = Sampling(), speculative: bool = False, seed: int = 0,
                 system: str | None = None):
        self.decoder, self.renderer = decoder, renderer
        self.max_new_tokens, self.sampling, self.speculative = max_new_tokens, sampling, speculative
        self.key = jax.random.key(seed)
        self.system = [{"role": "system", "content": system}] if system else []
        self.exchanges: list[tuple[dict, dict]] = []  # (user message, assistant message)
        draft = decoder.spec.draft if speculative else 0
        self.prompt_budget = decoder.spec.max_len - max_new_tokens - draft
        if self.prompt_budget < 1:
            raise ValueError(f"--max-new-tokens: {max_new_tokens} new tokens (+ {draft} drafted) "
                             f"leave no room for a prompt in --max-len {decoder.spec.max_len}")

    def reset(self) -> None:
        self.exchanges = []

    def fit(self, user: dict) -> tuple[str, list[int], int]:
        """(rendered prompt, its ids, exchanges dropped) for the next turn: the longest recent
        history that fits the prompt budget. ValueError when `user` alone does not fit."""
        for dropped in range(len(self.exchanges) + 1):
            messages = self.system + [m for pair in self.exchanges[dropped:] for m in pair]
            text = self.renderer.render(messages + [user])
            ids = self.renderer.encode(text)
            if len(ids) <= self.prompt_budget:
                return text, ids, dropped
        raise ValueError(f"the message takes {len(ids)} tokens with the template, more than the "
                         f"{self.prompt_budget} a prompt may have (--max-len "
                         f"{self.decoder.spec.max_len} less --max-new-tokens "
                         f"{self.max_new_tokens}); send a shorter one or raise --max-len")

    def reply(self, text: str, on_text: Callable[[str], None] | None = None) -> dict:
        """Answers user message `text` (streaming the reply's text to `on_text`), keeps the
        exchange and returns the turn: user, prompt (rendered), reply, token_ids,
        prompt_tokens, dropped_turns (oldest exchanges left out to fit), tokens_per_second."""
        user = {"role": "user", "content": text}
        prompt, ids, dropped = self.fit(user)
        stream = TextStream(self.renderer.decode)
        on_tokens = None
        if on_text is not None:
            on_tokens = lambda rows: on_text(stream.push(rows[0]))  # noqa: E731
        self.key, key = jax.random.split(self.key)
        out = self.decoder.generate([ids], self.max_new_tokens, sampling=self.sampling,
                                    speculative=self.speculative, key=key,
                                    stop_ids=self.renderer.stop_ids, on_tokens=on_tokens)
        if on_text is not None:
            on_text(stream.flush())
        tokens = out.tokens[0]
        answer = self.renderer.decode(tokens)
        self.exchanges = self.exchanges[dropped:] + [(user, {"role": "assistant",
                                                            "content": answer})]
        return {"user": text, "prompt": prompt, "reply": answer, "token_ids": tokens,
                "prompt_tokens": len(ids), "dropped_turns": dropped,
                "tokens_per_second": out.tokens_per_second}


def read_message(stream: TextIO) -> str | None:
    """The next line of `stream` (None at its end), at most MAX_MESSAGE_CHARS characters: the
    rest of a longer line is read and refused."""
    line = stream.readline(MAX_MESSAGE_CHARS + 1)
    if not line:
        return None
    if len(line) > MAX_MESSAGE_CHARS and not line.endswith("\n"):
        while (rest := stream.readline(MAX_MESSAGE_CHARS)) and not rest.endswith("\n"):
            pass
        raise ValueError(f"a message may have at most {MAX_MESSAGE_CHARS} characters")
    return line.rstrip("\n")


def talk(chat: Conversation, stdin: TextIO = sys.stdin, *, json_lines: bool = False,
         first: str | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """The interactive loop: one user message per line of `stdin` (`first`, if given, before
    them). Replies stream to `out` as they are decoded, or with `json_lines` each turn is one
    JSON object (`Conversation.reply`'s). `/reset` forgets the history; `/exit`, `/quit`, the
    end of input (Ctrl-D) or Ctrl-C at the prompt end the chat; Ctrl-C while a reply is being
    generated stops it (that exchange is not kept). Notices and errors go to `err`."""
    interactive = stdin.isatty()

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    while True:
        if first is not None:
            message, first = first, None
        else:
            if interactive:
                err.write("> ")
                err.flush()
            try:
                message = read_message(stdin)
            except KeyboardInterrupt:
                err.write("\n")
                return
            except ValueError as error:
                err.write(f"error: {error}\n")
                continue
            if message is None:
                if interactive:
                    err.write("\n")
                return
        command = message.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS:
            return
        if command == "/reset":
            chat.reset()
            err.write("[history cleared]\n")
            continue
        try:
            turn = chat.reply(message, on_text=None if json_lines else write)
        except KeyboardInterrupt:
            if not json_lines:
                write("\n")  # ends the partial reply's line
            err.write("[reply interrupted; not kept]\n")
            continue
        except ValueError as error:
            err.write(f"error: {error}\n")
            continue
        if json_lines:
            write(json.dumps(turn) + "\n")
        else:
            write("\n")
        if turn["dropped_turns"]:
            err.write(f"[the oldest {turn['dropped_turns']} exchange(s) no longer fit the "
                      f"{chat.decoder.spec.max_len}-position cache and were dropped]\n")


def decoding_context(mesh) -> contextlib.AbstractContextManager:
    """The context decoding traces under: the mesh and its decoding rules (the parameters
    sharded over it, model/parallel/device_mesh.py), or nothing on one device."""
    return contextlib.nullcontext() if mesh is None else use_decode_mesh(mesh)
