"""Prompt normalization: the same meaning in gives the same bytes out.

The canonical layout is ``[system prefix][tools][documents][conversation]``: every system (and
developer) message merged into one prefix, tool definitions as canonical JSON, documents in a
canonical order between fixed separators, then the conversation. Text is NFC-normalized, line
endings become ``\\n`` and trailing whitespace is dropped. With normalization switched off the
messages are rendered as given, in the order given, so a prefix is only shared when the bytes
already were.

The template's control markers all start with ``<|``. Text a client supplies (message content,
tool definitions and calls, document text) can never produce one: ``escape_markers`` neutralizes
every ``<|`` in it, reversibly, so a user message carrying ``<|end|>\n<|assistant|>`` renders
(and hashes) differently from a real multi-turn chat. Text without ``<|`` is left byte-identical.
Document ids appear inside a marker, so they are restricted to a safe alphabet instead
(``is_document_id``). A completion ``prompt`` is the raw prompt and is not escaped: its author
writes the whole text anyway, as with any engine's completions API.

``Layout.user_spans`` names the byte ranges of client-supplied text. A tokenizer with real special
tokens must encode those ranges as plain text (special-token parsing off, as engines do for user
content) and may give special ids only to the markers around them.

An image content part renders as ``<|image:SHA256|>``, the digest of its URL (a ``data:`` URL
carries the image itself, so that is the digest of the image) and its ``detail``: the image's
identity is part of the prompt's bytes, hence of its tokens and of every block hash from the
block holding it on. Two requests differing only in an image share the blocks before it and
none after. (No engine here takes images: the gateway refuses them for text-only engines, but
the hashes are right for one that does.)

Pure functions, no I/O: the live gateway, the admin explain endpoint and the simulator share them.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from prefixgate.gateway.records import record

SYSTEM_ROLES = frozenset({"system", "developer"})
CONVERSATION_ROLES = frozenset({"user", "assistant", "tool", "function"})

DOCUMENT_ID_ALPHABET = "letters, digits, '.', '_', ':' and '-' (first a letter or digit)"
MAX_DOCUMENT_ID = 256
DOCUMENT_ID_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_DOCUMENT_ID - 1}}}$"
_DOCUMENT_ID = re.compile(DOCUMENT_ID_PATTERN)
TOOL_CALLS_MARKER = "<|tool_calls|>"
MAX_IMAGE_URL = 32 * 1024 * 1024  # a data: URL holds the image; the body limit binds first
_MARKERS = re.compile(r"(<\|tool_calls\|>|<\|image:[0-9a-f]{64}\|>)")
_MARKER_START = re.compile(r"<(\\*)\|")


class NormalizationError(ValueError):
    """A request that cannot be rendered; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str


@record
class Segment:
    kind: str  # "system", "tools", "documents", "document", "conversation", "prompt"
    label: str
    start: int  # byte offsets into the rendered text (UTF-8)
    end: int


@dataclass(slots=True)
class Layout:
    text: str
    segments: list[Segment] = field(default_factory=list)
    # Byte ranges [start, end) of client-supplied text: never to be read as control tokens.
    user_spans: list[tuple[int, int]] = field(default_factory=list)

    def encoded(self) -> bytes:
        return self.text.encode("utf-8")


def clean_text(text: str) -> str:
    """NFC, ``\\n`` line endings, no trailing whitespace on any line or at the end."""
    if not text.isascii():  # ASCII is NFC already
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(map(str.rstrip, text.split("\n"))).strip("\n")  # lines stripped in C


def escape_markers(text: str) -> str:
    """``text`` with no ``<|`` left: one more backslash in every ``<``, backslashes, ``|`` run.

    Injective (drop one backslash from each such run to undo it), so different contents still
    render differently; the identity on text without ``<|`` (canonical chats keep their bytes).
    """
    if "<" not in text or "|" not in text:
        return text
    return _MARKER_START.sub(lambda m: "<\\" + m.group(1) + "|", text)


def escape_json_markers(rendered: str) -> str:
    """JSON text with ``<|`` written ``\\u003c|``: still valid JSON decoding to the same value."""
    return rendered.replace("<|", "\\u003c|") if "<|" in rendered else rendered


def is_document_id(value: str) -> bool:
    """Whether ``value`` may name a document (it is written inside a control marker)."""
    return _DOCUMENT_ID.fullmatch(value) is not None  # fullmatch: "$" alone lets "id\n" through


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant whitespace: one byte string per JSON value."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def _part_text(part: Any, param: str) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise NormalizationError("text part needs a string 'text'", f"{param}.text")
        return text
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise NormalizationError(f"content part of type {kind!r} is not supported", param)


def content_text(content: Any, param: str) -> str:
    """The text of an OpenAI message ``content``: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(part, f"{param}[{i}]") for i, part in enumerate(content))
    raise NormalizationError("content must be a string or a list of content parts", param)


def image_marker(part: Mapping[str, Any], param: str) -> str:
    """``<|image:SHA256|>`` for an ``image_url`` content part: its identity in the prompt."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else None
    if not isinstance(url, str) or not url or len(url) > MAX_IMAGE_URL:
        raise NormalizationError("image part needs 'image_url.url', a URL or data: URL", f"{param}.image_url")
    detail = image.get("detail") if isinstance(image, Mapping) else None
    key = url if detail in (None, "auto") else f"{url}\0{detail}"
    return f"<|image:{hashlib.sha256(key.encode('utf-8')).hexdigest()}|>"


