"""OpenAI response bodies for chat and text completions: whole, or as SSE chunks.

Every choice carries its ``index``; streamed chunks of different choices interleave as they are
produced, each choice ending with its own ``finish_reason``. ``usage`` counts the prompt once and
the completion tokens of every choice. Log probabilities, when asked, are the node's per token:
chat as ``logprobs.content`` entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``),
completions as ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``. Tool calls an
engine parsed itself (an HTTP worker) are relayed as it sent them: streamed, its
``delta.tool_calls`` entries; whole, the entries merged per call (``merge_tool_calls``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import orjson
from starlette.responses import Response

from prefixgate.gateway.core.choices import Choices
from prefixgate.gateway.core.errors import StreamBroken
from prefixgate.gateway.httpfront.common import SSE_DONE, ORJSONResponse
from prefixgate.gateway.nodeclient.base import TokenLogprob
from prefixgate.gateway.toolcalls import shapes as toolcalls
from prefixgate.openai.errors import from_domain
from prefixgate.openai.schema import ParsedRequest

FINGERPRINT = "prefixgate"


def usage(ch: Choices) -> dict[str, Any]:
    return {
        "prompt_tokens": ch.prompt_tokens,
        "completion_tokens": ch.completion_tokens,
        "total_tokens": ch.prompt_tokens + ch.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ch.cached_tokens},
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _entry(text: str, logprob: float, raw: bytes | None = None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8") if raw is None else raw)}


def _top(lp: TokenLogprob) -> list[dict[str, Any]]:
    raws = lp.top_raw or (None,) * len(lp.top)
    return [_entry(t, v, raw) for (t, v), raw in zip(lp.top, raws, strict=False)]


def chat_logprobs(lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = [{**_entry(lp.text, lp.logprob, lp.raw), "top_logprobs": _top(lp)} for lp in lps]
    return {"content": content, "refusal": None}


class TextLogprobs:
    """Completions-style log probabilities, with the running text offset of one choice."""

    def __init__(self) -> None:
        self.offset = 0

    def render(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for lp in lps:
            offsets.append(self.offset)
            self.offset += len(lp.text)
        return {
            "tokens": [lp.text for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(lp.top) for lp in lps],
            "text_offset": offsets,
        }


def merge_tool_calls(deltas: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas as whole calls: per ``index``, the first id, type and name, the
    argument pieces joined."""
    calls: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[str]] = {}  # argument pieces, joined once (linear in the answer)
    for d in deltas:
        i = d.get("index")
        at = i if isinstance(i, int) else len(calls)
        call = calls.setdefault(at, {})
        for key in ("id", "type"):
            if d.get(key) and key not in call:
                call[key] = d[key]
        fn = d.get("function")
        if isinstance(fn, Mapping):
            f = call.setdefault("function", {"name": "", "arguments": ""})
            if fn.get("name") and not f["name"]:
                f["name"] = fn["name"]
            pieces.setdefault(at, []).append(str(fn.get("arguments") or ""))
    for at, parts in pieces.items():
        calls[at]["function"]["arguments"] = "".join(parts)
    return [{"type": "function", **c} for _, c in sorted(calls.items())]


def _ids(ch: Choices, kind: str) -> tuple[str, str]:
    if kind == "chat":
        return f"chatcmpl-{ch.request_id}", "chat.completion"
    return f"cmpl-{ch.request_id}", "text_completion"


