"""model.tokenizers.chat: chat-template rendering against hand-written strings, the SFT assistant
mask (both the {% generation %} path and the incremental-render fallback), the Jinja sandbox, and
the loader's one-line errors."""

import json
from datetime import datetime

import numpy as np
import pytest

from model.tokenizers.chat import load_chat_tokenizer
from model.tokenizers.text import train_bpe

# ChatML with tools and tool calls; the two {% generation %} lines are dropped for the fallback.
TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- 'Tools:' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('the system message must come first') }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function %}
            {{- '<tool_call>' + ({'name': fn.name, 'arguments': fn.arguments} | tojson) }}
            {{- '</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
FALLBACK_TEMPLATE = TEMPLATE.replace("        {%- generation %}\n", "").replace(
    "        {%- endgeneration %}\n", "")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say ok"},
    {"role": "assistant", "content": "Très bien ✓ ok"},
]
CHAT_TEXT = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
             "<|im_start|>user\nHi there<|im_end|>\n"
             "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
             "<|im_start|>user\nSay ok<|im_end|>\n"
             "<|im_start|>assistant\nTrès bien ✓ ok<|im_end|>\n")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <city> & more",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "assistant", "content": "It is 18C and sunny."},
]
TOOL_CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    """A byte-level BPE (the training tokenizer's trainer) plus ChatML's two specials."""
    texts = [CHAT_TEXT, TOOL_CALL_TEXT, "Weather in Paris? It is 18C and sunny."] * 4
    hf = train_bpe(texts, vocab_size=300)
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return hf.to_str()


