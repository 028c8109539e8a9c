"""The pairwise judge's prompt template: a question and two responses, then the choice.

    render(DEFAULT_TEMPLATE, question="12+7=", response_a="19", response_b="18")

A template names each of {question}, {response_a} and {response_b} (literal braces are written
{{ }}); it is checked when the config is read, so a template missing one is refused by name
before any model is loaded. Only these plain fields are allowed (no attribute access, index,
conversion or format spec), so rendering model output through it is safe.
"""

from __future__ import annotations

import string

PLACEHOLDERS = ("question", "response_a", "response_b")
DEFAULT_TEMPLATE = ("Question: {question}\nResponse A: {response_a}\nResponse B: {response_b}\n"
                    "Which response is better? Answer A or B:")
DEFAULT_CHOICES = (" A", " B")  # the judge's next token after the template: A wins, B wins


def template_error(template: object) -> str | None:
    """What is wrong with `template`, or None if it is usable."""
    if not isinstance(template, str):
        return f"must be a string, got {template!r}"
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion
                  in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        return f"malformed braces ({err}); write literal braces as {{{{ }}}}"
    for name, spec, conversion in fields:
        if name not in PLACEHOLDERS or spec or conversion:
            return (f"unknown placeholder {{{name}{'!' + conversion if conversion else ''}"
                    f"{':' + spec if spec else ''}}}; use "
                    f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    missing = [p for p in PLACEHOLDERS if p not in {name for name, _, _ in fields}]
    if missing:
        return f"missing placeholder {', '.join('{' + p + '}' for p in missing)}"
    return None


def literal_pieces(template: str) -> list[str]:
    """The template's own text between placeholders (what the judge's tokenizer must spell)."""
    return [text for text, _, _, _ in string.Formatter().parse(template) if text]


def render(template: str, *, question: str, response_a: str, response_b: str) -> str:
    return template.format(question=question, response_a=response_a, response_b=response_b)
