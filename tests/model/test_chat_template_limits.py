"""The bounds of a chat template's rendering (model/tokenizers/template_limits.py): templates
that would build gigabytes or run for hours from a short chat stop at a bound, in one line,
before they allocate. The tokenizer and chat are those of test_chat_template.py."""

from __future__ import annotations

import resource
import time

import pytest
from test_chat_template import CHAT, one_line_error, tokenizer_json, write_model

from model.tokenizers import template_limits
from model.tokenizers.chat import load_chat_tokenizer

__all__ = ["tokenizer_json"]  # a fixture

# Each stops at a bound before it allocates, in well under a second (the process is
# memory-limited to make a miss fail loudly rather than slowly).
GREEDY = "messages[0]['content']"
@pytest.mark.parametrize("template, needle", [
    (f"{{{{ {GREEDY} * 100000000 }}}}", "the result of '*' would exceed"),
    ("{{ 10 ** 100000000 }}", "the result of '**' would exceed"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "a '~' concatenation would exceed"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "the result of '+' would exceed"),
    (f"{{% for i in range(100000) %}}{{% for j in range(100000) %}}{{{{ {GREEDY} }}}}"
     "{% endfor %}{% endfor %}", "its output exceeds"),
    (f"{{% macro f() %}}{{% for i in range(100000) %}}{{{{ {GREEDY} }}}}{{% endfor %}}"
     "{% endmacro %}{% for i in range(100000) %}{% set x = f() %}{% endfor %}",
     "its output exceeds"),  # output buffered in macros counts too
    ("{{ 'x'.ljust(10000000000) }}", "an argument of ljust() would exceed"),
    ("{{ 'x' | center(10000000000) }}", "an argument of center() would exceed"),
    ("{{ '%999999999s' % 'x' }}", "a format field's width would exceed"),
    ("{{ '{:>999999999}'.format('x') }}", "a format field's width would exceed"),
    ("{{ '%.999999999f' % 1.5 }}", "a format field's width would exceed"),
    (f"{{{{ ('x' * 1000).replace('', {GREEDY} * 60000) }}}}", "the result of replace()"),
    (f"{{{{ range(100000) | join({GREEDY} * 60000) }}}}", "the result of join"),
    (f"{{{{ ({GREEDY} * 60000).join(range(100000) | map('string') | list) }}}}",
     "the result of join()"),
    ("{{ ('a\n' * 100000) | indent(1000) }}", "the result of indent() would exceed"),
    ("{{ messages | tojson(indent=100000) }}", "tojson: an indent of more than 64 characters"),
])
def test_template_output_and_work_are_bounded(tmp_path, tokenizer_json, monkeypatch, template,
                                              needle):
    monkeypatch.setattr(template_limits, "MAX_CHARS", 1 << 20)  # the same checks, sooner
    tok = load_chat_tokenizer(write_model(tmp_path / "model", tokenizer_json, template))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))  # a miss fails fast, not in OOM
    try:
        with pytest.raises(ValueError) as err:
            tok.render(CHAT)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    one_line_error(err, "chat template of", f"stopped: {needle}" if "tojson" not in needle
                   else needle)


def test_template_time_is_bounded(tmp_path, tokenizer_json, monkeypatch):
    """Loops that emit nothing still check the clock at every step."""
    monkeypatch.setattr(template_limits, "MAX_SECONDS", 0.2)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tok = load_chat_tokenizer(write_model(tmp_path / "model", tokenizer_json, loops))
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        tok.render(CHAT)
    assert time.monotonic() - start < 5
    one_line_error(err, "stopped: rendering took more than 0.2 s")
