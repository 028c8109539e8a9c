"""Chat documents: jsonl records of `messages` (and optional `tools`), rendered with the chat
template of the tokenizer in use, and the tokens of them that the loss trains on.

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}], "tools": [{...}, ...]}

    doc = chat_document(record, key="chats.jsonl:3", meta={"source": "chats.jsonl"})
    assistant = trains_assistant_only("auto", has_chats=True)  # train.loss_mask resolved
    example = chat_example(chat_tokenizer_for(tok), doc, assistant)  # tokens + both masks

A chat is packed like any other document (its own segment), but takes no metadata prefix and no
extra end-of-text token: its tokens are the template's rendering, exactly what the model sees
when it is prompted with the same template. Under `train.loss_mask=assistant` (the default for
chat data) only the assistant turns' content and end-of-turn tokens are targets
(`ChatTokenizer.encode_chat`), so the model is not trained to write the system prompt or the
user's questions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import numpy as np

from model.config import ConfigError
from model.tokenizers.chat import ChatTokenizer, validate_messages
from train.data.documents import Document


def chat_document(record: dict, key: str, meta: Mapping[str, str]) -> Document:
    """A parsed jsonl record with `messages` -> Document; raises a one-line ValueError naming
    the problem (the caller prefixes the file and line)."""
    messages, tools = record.get("messages"), record.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError("expected a non-empty list 'messages' of {role, content} objects "
                         "(the file's first record is a chat)")
    validate_messages(messages)
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of objects (JSON schemas)")
    text = "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return Document(key, text, meta, chat={"messages": messages, "tools": tools or None})


def trains_assistant_only(loss_mask: str, has_chats: bool) -> bool:
    """`train.loss_mask` for data that holds chat documents (`has_chats`) or not: True when
    chat documents train on their assistant turns only (`assistant`, or `auto` with chat data);
    plain documents always train on all their tokens. Raises ConfigError for `assistant` on
    data without chats."""
    if loss_mask == "assistant" and not has_chats:
        raise ConfigError("train.loss_mask", "'assistant' trains on the assistant turns of "
                          "chat data, but the run's data holds no chat records (jsonl with "
                          "'messages'); use 'all' or 'auto'")
    return has_chats and loss_mask in ("assistant", "auto")


def templates_sha256(chat: ChatTokenizer) -> str:
    """sha256 of the chat templates: part of the data, since another template is other text."""
    return hashlib.sha256(json.dumps(chat.templates, sort_keys=True).encode()).hexdigest()


def chat_example(chat: ChatTokenizer, doc: Document, assistant_only: bool) -> dict:
    """A chat document -> {tokens int32, meta_mask bool, loss_mask bool}, each [T]: the
    rendered conversation; loss_mask True on its assistant turns (`assistant_only`) or on
    every token. A template failure -> one-line ValueError naming the record."""
    try:
        ids, assistant = chat.encode_chat(doc.chat["messages"], tools=doc.chat["tools"])
    except ValueError as err:
        raise ValueError(f"{doc.key}: {err}") from None
    trained = assistant if assistant_only else np.ones(len(ids), np.bool_)
    return {"tokens": ids, "meta_mask": np.zeros(len(ids), np.bool_), "loss_mask": trained}