def write_model(directory, tokenizer_json, template=TEMPLATE, **config):
    """A Hugging Face style directory: tokenizer.json + tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    config = {"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": None,
              "chat_template": template, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def tok(tmp_path, tokenizer_json):
    return load_chat_tokenizer(write_model(tmp_path / "model", tokenizer_json))


def one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ----------------------------------------------------------------------------- rendering

def test_render_plain_conversation(tok):
    assert tok.render(CHAT) == CHAT_TEXT


def test_render_generation_prompt(tok):
    assert tok.render(CHAT[:4], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nSay ok<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_render_tool_call_and_response(tok):
    assert tok.render(TOOL_CHAT) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n18C, sunny<|im_end|>\n"
        "<|im_start|>assistant\nIt is 18C and sunny.<|im_end|>\n")


def test_render_tools_in_system_block(tok):
    # tojson keeps non-ASCII and does not HTML-escape "<", "&" (Jinja's own tojson would)
    assert tok.render(CHAT[:2], tools=TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.\n\nTools:\n"
        '{"type": "function", "function": {"name": "get_weather", '
        '"description": "Météo <city> & more", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}<|im_end|>\n'
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_globals_and_special_tokens(tmp_path, tokenizer_json):
    template = "{{ eos_token }}|{{ bos_token }}|{{ strftime_now('%Y') }}|{{ greeting }}"
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, template))
    assert tok.render(CHAT, greeting="hi") == f"<|endoftext|>||{datetime.now().year}|hi"
    assert (tok.bos_token, tok.eos_token) == (None, "<|endoftext|>")


def test_encode_decode_and_eos_ids(tmp_path, tokenizer_json):
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json) / "tokenizer.json")
    ids = tok.encode(CHAT_TEXT)
    assert tok.decode(ids) == CHAT_TEXT
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\nYou are terse.\n")
    assert ids[0] == tok.hf.token_to_id("<|im_start|>")
    assert tok.vocab_size == len(tok.hf.get_vocab(with_added_tokens=True))
    eos, im_end = tok.hf.token_to_id("<|endoftext|>"), tok.hf.token_to_id("<|im_end|>")
    assert tok.eos_ids == {eos, im_end}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, eos]}))
    assert load_chat_tokenizer(tmp_path).eos_ids == {eos, im_end, 7}


def test_added_tokens_decoder(tmp_path, tokenizer_json):
    start = len(json.loads(tokenizer_json)["model"]["vocab"]) + 2  # after the ChatML specials
    declared = {str(start): {"content": "<think>", "special": False},
                str(start + 1): {"content": "<|tool|>", "special": True}}
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json,
                                          added_tokens_decoder=declared))
    assert tok.encode("<think>a<|tool|>")[::2] == [start, start + 1]
    assert tok.decode([start, start + 1], skip_special_tokens=True) == "<think>"
    wrong = {"3": {"content": "<|im_end|>", "special": True}}
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(write_model(tmp_path, tokenizer_json, added_tokens_decoder=wrong))
    one_line_error(err, "added_tokens_decoder", "'<|im_end|>'")


# ----------------------------------------------------------------------------- assistant mask

def masked_runs(tok, ids, mask) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("template", [TEMPLATE, FALLBACK_TEMPLATE], ids=["generation", "fallback"])
def test_assistant_mask(tmp_path, tokenizer_json, template):
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, template))
    ids, mask = tok.encode_chat(CHAT)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert tok.decode(ids) == CHAT_TEXT
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>",
                                           "Très bien ✓ ok<|im_end|>"]
    # the generation prompt's role header is not trained on
    ids, mask = tok.encode_chat(CHAT[:4], add_generation_prompt=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>"]
    ids, mask = tok.encode_chat(TOOL_CHAT, tools=TOOLS)
    assert masked_runs(tok, ids, mask) == [TOOL_CALL_TEXT + "<|im_end|>",
                                           "It is 18C and sunny.<|im_end|>"]


def test_a_generation_tag_in_a_comment_is_not_a_block(tmp_path, tokenizer_json):
    template = "{# assistant text would go in {% generation %} blocks #}" + FALLBACK_TEMPLATE
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, template))
    ids, mask = tok.encode_chat(CHAT)
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>",
                                           "Très bien ✓ ok<|im_end|>"]


def test_fallback_mask_needs_prefix_stable_template(tmp_path, tokenizer_json):
    # the last turn is rendered differently, so a prefix is not the start of the whole chat
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% if loop.last %}<end>{% endif %}\n{% endfor %}")
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, template))
    with pytest.raises(ValueError) as err:
        tok.encode_chat(CHAT)
    one_line_error(err, "messages[2]", "{% generation %}")


# ----------------------------------------------------------------------------- sandbox

@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages | attr('__class__') }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ messages.append(1) }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
])
def test_sandbox_blocks_attribute_tricks(tmp_path, tokenizer_json, monkeypatch, template):
    monkeypatch.chdir(tmp_path)
    tok = load_chat_tokenizer(write_model(tmp_path / "model", tokenizer_json, template))
    with pytest.raises(ValueError) as err:
        tok.render(CHAT)
    one_line_error(err, "unsafe operation blocked")
    assert not (tmp_path / "PWNED").exists()


def test_template_errors_are_one_line(tmp_path, tokenizer_json):
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(write_model(tmp_path, tokenizer_json, "{% for %}"))
    one_line_error(err, "tokenizer_config.json", "syntax error")
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, TEMPLATE))
    with pytest.raises(ValueError) as err:
        tok.render([CHAT[1], CHAT[0]])
    one_line_error(err, "the system message must come first")
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, "{{ 'a' + 1 }}"))
    with pytest.raises(ValueError) as err:
        tok.render(CHAT)
    one_line_error(err, "TypeError")


# ----------------------------------------------------------------------------- template choice

def test_chat_template_jinja_file_wins(tmp_path, tokenizer_json):
    write_model(tmp_path, tokenizer_json, "from config")
    (tmp_path / "chat_template.jinja").write_text("from file {{ messages | length }}")
    assert load_chat_tokenizer(tmp_path).render(CHAT) == "from file 5"


def test_named_templates(tmp_path, tokenizer_json):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, named))
    assert tok.render(CHAT) == "plain"
    assert tok.render(CHAT, tools=TOOLS) == "tools"
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, named[1:]))
    with pytest.raises(ValueError) as err:
        tok.render(CHAT)
    one_line_error(err, "no default chat template", "tool_use")


# ----------------------------------------------------------------------------- bad input

def test_missing_or_malformed_files(tmp_path, tokenizer_json):
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(tmp_path / "nowhere")
    one_line_error(err, "tokenizer.json", "no such file")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(tmp_path)
    one_line_error(err, "tokenizer.json", "not a Hugging Face tokenizer.json")
    write_model(tmp_path, tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x",')
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(tmp_path)
    one_line_error(err, "tokenizer_config.json", "not a readable JSON file")


@pytest.mark.parametrize("field, value", [
    ("chat_template", 5), ("chat_template", [{"name": "default"}]),
    ("eos_token", {"text": "</s>"}), ("eos_token", "<never-seen>"),
    ("added_tokens_decoder", {"x": {"content": "a"}})])
def test_malformed_config_fields(tmp_path, tokenizer_json, field, value):
    with pytest.raises(ValueError) as err:
        load_chat_tokenizer(write_model(tmp_path, tokenizer_json, **{field: value}))
    one_line_error(err, "tokenizer_config.json", field)


def test_missing_chat_template(tmp_path, tokenizer_json):
    tok = load_chat_tokenizer(write_model(tmp_path, tokenizer_json, None))
    with pytest.raises(ValueError) as err:
        tok.render(CHAT)
    one_line_error(err, "no default chat template", "chat_template")


@pytest.mark.parametrize("messages, needle", [
    ("hello", "messages: expected a list"),
    ([CHAT[0], "hi"], "messages[1]: expected a dict"),
    ([CHAT[0], {"role": "bot", "content": "hi"}], "messages[1]: role 'bot'"),
    ([{"role": "user"}], "messages[0]: content must be a str"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0]: content must be a str"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0]: tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     "messages[0].tool_calls[0]"),
])
def test_bad_messages(tok, messages, needle):
    with pytest.raises(ValueError) as err:
        tok.render(messages)
    one_line_error(err, needle)
    with pytest.raises(ValueError):
        tok.encode_chat(messages)


def test_bad_tools(tok):
    with pytest.raises(ValueError) as err:
        tok.render(CHAT, tools=["get_weather"])
    one_line_error(err, "tools")


def test_mark_characters_in_messages_are_refused(tok):
    chat = [CHAT[1], {"role": "assistant", "content": "a\ufdd0b"}]
    with pytest.raises(ValueError) as err:
        tok.encode_chat(chat)
    one_line_error(err, "U+FDD0")
