"""The body an OpenAI-compatible engine gets for a request: the client's, after normalization.

An HTTP worker (vLLM, SGLang, TGI, any OpenAI-compatible server) renders the chat template and
tokenizes itself, so it is sent the request rather than tokens: the gateway's normalized
messages (or completion prompt), and the client's own fields otherwise (sampling and any
engine-specific knob), minus what only the gateway understands or what it cannot relay.

Normalized messages follow the gateway's canonical layout (``openai.normalize``): with
normalization on, every system/developer message is merged into one leading system message
(cleaned text), followed by the request's documents in canonical order, then the conversation
with cleaned text; with it off, the messages as sent, the documents (if any) in a system
message before them. Requests that mean the same thing thus reach the engine as the same bytes,
and its prefix cache shares them.

The engine is always asked to stream with ``stream_options.include_usage``: the gateway relays
the stream as token deltas and learns usage (cached tokens included) from the engine, whether
or not the client asked to see usage; the gateway's own response shows usage to a client only
when it asked.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from prefixgate.gateway.nodeclient.base import OpenAIBody
from prefixgate.openai.normalize import (
    SYSTEM_ROLES,
    Document,
    canonical_json,
    clean_text,
    content_text,
    render_completion,
)
from prefixgate.openai.schema import ParsedRequest, choice_seed

# Fields the gateway owns: consumed by it (documents, pins), replaced by it (the prompt, the
# length, streaming; ``n``: each choice is its own request, with its own seed, ``for_choice``),
# or that ask for output the gateway's token stream does not carry.
GATEWAY_FIELDS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "documents",
        "document_ids",
        "pin_seconds",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "echo",
        "cache_salt",  # replaced: the tenant's namespace salt (``gateway.core.tenancy``)
        "extra_key",
        "priority",  # the request's, sent as ``engine_priority`` says (``with_priority``)
    }
)
MAX_ENGINE_SEED = 2**63 - 1
# When the body carries the request's ``priority`` (the setting ``engine_priority``): never; as
# is (the engine schedules lower values first); negated (it schedules higher values first).
ENGINE_PRIORITY = ("off", "on", "inverted")
TEXT_PARTS = ("text", "input_text")


def _documents_text(documents: Sequence[Document], normalize: bool) -> str:
    """The documents as the gateway renders them (canonical order when normalizing)."""
    return render_completion("", documents=documents, normalize=normalize).text.rstrip("\n")


def _clean_content(content: Any) -> Any:
    """Message content with its text cleaned; text-only part lists become one string (as the
    gateway renders them), other parts are kept as sent."""
    if isinstance(content, str):
        return clean_text(content)
    if isinstance(content, list):
        if all(isinstance(p, Mapping) and p.get("type") in TEXT_PARTS for p in content):
            return clean_text(content_text(content, "content"))
        return [
            {**p, "text": clean_text(p["text"])}
            if isinstance(p, Mapping) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
    return content


def engine_messages(
    messages: Sequence[Mapping[str, Any]], documents: Sequence[Document], *, normalize: bool
) -> list[dict[str, Any]]:
    """The chat as the engine gets it (see the module docstring)."""
    docs = _documents_text(documents, normalize) if documents else ""
    if not normalize:
        out = [dict(m) for m in messages]
        return [{"role": "system", "content": docs}, *out] if docs else out
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.get("role") in SYSTEM_ROLES:
            text = clean_text(content_text(m.get("content"), f"messages[{i}].content"))
            if text:
                system.append(text)
            continue
        msg = dict(m)
        if "content" in msg:
            msg["content"] = _clean_content(msg["content"])
        turns.append(msg)
    if docs:
        system.append(docs)
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + turns


def _canonical(value: Any) -> Any:
    """``value`` with every object's keys sorted (one byte form for the engine's template)."""
    return orjson.loads(canonical_json(value))


def engine_body(
    req: ParsedRequest,
    documents: Sequence[Document],
    *,
    normalize: bool,
    raw: Mapping[str, Any] | None = None,
    cache_salt: str = "",
) -> OpenAIBody:
    """The engine's request for ``req`` (``raw``: the client's JSON body, when there is one;
    without it, the parsed sampling fields are sent).

    ``req.sampling.max_tokens`` is the gateway's (a request without one gets the gateway's
    default, clamped to the context window).
    """
    if raw is not None:
        body: dict[str, Any] = {k: v for k, v in raw.items() if k not in GATEWAY_FIELDS}
    else:
        s = req.sampling
        body = {"temperature": s.temperature, "top_p": s.top_p}
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        if req.user:
            body["user"] = req.user
        if s.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
        if s.logprobs:
            if req.kind == "chat":
                body["logprobs"] = True
                body["top_logprobs"] = s.top_logprobs
            else:
                body["logprobs"] = s.top_logprobs
        if req.tools:
            body["tools"] = list(req.tools)
            if req.tool_choice is not None:
                body["tool_choice"] = req.tool_choice
        if req.response_format is not None:
            body["response_format"] = dict(req.response_format)
    if cache_salt:  # the tenant's namespace in the engine's prefix cache (``gateway.core.tenancy``)
        body["cache_salt"] = cache_salt
    body["model"] = req.model
    body["max_tokens"] = req.sampling.max_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if req.kind == "chat":
        body["messages"] = engine_messages(req.messages, documents, normalize=normalize)
        if normalize and isinstance(body.get("tools"), list):
            body["tools"] = _canonical(body["tools"])
    elif req.prompt_token_ids is not None:
        body["prompt"] = list(req.prompt_token_ids)
    else:
        body["prompt"] = render_completion(req.prompt or "", documents=documents, normalize=normalize).text
    return OpenAIBody(req.kind, body)


def for_choice(req: OpenAIBody, seed: int | None, choice: int) -> OpenAIBody:
    """The body of choice ``choice`` of a request: one generation (``n`` is the gateway's), its
    own seed when the request has one (``schema.choice_seed``; choice 0 keeps the client's).
    Without a seed an engine samples every request at random, so the choices differ."""
    if choice == 0 or seed is None:
        return req
    return OpenAIBody(req.kind, {**req.body, "seed": choice_seed(seed, choice) & MAX_ENGINE_SEED})


def with_priority(req: OpenAIBody, priority: int, mode: str) -> OpenAIBody:
    """The body with the request's ``priority`` as ``mode`` (``ENGINE_PRIORITY``) sends it.

    Only engines told to schedule by it are sent one, every request then (0 included): vLLM's
    OpenAI server took a non-zero ``priority`` only under ``--scheduling-policy priority``
    (others ignore it), an SGLang run with ``--abort-on-priority-when-disabled`` refuses any
    ``priority`` when it does not schedule by them, and one that does puts a request without a
    ``priority`` behind every request with one."""
    if mode == "off":
        return req
    value = -priority if mode == "inverted" else priority
    if req.body.get("priority") == value:
        return req
    return OpenAIBody(req.kind, {**req.body, "priority": value})
