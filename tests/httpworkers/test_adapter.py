"""The HTTP worker adapter against a scripted OpenAI-compatible server on real uvicorn.

The server answers per ``model``: a normal stream with usage, a stream ending in ``[DONE]``
without a finish reason, a whole JSON answer to a streamed request, an error event mid-stream,
a stream cut without ``[DONE]``, 429 and 400. It records every request and the client port it
came from (to see keep-alive connections reused).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, Prompt, TokenDelta, connect
from prefixgate.gateway.nodeclient.http_openai import HttpOpenAIClient
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.schema import Sampling
from tests.httpworkers.appserver import serving


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


USAGE = {
    "prompt_tokens": 11,
    "completion_tokens": 2,
    "total_tokens": 13,
    "prompt_tokens_details": {"cached_tokens": 7},
}


class Engine:
    def __init__(self) -> None:
        self.requests: list[tuple[str, int, dict[str, Any]]] = []  # path, client port, body
        self.accepts: list[str] = []

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        assert request.client is not None
        self.requests.append((request.url.path, request.client.port, body))
        self.accepts.append(request.headers.get("accept", ""))
        mode = body.get("model")
        if mode == "busy":
            return Response(orjson.dumps({"error": {"message": "slow down"}}), status_code=429)
        if mode == "bad":
            return Response(orjson.dumps({"error": {"message": "prompt too long"}}), status_code=400)
        if mode == "json":
            whole = {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "length"}]}
            return Response(orjson.dumps({**whole, "usage": USAGE}), media_type="application/json")
        events = [
            sse(
                {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            )
        ]
        events += [sse(chunk("Hel")), sse(chunk("lo"))]
        if mode == "error":
            events = [*events[:2], sse({"error": {"message": "engine died", "code": 500}})]
        elif mode == "cut":
            pass
        elif mode == "nofinish":
            events += [b"data: [DONE]\n\n"]
        elif mode == "completion":
            events = [sse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})]
            events += [sse({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]
        else:
            events += [sse(chunk(None, "stop")), sse({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]

        async def body_iter() -> AsyncIterator[bytes]:
            for e in events:
                yield e

        return StreamingResponse(body_iter(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}))

    async def health(self, request: Request) -> Response:
        return Response(b"")

    async def metrics(self, request: Request) -> Response:
        text = 'vllm:num_requests_running{model_name="m1"} 3\nvllm:num_requests_waiting{model_name="m1"} 1\n'
        return Response(text, media_type="text/plain")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/health", self.health),
                Route("/metrics", self.metrics),
            ]
        )


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, HttpOpenAIClient]]:
    eng = Engine()
    async with serving(eng.app()) as url:
        client = connect(url)
        assert isinstance(client, HttpOpenAIClient)
        try:
            yield eng, client
        finally:
            await client.close()


def prompt(model: str, kind: str = "chat") -> Prompt:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return Prompt("r1", pack_ids([1, 2, 3]), [], Sampling(4), OpenAIBody(kind, body))


async def collect(client: HttpOpenAIClient, p: Prompt) -> tuple[list[TokenDelta], int]:
    stream = client.generate(p, timeout=10)
    out = [d async for d in stream]
    await stream.aclose()
    return out, stream.cached_tokens


async def test_a_stream_is_relayed_with_the_engines_usage_over_one_kept_alive_connection(
    engine: tuple[Engine, HttpOpenAIClient],
) -> None:
    eng, client = engine
    for _ in range(5):
        deltas, cached = await collect(client, prompt("ok"))
        assert [d.text for d in deltas] == ["Hel", "lo", ""]
        assert (deltas[-1].finish_reason, deltas[-1].completion_tokens, deltas[-1].prompt_tokens) == (
            "stop",
            2,
            11,
        )
        assert cached == 7
    assert client.inflight == 0
    assert len({port for _, port, _ in eng.requests}) == 1  # every request on the same connection
    assert eng.requests[0][2]["messages"] == [{"role": "user", "content": "hi"}]


async def test_odd_but_complete_answers(engine: tuple[Engine, HttpOpenAIClient]) -> None:
    _, client = engine
    deltas, _ = await collect(client, prompt("nofinish"))
    assert [d.text for d in deltas] == ["Hel", "lo", ""] and deltas[-1].finish_reason == "stop"
    deltas, cached = await collect(client, prompt("json"))
    assert [(d.text, d.finish_reason, d.prompt_tokens) for d in deltas] == [("whole", "length", 11)]
    assert cached == 7
    deltas, _ = await collect(client, prompt("completion", kind="completion"))
    assert [(d.text, d.finish_reason) for d in deltas] == [("ok", "stop")]


async def test_an_answer_the_client_takes_whole_is_asked_whole(
    engine: tuple[Engine, HttpOpenAIClient],
) -> None:
    eng, client = engine
    body = {"model": "json", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"stream_options": {"include_usage": True}, "stop": ["x"], "logprobs": True}
    p = Prompt("r1", pack_ids([1, 2, 3]), [], Sampling(4, stop=["x"], stream=False), OpenAIBody("chat", body))
    stream = client.generate(p, timeout=10)
    assert stream.whole_answer
    deltas = [d async for d in stream]
    assert [(d.text, d.finish_reason, d.completion_tokens, d.prompt_tokens) for d in deltas] == [
        ("whole", "length", 2, 11)
    ]
    assert stream.cached_tokens == 7 and client.inflight == 0
    sent = eng.requests[-1][2]
    # not streamed, and nothing else changed: the stop strings are the engine's to apply
    assert sent == {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    assert eng.accepts[-1] == "application/json"
    assert not client.generate(prompt("json"), timeout=10).whole_answer  # a streamed client's


async def test_failures_say_whether_another_worker_may_help(engine: tuple[Engine, HttpOpenAIClient]) -> None:
    _, client = engine
    for model, kind in (("busy", FailureKind.OVERLOADED), ("bad", FailureKind.INVALID)):
        with pytest.raises(NodeFailure) as info:
            await collect(client, prompt(model))
        assert (info.value.kind, info.value.stage) == (kind, Stage.GENERATE)
        assert info.value.node_id == client.address
    assert "slow down" in str(await _failure(client, "busy"))
    stream = client.generate(prompt("error"), timeout=10)
    assert (await anext(stream)).text == "Hel"
    with pytest.raises(NodeFailure, match="engine died"):
        await anext(stream)
    stream = client.generate(prompt("cut"), timeout=10)
    assert [d.text async for d in stream] == ["Hel", "lo"]  # cut off: no finish, the caller decides
    assert client.inflight == 0


async def _failure(client: HttpOpenAIClient, model: str) -> NodeFailure:
    try:
        await collect(client, prompt(model))
    except NodeFailure as e:
        return e
    raise AssertionError("no failure")


async def test_a_prompt_without_a_request_goes_as_token_ids(engine: tuple[Engine, HttpOpenAIClient]) -> None:
    eng, client = engine
    await client.status(timeout=5)
    p = Prompt("r2", pack_ids([5, 6, 7]), [], Sampling(3, temperature=0.0, seed=9))
    stream = client.generate(p, timeout=10)
    await anext(stream)
    await stream.aclose()
    path, _, body = eng.requests[-1]
    assert path == "/v1/completions"
    assert (
        body["prompt"] == [5, 6, 7]
        and body["model"] == "m1"
        and body["max_tokens"] == 3
        and body["seed"] == 9
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_status_reads_models_and_load_from_the_engine(engine: tuple[Engine, HttpOpenAIClient]) -> None:
    _, client = engine
    st = await client.status(timeout=5)
    assert st.models == ("m1", "m2") and (st.running_requests, st.queued_requests) == (3, 1)
    assert client.load_source == "/metrics" and st.engine == "openai-http"
    assert not client.capabilities.kv_events and client.capabilities.openai_body and client.handoff is None


async def test_a_worker_that_is_gone_fails_its_probe() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HttpOpenAIClient(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(NodeFailure) as info:
            await client.status(timeout=2)
        assert (info.value.kind, info.value.stage) == (FailureKind.UNAVAILABLE, Stage.PROBE)
        stream = client.generate(prompt("ok"), timeout=2)
        with pytest.raises(NodeFailure) as info:
            await anext(stream)
        assert info.value.kind == FailureKind.UNAVAILABLE and client.inflight == 0
    finally:
        await client.close()
