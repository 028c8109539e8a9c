"""Chat tokenizer of a released model: Hugging Face `tokenizer.json` + its chat template.

    tok = load_chat_tokenizer("path/to/model_dir")      # or the path of a tokenizer.json
    prompt = tok.render(messages, add_generation_prompt=True)   # text to generate from
    ids, mask = tok.encode_chat(messages)   # int32 ids; True on the tokens SFT trains on
    tok.eos_ids                             # ids that end a generated turn
    chat_tokenizer_for(load_tokenizer("default"))   # the chat side of a training tokenizer

Templates render in a sandbox (`model.tokenizers.chat_template`), with `bos_token`/`eos_token`
and the other SPECIAL_FIELDS in the context, as transformers does.

Special-token spellings in message text are encoded as the special tokens (as in transformers):
content is trusted to not forge turn boundaries. The assistant mask is located by characters,
not by tokens, so such content can mislead the model but never the mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers
from jinja2.exceptions import TemplateSyntaxError

from model.tokenizers.chat_template import (
    compile_template,
    has_generation_blocks,
    incremental_spans,
    marked_spans,
    one_line,
    run_template,
    token_mask,
)
from model.tokenizers.text import DEFAULT_PATH, SHIPPED, TextTokenizer

ROLES = ("system", "user", "assistant", "tool")
# End-of-turn tokens of common chat formats; in `eos_ids` when the tokenizer has them as specials.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
SPECIAL_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")  # passed to the template
# Chat templates of the shipped tokenizers that have one (`arith_chars` has none).
SHIPPED_TEMPLATES = {"default": DEFAULT_PATH.with_name("default_chat_template.jinja")}


def validate_messages(messages) -> None:
    """Raises a one-line ValueError naming the first bad message: each must be a dict with a
    role in ROLES and str content (an assistant may have `tool_calls` instead)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected a dict, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: role {m.get('role')!r} is not one of {ROLES}")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"messages[{i}]: tool_calls must be a list on an assistant message")
        for j, call in enumerate(calls or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments", {}), (dict, str))):
                raise ValueError(f"messages[{i}].tool_calls[{j}]: expected {{'type': 'function', "
                                 f"'function': {{'name': str, 'arguments': dict or str}}}}")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(f"messages[{i}]: content must be a str, got "
                             f"{type(m.get('content')).__name__}")


class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the chat template(s) and special tokens of a model release.

    `templates` maps names to Jinja sources ("default"; "tool_use" is used when tools are given,
    as in transformers); `origins` maps the names to the files they came from (for errors);
    `special_tokens` maps SPECIAL_FIELDS to their spellings; `eos_ids` holds the ids that end a
    generated turn."""

    def __init__(self, hf: tokenizers.Tokenizer, templates: dict[str, str],
                 special_tokens: dict[str, str], eos_ids: frozenset[int],
                 origins: dict[str, str] | None = None):
        self.hf, self.templates, self.special_tokens = hf, templates, special_tokens
        self.eos_ids, self.origins = eos_ids, origins or {}
        self.vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def template_name(self, tools=None) -> str:
        """Name of the template to render, chosen as transformers does."""
        if tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" not in self.templates:
            found = f"only {sorted(self.templates)}" if self.templates else "none"
            raise ValueError(f"chat template: the tokenizer has no default chat template ({found}"
                             "); add chat_template to tokenizer_config.json")
        return "default"

    def _render(self, messages, tools, add_generation_prompt, marking=False, **extra) -> str:
        name = self.template_name(tools)
        context = dict(self.special_tokens, messages=messages, tools=tools,
                       add_generation_prompt=add_generation_prompt, **extra)
        return run_template(self.templates[name], self.origins.get(name, name), marking, context)

    def render(self, messages, *, tools=None, add_generation_prompt=False, **extra) -> str:
        """messages (OpenAI-style dicts, see validate_messages), tools (JSON schemas) and
        `extra` template variables (e.g. enable_thinking=True) -> the chat template's text."""
        validate_messages(messages)
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools: expected a list of dicts (JSON schemas)")
        return self._render(messages, tools, add_generation_prompt, **extra)

    def encode_chat(self, messages, *, tools=None, add_generation_prompt=False,
                    **extra) -> tuple[np.ndarray, np.ndarray]:
        """-> (ids int32 [T], assistant_mask bool [T]) of the rendered chat, no special tokens
        added beyond the template's. The mask is True on what SFT trains on: with a template
        that has {% generation %} blocks, exactly their output; otherwise each assistant
        message's rendering after its role header up to and including its end-of-turn token
        (e.g. `content<|im_end|>`, not the newline after it); see
        chat_template.incremental_spans."""
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           **extra)
        if has_generation_blocks(self.templates[self.template_name(tools)]):
            unmarked, spans = marked_spans(self._render(messages, tools, add_generation_prompt,
                                                         marking=True, **extra))
            if unmarked != text:  # the input held a mark character
                raise ValueError("messages: contain the reserved characters U+FDD0/U+FDD1")
        else:
            spans = incremental_spans(
                lambda m, g: self._render(m, tools, g, **extra), messages, text)
        encoding = self.hf.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int32), token_mask(encoding.offsets, spans)

    def __repr__(self) -> str:
        return f"ChatTokenizer(vocab_size={self.vocab_size}, templates={sorted(self.templates)})"


