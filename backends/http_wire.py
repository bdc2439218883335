"""The HTTP face's answers: OpenAI's chat and text completion objects (whole or as SSE chunks),
and a node error as an OpenAI-style error. Pure."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response

from prefixgate.backends.engine import TokenLogprob
from prefixgate.backends.errors import NodeError, http_status
from prefixgate.backends.generation import Chunk
from prefixgate.openai.errors import APIError


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def api_error(e: NodeError) -> APIError:
    """``e`` as the HTTP face answers it; its stage is the error's ``code``."""
    status = http_status(e)
    return APIError(status, e.message, code=e.stage, retry_after=1 if status in (429, 503) else None)


def wire_logprobs(
    lps: Sequence[TokenLogprob], chat: bool, text_of: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of one chunk: chat ``content`` entries, or the completions arrays."""

    def entry(t: int, v: float) -> dict[str, Any]:
        s = text_of(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    if chat:
        content = [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(text_of(lp.token))
    return {
        "tokens": [text_of(lp.token) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text_of(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def usage(lasts: Sequence[Chunk]) -> dict[str, Any]:
    """The usage of a request whose choices ended with ``lasts`` (choice order): the prompt once
    (and what of it choice 0 found cached), the completion tokens of every choice."""
    head = lasts[0]
    completion = sum(c.completion_tokens for c in lasts)
    return {
        "prompt_tokens": head.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": head.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": head.cached_tokens},
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Answer:
    """One choice's whole answer: its text, its last chunk (finish and usage), its log probabilities."""

    text: str
    last: Chunk
    logprobs: list[TokenLogprob]


class Wire:
    """OpenAI response objects for one request (chat or text completion), each choice by its index."""

    def __init__(
        self,
        kind: str,
        model: str,
        include_usage: bool,
        text_of: Callable[[int], str] | None = None,
    ) -> None:
        self.chat = kind == "chat"
        self.text_of = text_of  # set: log probabilities are asked for
        self.offsets: dict[int, int] = {}  # text completions: each choice's text offset so far
        rid = uuid.uuid4().hex
        self.base = {
            "id": f"chatcmpl-{rid}" if self.chat else f"cmpl-{rid}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "prefixgate-node",
        }
        self.include_usage = include_usage

    def logprobs(self, lps: Sequence[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        if self.text_of is None:
            return None
        offset = self.offsets.get(index, 0)
        out = wire_logprobs(lps, self.chat, self.text_of, offset)
        self.offsets[index] = offset + sum(len(self.text_of(lp.token)) for lp in lps)
        return out

    def chunk(
        self, text: str, finish: str, first: bool, lps: Sequence[TokenLogprob] = (), index: int = 0
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if not first and not text:
                delta = {}
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish or None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish or None}
        choice["logprobs"] = self.logprobs(lps, index)
        out: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, lasts: Sequence[Chunk]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage(lasts)}

    def whole(self, answers: Sequence[Answer]) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, a in enumerate(answers):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": a.text}
            else:
                choice["text"] = a.text
            choice["finish_reason"] = a.last.finish_reason or "length"
            choice["logprobs"] = self.logprobs(a.logprobs, index)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.base, "object": obj, "choices": choices, "usage": usage([a.last for a in answers])}
