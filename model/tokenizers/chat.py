"""Chat tokenizer of a released model: Hugging Face `tokenizer.json` + its chat template.

    tok = load_chat_tokenizer("path/to/model_dir")      # or the path of a tokenizer.json
    prompt = tok.render(messages, add_generation_prompt=True)   # text to generate from
    ids, mask = tok.encode_chat(messages)   # int32 ids; True on the tokens SFT trains on
    tok.eos_ids                             # ids that end a generated turn

A chat template is untrusted code shipped with a checkpoint (docs/architecture.md,
"Guarantees to users"). It runs in Jinja's `ImmutableSandboxedEnvironment`, set up as transformers'
`apply_chat_template` does (trim_blocks, lstrip_blocks, loopcontrols, a `tojson` that does not
HTML-escape, `raise_exception`, `strftime_now`, the `{% generation %}` tag, `bos_token`/`eos_token`
in the context), so a released template renders the same text here as there. One difference:
touching an unsafe attribute (`''.__class__`) raises at once instead of rendering as an empty
string.

Special-token spellings in message text are encoded as the special tokens (as in transformers):
content is trusted to not forge turn boundaries.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
# End-of-turn tokens of common chat formats; in `eos_ids` when the tokenizer has them as specials.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
SPECIAL_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")  # passed to the template
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: marks around {% generation %} output
_HAS_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' marking of the assistant text that
    `return_assistant_tokens_mask` covers: renders the body, between `marks`."""
    tags = {"generation"}
    marks = ("", "")

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(lineno)

    def _wrap(self, caller) -> str:
        return self.marks[0] + caller() + self.marks[1]


class _MarkingGenerationTag(_GenerationTag):
    marks = (_OPEN, _CLOSE)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Raises on an unsafe attribute; Jinja would return an Undefined that prints as ''."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str, marking: bool):
    """Template `source` in the sandbox; with `marking`, {% generation %} output is wrapped in
    _OPEN/_CLOSE. Raises TemplateSyntaxError."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[
        _MarkingGenerationTag if marking else _GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _run_template(source: str, origin: str, marking: bool, context: dict) -> str:
    """Rendered text; every failure of the (untrusted) template -> one-line ValueError."""
    try:
        return _compile(source, marking).render(**context)
    except SecurityError as err:
        raise ValueError(f"chat template of {origin}: unsafe operation blocked: {_one_line(err)}"
                         ) from None
    except TemplateError as err:  # raise_exception(...), undefined errors, syntax errors
        raise ValueError(f"chat template of {origin}: {_one_line(err)}") from None
    except Exception as err:  # e.g. TypeError of 'a' + 1: any failure of foreign code
        raise ValueError(f"chat template of {origin}: {type(err).__name__}: {_one_line(err)}"
                         ) from None


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


def _marked_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """Text with _OPEN/_CLOSE marks -> (text without them, [start, end) spans between them)."""
    text, spans, start, pos = [], [], None, 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece not in (_OPEN, _CLOSE):
            text.append(piece)
            pos += len(piece)
        elif (piece == _OPEN) != (start is None):
            raise ValueError("chat template: nested or unbalanced {% generation %} blocks "
                             "(or messages holding the characters U+FDD0/U+FDD1)")
        elif piece == _OPEN:
            start = pos
        else:
            spans.append((start, pos))
            start = None
    return "".join(text), spans


def _incremental_spans(render, messages: list, text: str) -> list[tuple[int, int]]:
    """Spans of `text` (the whole rendering) added by each assistant message: the rendering of
    messages[:i+1] minus that of messages[:i] with the generation prompt (so the role header is
    left out; a template whose generation prompt is empty has none to leave out), right-stripped
    of whitespace (the separator after the end-of-turn token). Raises if a prefix's rendering is
    not the start of the next one or of `text`. `render(messages, add_generation_prompt) -> str`.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[:i + 1], False)
        if not (after.startswith(before) and text.startswith(after)):
            raise ValueError(f"chat template: cannot locate messages[{i}] by incremental "
                             "rendering (earlier turns render differently once later ones "
                             "follow); mark assistant text with {% generation %}")
        if len(after.rstrip()) > len(before):
            spans.append((len(before), len(after.rstrip())))
    return spans


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True on the tokens whose character span overlaps one of `spans` (a token straddling a
    span's edge counts as inside, as in transformers)."""
    starts, ends = np.array(offsets, np.int64).reshape(-1, 2).T
    mask = np.zeros(len(offsets), bool)
    for a, b in spans:
        mask |= (starts < b) & (ends > a)
    return mask


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
        return _run_template(self.templates[name], self.origins.get(name, name), marking, context)

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
        (e.g. `content<|im_end|>`, not the newline after it); see _incremental_spans."""
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           **extra)
        if _HAS_GENERATION.search(self.templates[self.template_name(tools)]):
            unmarked, spans = _marked_spans(self._render(messages, tools, add_generation_prompt,
                                                         marking=True, **extra))
            if unmarked != text:  # the input held a mark character
                raise ValueError("messages: contain the reserved characters U+FDD0/U+FDD1")
        else:
            spans = _incremental_spans(
                lambda m, g: self._render(m, tools, g, **extra), messages, text)
        encoding = self.hf.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int32), _token_mask(encoding.offsets, spans)

    def __repr__(self) -> str:
        return f"ChatTokenizer(vocab_size={self.vocab_size}, templates={sorted(self.templates)})"


def _read_json(path: Path) -> dict:
    """JSON object of `path`, or a one-line ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({_one_line(err)})") from None
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
        raise ValueError(f"{tokenizer_path}: not a Hugging Face tokenizer.json ({_one_line(err)})"
                         ) from None
    directory = tokenizer_path.parent
    config_path, jinja_path = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    config = _read_json(config_path) if config_path.is_file() else {}
    _add_declared_tokens(hf, config.get("added_tokens_decoder", {}), config_path)
    templates = _templates(config, config_path)
    origins = {name: f"{config_path} ({name!r})" for name in templates}
    if jinja_path.is_file():
        try:
            templates["default"] = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{jinja_path}: unreadable ({_one_line(err)})") from None
        origins["default"] = str(jinja_path)
    for name, source in templates.items():  # report a syntax error now, naming the file
        try:
            _compile(source, False)
        except TemplateSyntaxError as err:
            raise ValueError(f"chat template of {origins[name]}: syntax error on line "
                             f"{err.lineno}: {_one_line(err)}") from None
    special = {f: v for f in SPECIAL_FIELDS if (v := _token_field(config, f, config_path))}
    eos_ids = _eos_ids(hf, special.get("eos_token"), config_path,
                       directory / "generation_config.json")
    return ChatTokenizer(hf, templates, special, eos_ids, origins)
