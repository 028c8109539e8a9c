"""Resource bounds of a chat template's rendering (the sandbox itself is
`model.tokenizers.chat_template`).

A template is untrusted code: Jinja's sandbox stops attribute escapes, not a `{{ s * 10**9 }}`
or a loop doubling a string, which exhaust the host's memory before anything returns. Every
rendering therefore runs under a `Budget`: at most MAX_CHARS characters emitted in all (the
text of every output node, macro and block bodies included) and MAX_SECONDS of time. The
template's code is rewritten once, when it compiles, so that every output piece is counted,
every loop step checks the clock, and `~` concatenation is sized before it joins; the sandbox's
hooks size repetition, concatenation, formatting, `replace`/`join`-like calls and filters from
their inputs *before* they allocate (`estimated_size`), and refuse integer arguments (widths,
counts) above the bound. A template that would exceed a bound stops with `RenderLimitError`.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.visitor import NodeTransformer

# 16 Mi characters, far above any conversation a model is trained on or prompted with; the
# largest single allocation a template can cause is a small multiple of it.
MAX_CHARS = 1 << 24
MAX_SECONDS = 10.0
# A format width or precision of 8 digits or more (`%99999999s`, `%.99999999f`,
# `{:>99999999}`), where a field's spec writes it.
_WIDE_FIELD = re.compile(r"%[-+ #0]*\d{8,}|%[-+ #0]*\d*\.\d{8,}|\{[^{}]*:[^{}]*\d{8,}")


class RenderLimitError(TemplateError):
    """A rendering stopped at a bound (the message says which)."""


class Budget:
    """The bounds of one rendering: characters emitted so far and the deadline."""

    def __init__(self) -> None:
        self.emitted = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitError(f"rendering took more than {MAX_SECONDS:g} s")

    def emit(self, text: str) -> str:
        self.emitted += len(text)
        if self.emitted > MAX_CHARS:
            raise RenderLimitError(f"its output exceeds {MAX_CHARS} characters")
        self.check_time()
        return text


_active = threading.local()  # the Budget of the rendering on this thread, if any


@contextlib.contextmanager
def budget() -> Iterator[Budget]:
    """Bounds the renderings of this thread inside the block."""
    outer = getattr(_active, "budget", None)
    _active.budget = Budget()
    try:
        yield _active.budget
    finally:
        _active.budget = outer


def _current() -> Budget | None:
    return getattr(_active, "budget", None)


def _refuse(what: str) -> None:
    raise RenderLimitError(f"{what} would exceed {MAX_CHARS} characters")


def check_value(value: Any, what: str = "a value it builds") -> Any:
    """`value` if its length is within MAX_CHARS."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHARS:
        _refuse(what)
    return value