async def complete(ch: Choices, parsed: ParsedRequest, kind: str, headers: dict[str, str]) -> Response:
    """The whole answer, once every choice has finished."""
    n = len(ch.executions)
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    calls: list[list[Mapping[str, Any]]] = [[] for _ in range(n)]
    async for i, d in ch.stream():
        texts[i].append(d.text)
        lps[i].extend(d.logprobs)
        calls[i].extend(d.tool_calls)
    want = parsed.sampling.logprobs
    choices: list[dict[str, Any]] = []
    for i, ex in enumerate(ch.executions):
        text = "".join(texts[i])
        if kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            called = False
            if parser := toolcalls.parser_of(ex):  # the gateway parses the model's tool calls
                msg, called = toolcalls.message(parser, text)
            elif calls[i]:  # the engine parsed them
                msg = {"role": "assistant", "content": text or None, "tool_calls": merge_tool_calls(calls[i])}
            choices.append(
                {
                    "index": i,
                    "message": msg,
                    "finish_reason": toolcalls.finish_reason(called, ex.finish_reason),
                    "logprobs": chat_logprobs(lps[i]) if want else None,
                }
            )
        else:
            lp = TextLogprobs().render(lps[i]) if want else None
            choices.append({"index": i, "text": text, "finish_reason": ex.finish_reason, "logprobs": lp})
    rid, obj = _ids(ch, kind)
    payload = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": parsed.model,
        "choices": choices,
        "usage": usage(ch),
        "system_fingerprint": FINGERPRINT,
    }
    if headers:  # an HTTP worker reports its cached tokens at the end: the final count
        headers = {**headers, "x-prefixgate-cached-tokens": str(ch.cached_tokens)}
        headers["x-prefixgate-migrations"] = str(ch.migrations)  # known once the answer is whole
    return ORJSONResponse(payload, headers=headers)


async def stream(ch: Choices, parsed: ParsedRequest, kind: str) -> AsyncGenerator[bytes, None]:
    """The SSE body; a failure after the first token ends it with an error event (no [DONE])."""
    chat = kind == "chat"
    rid, obj = _ids(ch, kind)
    obj = "chat.completion.chunk" if chat else obj
    base = {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model}
    base["system_fingerprint"] = FINGERPRINT
    want = parsed.sampling.logprobs
    offsets = [TextLogprobs() for _ in ch.executions] if want and not chat else []

    def chunk(
        i: int,
        text: str,
        finish: str | None,
        first: bool,
        lps: Sequence[TokenLogprob],
        calls: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            )
            if calls:
                delta["tool_calls"] = list(calls)
            lp = chat_logprobs(lps) if want and lps else None
            choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            lp = offsets[i].render(lps) if want and lps else None
            choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": lp}
        out = {**base, "choices": [choice]}
        if parsed.include_usage:
            out["usage"] = None
        return out

    def tool_chunk(
        i: int, part: dict[str, Any], finish: str | None, first: bool, lps: Sequence[TokenLogprob]
    ) -> bytes:
        delta = {"role": "assistant", **part} if first else part
        if first and not part:
            delta["content"] = ""
        lp = chat_logprobs(lps) if want and lps else None
        out = {**base, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}]}
        if parsed.include_usage:
            out["usage"] = None
        return sse(out)

    tools = [
        toolcalls.ToolDeltas(parser) if chat and (parser := toolcalls.parser_of(ex)) else None
        for ex in ch.executions
    ]
    started = [False] * len(ch.executions)
    try:
        async for i, d in ch.stream():
            if (td := tools[i]) is not None:  # tool calls parsed from the text (gateway.toolcalls)
                parts = td.step(d.text, bool(d.finish_reason))
                finish = td.finish_reason(d.finish_reason) if d.finish_reason else None
                if not parts and (not started[i] or finish or d.logprobs):
                    parts = [{}]
                for k, part in enumerate(parts):
                    closing = finish if k == len(parts) - 1 else None
                    yield tool_chunk(i, part, closing, not started[i], d.logprobs if k == 0 else ())
                    started[i] = True
                continue
            if d.text or not started[i] or d.finish_reason or d.logprobs or d.tool_calls:
                yield sse(chunk(i, d.text, d.finish_reason or None, not started[i], d.logprobs, d.tool_calls))
                started[i] = True
        last = sse({**base, "choices": [], "usage": usage(ch)}) if parsed.include_usage else b""
        yield last + SSE_DONE  # one write for the two last events
    except StreamBroken as e:
        yield sse(from_domain(e).body())