def _content(content: Any, param: str) -> str:
    """A message's content rendered: text escaped (``escape_markers``), images as their marker."""
    if not isinstance(content, list) or not any(
        isinstance(p, Mapping) and p.get("type") == "image_url" for p in content
    ):
        return escape_markers(content_text(content, param))
    parts: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "image_url":
            parts.append(image_marker(part, f"{param}[{i}]"))
        else:
            parts.append(escape_markers(_part_text(part, f"{param}[{i}]")))
    return "\n".join(parts)


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


def _utf8_len(text: str) -> int:
    """``len(text.encode("utf-8"))`` without encoding ASCII text (the common case: a flag read)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class _Builder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.offset = 0
        self.segments: list[Segment] = []
        self.user_spans: list[tuple[int, int]] = []

    def add(self, kind: str, label: str, text: str) -> None:
        start = self.offset
        self.parts.append(text)
        self.offset += _utf8_len(text)
        self.segments.append(Segment(kind, label, start, self.offset))

    def add_parts(self, kind: str, label: str, parts: Sequence[tuple[str, bool]]) -> None:
        """One segment made of ``(text, is_client_text)`` parts (client text already escaped)."""
        start = self.offset
        for text, client in parts:
            end = self.offset + _utf8_len(text)
            if client and end > self.offset:
                self.user_spans.append((self.offset, end))
            self.parts.append(text)
            self.offset = end
        self.segments.append(Segment(kind, label, start, self.offset))

    def add_wrapped(self, kind: str, label: str, head: str, body: str, tail: str) -> None:
        """A segment ``head + body + tail`` whose ``body`` is client text (every message of a
        chat without markers in it: the same as ``add_parts`` over the three, written out)."""
        start = self.offset
        body_start = start + _utf8_len(head)
        body_end = body_start + _utf8_len(body)
        if body_end > body_start:
            self.user_spans.append((body_start, body_end))
        self.parts += (head, body, tail)
        self.offset = body_end + _utf8_len(tail)
        self.segments.append(Segment(kind, label, start, self.offset))

    def layout(self) -> Layout:
        return Layout("".join(self.parts), self.segments, self.user_spans)


def _document_id(doc: Document) -> str:
    if not is_document_id(doc.id):
        raise NormalizationError(
            f"document id {doc.id[:64]!r} is not allowed: use 1 to {MAX_DOCUMENT_ID} of "
            + DOCUMENT_ID_ALPHABET,
            "documents",
        )
    return doc.id


def _add_documents(b: _Builder, documents: Sequence[Document], normalize: bool) -> None:
    docs = canonical_documents(documents) if normalize else list(documents)
    b.add("documents", "documents", "<|documents|>\n")
    for d in docs:
        body = escape_markers(clean_text(d.text) if normalize else d.text)
        b.add_wrapped("document", d.id, f'<|document id="{_document_id(d)}"|>\n', body, "\n<|end|>\n")


def _message_parts(text: str) -> list[tuple[str, bool]]:
    """Rendered message text split into client text and markers (``<|tool_calls|>``, images):
    client text is escaped, so every ``<|`` left in it is one of those markers."""
    if "<|" not in text:
        return [(text, True)]
    pieces = _MARKERS.split(text)  # odd indices: the markers
    return [(piece, i % 2 == 0) for i, piece in enumerate(pieces) if piece]


def _message_text(msg: Mapping[str, Any], i: int, normalize: bool) -> str:
    content = msg.get("content")
    # a string (most messages) is escaped as it is; parts and images go the long way
    text = (
        escape_markers(content) if isinstance(content, str) else _content(content, f"messages[{i}].content")
    )
    calls = msg.get("tool_calls")
    if calls:
        rendered = canonical_json(calls) if normalize else orjson.dumps(calls).decode()
        text += "\n" + TOOL_CALLS_MARKER + escape_json_markers(rendered)
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
        joined = "\n\n".join(system)
        b.add_parts(
            "system", "system", [("<|system|>\n", False), *_message_parts(joined), ("\n<|end|>\n", False)]
        )
    if tools:
        rendered = canonical_json(list(tools)) if normalize else orjson.dumps(list(tools)).decode()
        b.add_wrapped("tools", "tools", "<|tools|>\n", escape_json_markers(rendered), "\n<|end|>\n")
    if documents:
        _add_documents(b, documents, normalize)
    b.add("conversation", "conversation", "<|conversation|>\n")
    for i, role, text in turns:
        if "<|" in text:  # markers (tool calls, images) among the client's text
            parts = [(f"<|{role}|>\n", False), *_message_parts(text), ("\n<|end|>\n", False)]
            b.add_parts("message", f"messages[{i}]:{role}", parts)
        else:
            b.add_wrapped("message", f"messages[{i}]:{role}", f"<|{role}|>\n", text, "\n<|end|>\n")
    b.add("generation", "assistant", "<|assistant|>\n")
    return b.layout()


def render_completion(prompt: str, *, documents: Sequence[Document] = (), normalize: bool = True) -> Layout:
    """Render a completion prompt; documents (if any) come first, in canonical order."""
    b = _Builder()
    if documents:
        _add_documents(b, documents, normalize)
    if normalize:
        prompt = unicodedata.normalize("NFC", prompt).replace("\r\n", "\n").replace("\r", "\n")
    b.add("prompt", "prompt", prompt)  # the raw prompt: its author writes any markers on purpose
    return b.layout()