def check_time() -> None:
    budget = _current()
    if budget is not None:
        budget.check_time()


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else len(str(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _format_size(fmt: str, values: Iterable[Any]) -> int:
    """At most what formatting `values` into `fmt` (`%` or `{}` style) writes: every field
    filled with the longest value. Refuses widths and precisions of 8 digits or more."""
    if _WIDE_FIELD.search(fmt):
        _refuse("a format field's width")
    longest = max((_length(v) for v in values), default=0)
    return len(fmt) + (fmt.count("%") + fmt.count("{")) * longest


def _replace_size(text: str, old: str, new: str, count: Any = None) -> int:
    found = len(text) + 1 if old == "" else text.count(old)
    found = min(found, count) if _is_int(count) and count >= 0 else found
    return len(text) + found * max(0, len(new) - len(old))


def _join_size(separator: str, items: list) -> int:
    return sum(map(_length, items)) + len(separator) * max(0, len(items) - 1)


def _indent_size(text: str, width: Any = 4, *_: Any) -> int:
    return len(text) + (text.count("\n") + 1) * (_length(width) if isinstance(width, str)
                                                 else width)


def _binop_size(operator: str, left: Any, right: Any) -> int | None:
    """An upper bound of the length of `left <operator> right`, None: not a sized result."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(times):
                return len(seq) * max(times, 0)
    if operator == "+" and isinstance(left, (str, list, tuple)) and type(left) is type(right):
        return len(left) + len(right)
    if operator == "%" and isinstance(left, str):
        values = right.values() if isinstance(right, dict) else (
            right if isinstance(right, tuple) else (right,))
        return _format_size(left, values)
    if operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1:
        return right * abs(left).bit_length() // 8  # bytes of the result, as characters
    return None


def checked_binop(operator: str, left: Any, right: Any, apply: Callable[[Any, Any], Any]) -> Any:
    if operator == "+" and type(left) is str and type(right) is str:  # the common case, fast
        if len(left) + len(right) > MAX_CHARS:
            _refuse("the result of '+'")
        return left + right
    size = _binop_size(operator, left, right)
    if size is not None and size > MAX_CHARS:
        _refuse(f"the result of {operator!r}")
    return check_value(apply(left, right))


def estimated_size(name: str, receiver: Any, args: tuple, kwargs: dict) -> int | None:
    """An upper bound of the length of `receiver.name(*args, **kwargs)` (a str method) or of
    filter `name(receiver, *args, **kwargs)` for the calls that can write far more than they
    read; None for the others, whose output their inputs bound."""
    if not isinstance(receiver, str):
        return None
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        return _replace_size(receiver, *args[:3])
    if name in ("format", "format_map"):
        values = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], dict):
            values = list(args[0].values())
        return _format_size(receiver, values)
    if name == "join" and args and isinstance(args[0], list):  # str.join (the call lists it)
        return _join_size(receiver, args[0])
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(receiver) + receiver.count("\t") * (tab if _is_int(tab) else 8)
    if name == "indent":
        return _indent_size(receiver, *args[:1], **{k: v for k, v in kwargs.items()
                                                    if k == "width"})
    if name == "wordwrap":
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring", "\n")
        return len(receiver) * (1 + _length(wrap))
    return None


def check_call(name: str, receiver: Any, args: tuple, kwargs: dict) -> None:
    """Before a call: the clock, integer arguments (widths, counts) and the estimated output
    within the bounds."""
    check_time()
    if any(_is_int(v) and v > MAX_CHARS for v in (*args, *kwargs.values())):
        _refuse(f"an argument of {name}()")
    size = estimated_size(name, receiver, args, kwargs)
    if size is not None and size > MAX_CHARS:
        _refuse(f"the result of {name}()")


def bounded_filter(name: str, function: Callable) -> Callable:
    """Filter `function` (named `name`) with the bounds of `check_call` and `check_value`.
    Its Jinja markers (pass_context, ...) carry over, so Jinja calls it as before."""
    state = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context first

    def bounded(*args: Any, **kwargs: Any) -> Any:
        # Checked whether or not a rendering runs: Jinja also calls filters on constants
        # while it compiles a template.
        if len(args) > state:
            value, rest = args[state], args[state + 1:]
            if name == "join":  # join(value, d="", attribute=None): size the listed items
                separator = rest[0] if rest else kwargs.get("d", "")
                value = list(value)
                if _join_size(str(separator), value) > MAX_CHARS:
                    _refuse("the result of join")
                args = (*args[:state], value, *rest)
            else:
                check_call(name, value, rest, kwargs)
        return check_value(function(*args, **kwargs), f"the result of filter {name}")

    bounded.__dict__.update(getattr(function, "__dict__", {}))  # jinja_pass_arg and friends
    bounded.__name__ = getattr(function, "__name__", name)
    return bounded


def bounded_iter(iterable: Any) -> Iterator[Any]:
    """A for loop's items, checking the clock at each step."""
    budget = _current()
    for item in iterable:
        if budget is not None:
            budget.check_time()
        yield item


def bounded_concat(*parts: Any) -> str:
    """`a ~ b ~ ...`, sized before it is joined."""
    texts = [str(p) for p in parts]
    if sum(map(len, texts)) > MAX_CHARS:
        _refuse("a '~' concatenation")
    return check_value("".join(texts))


def counted_output(value: Any) -> str:
    """One piece of output (text or an expression's value), counted against the budget."""
    text = str(value)
    budget = _current()
    return budget.emit(text) if budget is not None else text


# The filters the rewritten code calls (Jinja calls a filter directly, without the sandbox's
# per-call checks); a template may name them too, which only adds checks.
FILTERS = {"stepjax_counted_output": counted_output, "stepjax_bounded_iter": bounded_iter,
           "stepjax_bounded_concat": bounded_concat}


class BoundedCode(NodeTransformer):
    """Rewrites a parsed template so that its output, loops and `~` concatenations go through
    FILTERS."""

    def __init__(self, environment) -> None:
        self.environment = environment

    def _filter(self, name: str, value: nodes.Expr, args: list, lineno: int) -> nodes.Filter:
        node = nodes.Filter(value, f"stepjax_{name}", args, [], None, None, lineno=lineno)
        return node.set_environment(self.environment)

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [self._filter("counted_output", child, [], node.lineno)
                      for child in node.nodes]
        return node

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._filter("bounded_iter", node.iter, [], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        first, *rest = node.nodes
        return self._filter("bounded_concat", first, rest, node.lineno)
