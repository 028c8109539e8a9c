"""The sandbox chat templates render in, and the assistant spans SFT trains on.

    text = run_template(source, origin, marking=False, context={"messages": [...], ...})
    text, spans = marked_spans(run_template(source, origin, marking=True, context=...))
    mask = token_mask(encoding.offsets, spans)     # bool [T]: tokens overlapping a span

A chat template is untrusted code shipped with a checkpoint (docs/architecture.md,
"Guarantees to users"). It runs in Jinja's `ImmutableSandboxedEnvironment`, set up as transformers'
`apply_chat_template` does (trim_blocks, lstrip_blocks, loopcontrols, a `tojson` that does not
HTML-escape, `raise_exception`, `strftime_now`, the `{% generation %}` tag), so a released
template renders the same text here as there. One difference: touching an unsafe attribute
(`''.__class__`) raises at once instead of rendering as an empty string.

The assistant spans come from `{% generation %}` blocks when the template has them (rendered
between two marker characters, `marked_spans`), else from rendering the conversation one turn
at a time (`incremental_spans`); `model.tokenizers.chat.ChatTokenizer.encode_chat` picks.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

import numpy as np
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.tokenizers import template_limits as limits

_OPEN, _CLOSE = "\ufdd0", "\ufdd1"  # Unicode noncharacters: marks around {% generation %} output
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


def has_generation_blocks(source: str) -> bool:
    """Whether template `source` marks assistant text with {% generation %} (a mention of the
    tag inside a {# comment #} does not count)."""
    return bool(_GENERATION_TAG.search(_COMMENT.sub("", source)))


def one_line(err: BaseException) -> str:
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
    """Raises on an unsafe attribute (Jinja would return an Undefined that prints as ''), and
    renders within the bounds of `model.tokenizers.template_limits`: the template's code is
    rewritten as it compiles, and operators, calls and filters are sized before they run."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filters = {name: limits.bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(limits.FILTERS)

    def _parse(self, source, name, filename):
        return limits.BoundedCode(self).visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object")

    def call_binop(self, context, operator, left, right):
        return limits.checked_binop(operator, left, right, self.binop_table[operator])

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped
        name, receiver = getattr(target, "__name__", ""), getattr(target, "__self__", None)
        if name == "join" and isinstance(receiver, str) and args:
            args = (list(args[0]), *args[1:])  # sized before it is joined
        limits.check_call(name, receiver, args, kwargs)
        return limits.check_value(super().call(__context, __obj, *args, **kwargs))


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if len(str(indent)) > 64 if isinstance(indent, str) else (indent or 0) > 64:
        raise TemplateError(f"tojson: an indent of more than 64 characters, got {indent!r}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str, marking: bool):
    """Template `source` in the sandbox; with `marking`, {% generation %} output is wrapped in
    _OPEN/_CLOSE. Raises TemplateSyntaxError."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[
        _MarkingGenerationTag if marking else _GenerationTag, loopcontrols])
    env.filters["tojson"] = limits.bounded_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def run_template(source: str, origin: str, marking: bool, context: dict) -> str:
    """Rendered text; every failure of the (untrusted) template -> one-line ValueError."""
    try:
        with limits.budget():
            return "".join(compile_template(source, marking).generate(**context))
    except limits.RenderLimitError as err:
        raise ValueError(f"chat template of {origin}: stopped: {one_line(err)} (a chat "
                         "template's rendering is bounded); fix or replace the template"
                         ) from None
    except SecurityError as err:
        raise ValueError(f"chat template of {origin}: unsafe operation blocked: {one_line(err)}"
                         ) from None
    except TemplateError as err:  # raise_exception(...), undefined errors, syntax errors
        raise ValueError(f"chat template of {origin}: {one_line(err)}") from None
    except Exception as err:  # e.g. TypeError of 'a' + 1: any failure of foreign code
        raise ValueError(f"chat template of {origin}: {type(err).__name__}: {one_line(err)}"
                         ) from None



def marked_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
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


def incremental_spans(render, messages: list, text: str) -> list[tuple[int, int]]:
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


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True on the tokens whose character span overlaps one of `spans` (a token straddling a
    span's edge counts as inside, as in transformers)."""
    starts, ends = np.array(offsets, np.int64).reshape(-1, 2).T
    mask = np.zeros(len(offsets), bool)
    for a, b in spans:
        mask |= (starts < b) & (ends > a)
    return mask
