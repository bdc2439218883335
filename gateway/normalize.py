"""Prompt normalization: the same meaning in gives the same bytes out.

The canonical layout is ``[system prefix][tools][documents][conversation]``: every system (and
developer) message merged into one prefix, tool definitions as canonical JSON, documents in a
canonical order between fixed separators, then the conversation. Text is NFC-normalized, line
endings become ``\\n`` and trailing whitespace is dropped. With normalization switched off the
messages are rendered as given, in the order given, so a prefix is only shared when the bytes
already were.

Pure functions, no I/O: the live gateway, the admin explain endpoint and the simulator share them.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

SYSTEM_ROLES = frozenset({"system", "developer"})
CONVERSATION_ROLES = frozenset({"user", "assistant", "tool", "function"})


class NormalizationError(ValueError):
    """A request that cannot be rendered; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str  # "system", "tools", "documents", "document", "conversation", "prompt"
    label: str
    start: int  # byte offsets into the rendered text (UTF-8)
    end: int


@dataclass(slots=True)
class Layout:
    text: str
    segments: list[Segment] = field(default_factory=list)

    def encoded(self) -> bytes:
        return self.text.encode("utf-8")


def clean_text(text: str) -> str:
    """NFC, ``\\n`` line endings, no trailing whitespace on any line or at the end."""
    text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n")


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant whitespace: one byte string per JSON value."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def content_text(content: Any, param: str) -> str:
    """The text of an OpenAI message ``content``: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise NormalizationError("text part needs a string 'text'", f"{param}[{i}].text")
                parts.append(text)
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise NormalizationError(f"content part of type {kind!r} is not supported", f"{param}[{i}]")
        return "\n".join(parts)
    raise NormalizationError("content must be a string or a list of content parts", param)


def canonical_documents(docs: Sequence[Document]) -> list[Document]:
    """Sorted by id then text, duplicates dropped: retriever order does not matter."""
    seen: set[tuple[str, str]] = set()
    out: list[Document] = []
    for d in sorted(docs, key=lambda d: (d.id, d.text)):
        key = (d.id, d.text)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


class _Builder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.offset = 0
        self.segments: list[Segment] = []

    def add(self, kind: str, label: str, text: str) -> None:
        start = self.offset
        self.parts.append(text)
        self.offset += len(text.encode("utf-8"))
        self.segments.append(Segment(kind, label, start, self.offset))

    def layout(self) -> Layout:
        return Layout("".join(self.parts), self.segments)


def _message_text(msg: Mapping[str, Any], i: int, normalize: bool) -> str:
    text = content_text(msg.get("content"), f"messages[{i}].content")
    calls = msg.get("tool_calls")
    if calls:
        text += "\n<|tool_calls|>" + (canonical_json(calls) if normalize else orjson.dumps(calls).decode())
    return clean_text(text) if normalize else text


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    documents: Sequence[Document] = (),
    tools: Sequence[Any] | None = None,
    normalize: bool = True,
) -> Layout:
    """Render a chat request into its canonical layout."""
    if not messages:
        raise NormalizationError("messages must be a non-empty array", "messages")
    system: list[str] = []
    turns: list[tuple[int, str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise NormalizationError("each message must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise NormalizationError("message needs a string 'role'", f"messages[{i}].role")
        if role not in SYSTEM_ROLES and role not in CONVERSATION_ROLES:
            raise NormalizationError(f"unknown role {role!r}", f"messages[{i}].role")
        text = _message_text(msg, i, normalize)
        if normalize and role in SYSTEM_ROLES:
            if text:
                system.append(text)
        else:
            turns.append((i, role, text))
    b = _Builder()
    if normalize:
        b.add("system", "system", "<|system|>\n" + "\n\n".join(system) + "\n<|end|>\n")
    if tools:
        rendered = canonical_json(list(tools)) if normalize else orjson.dumps(list(tools)).decode()
        b.add("tools", "tools", "<|tools|>\n" + rendered + "\n<|end|>\n")
    if documents:
        docs = canonical_documents(documents) if normalize else list(documents)
        b.add("documents", "documents", "<|documents|>\n")
        for d in docs:
            body = clean_text(d.text) if normalize else d.text
            b.add("document", d.id, f'<|document id="{d.id}"|>\n{body}\n<|end|>\n')
    b.add("conversation", "conversation", "<|conversation|>\n")
    for i, role, text in turns:
        b.add("message", f"messages[{i}]:{role}", f"<|{role}|>\n{text}\n<|end|>\n")
    b.add("generation", "assistant", "<|assistant|>\n")
    return b.layout()


def render_completion(prompt: str, *, documents: Sequence[Document] = (), normalize: bool = True) -> Layout:
    """Render a completion prompt; documents (if any) come first, in canonical order."""
    b = _Builder()
    if documents:
        docs = canonical_documents(documents) if normalize else list(documents)
        b.add("documents", "documents", "<|documents|>\n")
        for d in docs:
            body = clean_text(d.text) if normalize else d.text
            b.add("document", d.id, f'<|document id="{d.id}"|>\n{body}\n<|end|>\n')
    if normalize:
        prompt = unicodedata.normalize("NFC", prompt).replace("\r\n", "\n").replace("\r", "\n")
    b.add("prompt", "prompt", prompt)
    return b.layout()
