"""What an HTTP worker sends is bounded and checked at the adapter: an SSE line or a whole answer
over its bound fails the attempt as the worker's fault (its breaker charged, the client told in
an error event), usage counts that are not sane are dropped or clamped without cutting the
stream, and finish reasons reach the client as OpenAI's.

The worker is a scripted OpenAI-compatible server on real uvicorn (loopback); ``Worker.script``
maps a request's ``model`` to the raw body it streams back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, Prompt, TokenDelta, connect
from prefixgate.gateway.nodeclient.http_openai import MAX_JSON_BYTES, MAX_SSE_LINE_BYTES, HttpOpenAIClient
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.schema import Sampling
from tests.httpworkers.appserver import serving

PIECE = 1 << 20  # the worker writes big bodies a MiB at a time


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(content: str | None = None, finish: Any = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def answer(usage: Any = None, finish: Any = "stop") -> list[bytes]:
    """A short stream: two tokens, the finish, a usage chunk, [DONE]."""
    tail = [sse({"choices": [], "usage": usage})] if usage is not None else []
    return [sse(chunk("Hel")), sse(chunk("lo")), sse(chunk(None, finish)), *tail, b"data: [DONE]\n\n"]


def huge_line() -> list[bytes]:
    """One token, then one chunk whose line is a byte over the bound (sent a MiB at a time)."""
    head = b'data: {"choices":[{"index":0,"delta":{"content":"'
    filler = MAX_SSE_LINE_BYTES + 1 - len(head)
    parts = [sse(chunk("Hel")), head]
    parts += [b"x" * min(PIECE, filler - i) for i in range(0, filler, PIECE)]
    return [*parts, b'"}}]}\n\n', *answer()[2:]]


class Worker:
    def __init__(self) -> None:
        self.script: dict[str, Callable[[], list[bytes]]] = {}
        self.sent: dict[str, int] = {}  # model -> bytes the worker got to write

    async def completions(self, request: Request) -> Response:
        model = str(orjson.loads(await request.body()).get("model"))
        if model == "whole-too-big":  # a JSON answer to a streamed request, past MAX_JSON_BYTES
            whole = b'{"choices":[{"message":{"content":"' + b"x" * MAX_JSON_BYTES + b'"}}]}'
            return Response(whole, media_type="application/json")
        parts = self.script[model]()
        self.sent[model] = 0

        async def body() -> AsyncIterator[bytes]:
            for p in parts:
                self.sent[model] += len(p)
                yield p

        return StreamingResponse(body(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": m} for m in self.script]}))

    async def health(self, request: Request) -> Response:
        return Response(b"")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/health", self.health),
            ]
        )


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, str]]:
    w = Worker()
    async with serving(w.app()) as url:
        yield w, url


def prompt(model: str, tokens: int = 26) -> Prompt:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return Prompt("r1", pack_ids(list(range(tokens))), [], Sampling(4), OpenAIBody("chat", body))


async def run(url: str, model: str) -> tuple[list[TokenDelta], int]:
    client = connect(url)
    assert isinstance(client, HttpOpenAIClient)
    try:
        stream = client.generate(prompt(model), timeout=10)
        async with asyncio.timeout(8):
            out = [d async for d in stream]
        await stream.aclose()
        return out, stream.cached_tokens
    finally:
        await client.close()


async def test_an_sse_line_over_the_bound_fails_the_attempt_before_it_is_read_whole(
    worker: tuple[Worker, str],
) -> None:
    w, url = worker
    w.script["huge"] = huge_line
    with pytest.raises(NodeFailure) as info:
        await run(url, "huge")
    e = info.value
    assert (e.kind, e.stage) == (FailureKind.INTERNAL, Stage.GENERATE)
    assert f"a line over {MAX_SSE_LINE_BYTES} bytes" in e.detail
    assert e.node_id == url


async def test_a_whole_answer_over_its_bound_fails_the_attempt(worker: tuple[Worker, str]) -> None:
    w, url = worker
    w.script["whole-too-big"] = list
    with pytest.raises(NodeFailure) as info:
        await run(url, "whole-too-big")
    assert info.value.kind == FailureKind.INTERNAL and f"over {MAX_JSON_BYTES} bytes" in info.value.detail


async def test_a_huge_line_mid_stream_is_an_error_event_and_charges_the_workers_breaker(
    worker: tuple[Worker, str],
) -> None:
    w, url = worker
    w.script["m"] = huge_line
    svc = GatewayService(Settings(worker_urls=[url], model="m", stats_interval_s=0.2))
    await svc.start()
    try:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc)), base_url="http://gw")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with asyncio.timeout(8), http:
            r = await http.post("/v1/chat/completions", json=body)
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert orjson.loads(events[0][6:])["choices"][0]["delta"]["content"] == "Hel"
        error = orjson.loads(events[-1][6:])["error"]
        assert error["code"] == "stream_broken" and "failed mid-stream" in error["message"]
        assert "x" * 1000 not in r.text  # nothing of the huge line was relayed
        (node,) = svc.pool.nodes.values()
        assert node.breaker.failures == 1 and "a line over" in node.last_error
    finally:
        await svc.stop()


BAD_USAGE: dict[str, tuple[dict[str, Any], tuple[int, int, int]]] = {
    # usage -> (prompt_tokens, completion_tokens, cached_tokens) of the finish; 0: not reported
    "a list": ({"prompt_tokens": [1], "completion_tokens": 2}, (0, 2, 0)),
    "negative": ({"prompt_tokens": -5, "completion_tokens": -1}, (0, 2, 0)),
    "a bool": ({"prompt_tokens": True, "completion_tokens": 2}, (0, 2, 0)),
    "a string": ({"prompt_tokens": "26", "completion_tokens": 2.0}, (0, 2, 0)),
    "wrapped -1": ({"prompt_tokens": 26, "prompt_tokens_details": {"cached_tokens": 4294967295}}, (26, 2, 0)),
    "cached past the prompt": (
        {"prompt_tokens": 26, "prompt_tokens_details": {"cached_tokens": 30}},
        (26, 2, 26),
    ),
    "past the prompt sent": ({"prompt_tokens_details": {"cached_tokens": 99}}, (0, 2, 26)),
    "details not an object": ({"prompt_tokens": 26, "prompt_tokens_details": [7]}, (26, 2, 0)),
    "sane": (
        {"prompt_tokens": 26, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 16}},
        (26, 2, 16),
    ),
}


@pytest.mark.parametrize("case", list(BAD_USAGE))
async def test_usage_that_is_not_sane_is_dropped_or_clamped_and_never_cuts_the_stream(
    worker: tuple[Worker, str], case: str
) -> None:
    w, url = worker
    usage, (prompt_tokens, completion, cached) = BAD_USAGE[case]
    w.script["m"] = lambda: answer(usage)
    deltas, cached_tokens = await run(url, "m")
    last = deltas[-1]
    assert [d.text for d in deltas] == ["Hel", "lo", ""] and last.finish_reason == "stop"
    assert (last.prompt_tokens, last.completion_tokens, cached_tokens) == (prompt_tokens, completion, cached)


FINISHES = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
    "eos_token": "stop",  # TGI's word for it
    "max_tokens": "length",
    "something new": "stop",
    7: "stop",
    "LENGTH": "length",
}


@pytest.mark.parametrize("raw", list(FINISHES))
async def test_finish_reasons_reach_the_client_as_openais(worker: tuple[Worker, str], raw: Any) -> None:
    w, url = worker
    w.script["m"] = lambda: answer({"prompt_tokens": 26}, finish=raw)
    deltas, _ = await run(url, "m")
    assert deltas[-1].finish_reason == FINISHES[raw]


@pytest.mark.parametrize("raw", ["abort", "error"])
async def test_an_engine_that_gave_up_fails_the_attempt(worker: tuple[Worker, str], raw: str) -> None:
    w, url = worker
    w.script["m"] = lambda: answer({"prompt_tokens": 26}, finish=raw)
    with pytest.raises(NodeFailure) as info:
        await run(url, "m")
    assert info.value.kind == FailureKind.INTERNAL and raw in info.value.detail
