"""prefixgate's canonical chat as messages, for the model's own chat template.

The same meaning must give the same tokens, so normalization runs on the messages before the
template: every system (and developer) message merged into one system message at the front, the
request's documents next (canonical order, one system message each, so each is its own segment of
the rendered text and is tokenized once however often it comes again), then the conversation in
its order. Text is cleaned as ``openai.normalize`` cleans it (NFC, ``\\n`` line endings, no trailing
whitespace) and client text never carries a ``<|`` marker (``escape_markers``): both are the
identity on a chat that is already canonical, so such a chat renders byte for byte as the engine's
template renders it. With normalization off the messages keep their order; documents go after the
leading system messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixgate.openai.normalize import (
    CONVERSATION_ROLES,
    SYSTEM_ROLES,
    Document,
    NormalizationError,
    canonical_documents,
    clean_text,
    content_text,
    escape_markers,
    is_document_id,
)
from prefixgate.openai.tool_messages import template_tool_calls

PASSTHROUGH_KEYS = ("name", "tool_call_id", "tool_calls", "reasoning_content")


def escape_value(value: Any, normalize: bool) -> Any:
    """``value`` with every string escaped (and, normalized, dict keys sorted): JSON-like client
    data (tools, tool calls) that a template may print."""
    if isinstance(value, str):
        return escape_markers(value)
    if isinstance(value, Mapping):
        keys = sorted(value, key=str) if normalize else list(value)
        return {str(k): escape_value(value[k], normalize) for k in keys}
    if isinstance(value, (list, tuple)):
        return [escape_value(v, normalize) for v in value]
    return value


def document_text(doc: Document, normalize: bool) -> str:
    if not is_document_id(doc.id):
        raise NormalizationError(f"document id {doc.id[:64]!r} is not allowed", "documents")
    body = escape_markers(clean_text(doc.text) if normalize else doc.text)
    return f'<document id="{doc.id}">\n{body}\n</document>'


def _message(msg: Mapping[str, Any], i: int, role: str, normalize: bool) -> dict[str, Any]:
    text = escape_markers(content_text(msg.get("content"), f"messages[{i}].content"))
    out: dict[str, Any] = {"role": role, "content": clean_text(text) if normalize else text}
    for key in PASSTHROUGH_KEYS:
        if msg.get(key) is not None:
            value = msg[key]
            if key == "tool_calls" and isinstance(value, list):
                value = template_tool_calls(value)  # arguments as objects, as templates take them
            out[key] = escape_value(value, normalize)
    return out


def canonical_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    documents: Sequence[Document] = (),
    normalize: bool = True,
    documents_apart: bool = True,
) -> list[dict[str, Any]]:
    """The messages the template renders. ``documents_apart=False`` puts the documents into the
    system message instead (for templates that refuse a second system message)."""
    if not messages:
        raise NormalizationError("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    system: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise NormalizationError("each message must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise NormalizationError("message needs a string 'role'", f"messages[{i}].role")
        if role not in SYSTEM_ROLES and role not in CONVERSATION_ROLES:
            raise NormalizationError(f"unknown role {role!r}", f"messages[{i}].role")
        if normalize and role in SYSTEM_ROLES:
            m = _message(msg, i, "system", normalize)
            if m["content"]:
                system.append(m["content"])
            continue
        out.append(_message(msg, i, role, normalize))
    docs = [document_text(d, normalize) for d in (canonical_documents(documents) if normalize else documents)]
    if normalize and system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not docs:
        return out
    lead = 0
    while lead < len(out) and out[lead]["role"] in SYSTEM_ROLES:
        lead += 1
    if documents_apart:
        return out[:lead] + [{"role": "system", "content": d} for d in docs] + out[lead:]
    if lead:
        first = dict(out[0])
        first["content"] = "\n\n".join([first["content"], *docs]) if first["content"] else "\n\n".join(docs)
        return [first, *out[1:]]
    return [{"role": "system", "content": "\n\n".join(docs)}, *out]