def _read_json(path: Path) -> dict:
    """JSON object of `path`, or a one-line ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({one_line(err)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_field(config: dict, field: str, path: Path) -> str | None:
    """A special-token field: a string, an AddedToken dict {"content": str, ...} or null."""
    value = config.get(field)
    value = value.get("content", 0) if isinstance(value, dict) else value  # 0: no content
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {field} must be a string or {{\"content\": str}}")
    return value


def _templates(config: dict, path: Path) -> dict[str, str]:
    """`chat_template` of tokenizer_config.json (a string or [{name, template}, ...]) -> dict."""
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{path}: chat_template must be a string or a list of "
                     "{\"name\": str, \"template\": str}")


def _add_declared_tokens(hf: tokenizers.Tokenizer, decoder, path: Path) -> None:
    """Adds the tokens of `added_tokens_decoder` ({"id": {"content": str, "special": bool,
    ...}}) that tokenizer.json lacks; each must end up with its declared id."""
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: added_tokens_decoder must be an object")
    for key, entry in decoder.items():
        if not (key.isdigit() and isinstance(entry, dict)
                and isinstance(entry.get("content"), str)):
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] must map an id to "
                             "{\"content\": str, ...}")
    for key, entry in sorted(decoder.items(), key=lambda item: int(item[0])):  # ids in order
        content = entry["content"]
        if hf.token_to_id(content) is None:
            flags = {k: bool(entry[k]) for k in ("single_word", "lstrip", "rstrip", "normalized",
                                                  "special") if k in entry}
            token = tokenizers.AddedToken(content, **flags)
            (hf.add_special_tokens if flags.get("special") else hf.add_tokens)([token])
        if hf.token_to_id(content) != int(key):
            raise ValueError(f"{path}: added_tokens_decoder gives {content!r} id {key}, but the "
                             f"tokenizer has it at id {hf.token_to_id(content)}")


def _eos_ids(hf: tokenizers.Tokenizer, eos_token: str | None, config_path: Path,
             gen_path: Path) -> frozenset[int]:
    """eos_token, the END_OF_TURN tokens that are special added tokens, and generation_config.json
    `eos_token_id` (an int or a list of ints; what HF `generate` stops on) when present."""
    specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    ids = {hf.token_to_id(t) for t in END_OF_TURN if t in specials}
    if eos_token is not None:
        if hf.token_to_id(eos_token) is None:
            raise ValueError(f"{config_path}: eos_token {eos_token!r} is not in the vocabulary")
        ids.add(hf.token_to_id(eos_token))
    if gen_path.is_file():
        value = _read_json(gen_path).get("eos_token_id", [])
        value = [value] if isinstance(value, int) else value
        if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in value)):
            raise ValueError(f"{gen_path}: eos_token_id must be an int or a list of ints")
        ids.update(value)
    return frozenset(ids)


def load_chat_tokenizer(path) -> ChatTokenizer:
    """A Hugging Face model directory (or the path of its tokenizer.json) -> ChatTokenizer.

    Reads tokenizer.json, and next to it (each optional) tokenizer_config.json (chat_template,
    special tokens, added_tokens_decoder), chat_template.jinja (which, as in transformers,
    replaces the config's default template) and generation_config.json (eos_token_id)."""
    path = Path(path)
    tokenizer_path = path / "tokenizer.json" if path.is_dir() else path
    if not tokenizer_path.is_file():
        raise ValueError(f"{tokenizer_path}: no such file (expected a Hugging Face tokenizer.json "
                         "or a model directory holding one)")
    try:
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as err:  # tokenizers raises bare Exception on malformed files
        raise ValueError(f"{tokenizer_path}: not a Hugging Face tokenizer.json ({one_line(err)})"
                         ) from None
    return _with_directory_config(hf, tokenizer_path.parent)


def _with_directory_config(hf: tokenizers.Tokenizer, directory: Path) -> ChatTokenizer:
    """`hf` plus the chat configuration files of `directory` (see load_chat_tokenizer)."""
    config_path, jinja_path = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    config = _read_json(config_path) if config_path.is_file() else {}
    _add_declared_tokens(hf, config.get("added_tokens_decoder", {}), config_path)
    templates = _templates(config, config_path)
    origins = {name: f"{config_path} ({name!r})" for name in templates}
    if jinja_path.is_file():
        templates["default"] = _read_template(jinja_path)
        origins["default"] = str(jinja_path)
    _check_syntax(templates, origins)
    special = {f: v for f in SPECIAL_FIELDS if (v := _token_field(config, f, config_path))}
    eos_ids = _eos_ids(hf, special.get("eos_token"), config_path,
                       directory / "generation_config.json")
    return ChatTokenizer(hf, templates, special, eos_ids, origins)


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({one_line(err)})") from None


def _check_syntax(templates: dict[str, str], origins: dict[str, str]) -> None:
    """Reports a template's syntax error at load time, naming its file."""
    for name, source in templates.items():
        try:
            compile_template(source, False)
        except TemplateSyntaxError as err:
            raise ValueError(f"chat template of {origins[name]}: syntax error on line "
                             f"{err.lineno}: {one_line(err)}") from None


def chat_tokenizer_for(text: TextTokenizer) -> ChatTokenizer:
    """The chat side of a training tokenizer (`train.data.tokenizer`): `text`'s vocabulary with
    its ids unchanged, and a chat template: the shipped one for `default` (SHIPPED_TEMPLATES),
    else the one of the Hugging Face directory holding the tokenizer.json. Raises a one-line
    ValueError when there is none (`arith_chars`, a bare tokenizer.json)."""
    hf = tokenizers.Tokenizer.from_str(text.hf.to_str())
    hf.encode_special_tokens = False  # the template's special tokens (turn ends) are specials
    if text.name in SHIPPED_TEMPLATES:
        path = SHIPPED_TEMPLATES[text.name]
        templates, origins = {"default": _read_template(path)}, {"default": str(path)}
        _check_syntax(templates, origins)
        eos = text.hf.id_to_token(text.eos_id)
        chat = ChatTokenizer(hf, templates, {"eos_token": eos}, frozenset({text.eos_id}), origins)
    elif text.name in SHIPPED:
        chat = ChatTokenizer(hf, {}, {}, frozenset())
    else:
        path = Path(text.name)
        chat = _with_directory_config(hf, path if path.is_dir() else path.parent)
    if "default" not in chat.templates:
        raise ValueError(f"tokenizer {text.name!r} has no chat template to render chat data "
                         "with; use 'default' or a Hugging Face tokenizer directory whose "
                         "tokenizer_config.json (or chat_template.jinja) has one")
    if chat.vocab_size != text.vocab_size:
        raise ValueError(f"tokenizer {text.name!r}: tokenizer_config.json declares "
                         f"{chat.vocab_size - text.vocab_size} token(s) that tokenizer.json "
                         "lacks; add them to tokenizer.json")
    return chat


def write_tokenizer_files(directory: Path, text: TextTokenizer) -> None:
    """Writes training tokenizer `text` as a Hugging Face model directory holds it:
    tokenizer.json (its ids unchanged) and tokenizer_config.json with its end-of-text token and,
    when it has one (`chat_tokenizer_for`), its chat template, so that `load_chat_tokenizer`
    reads the same vocabulary, stop tokens and template back."""
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(text.hf.to_str(), encoding="utf-8")
    config: dict = {"eos_token": text.hf.id_to_token(text.eos_id)}
    try:
        chat = chat_tokenizer_for(text)
    except ValueError:  # no chat template (arith_chars, a bare tokenizer.json)
        chat = None
    if chat is not None:
        config.update(chat.special_tokens)
        templates = chat.templates
        config["chat_template"] = (templates["default"] if list(templates) == ["default"] else
                                   [{"name": n, "template": t} for n, t in templates.items()])
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n",
                                                     encoding="utf-8")
