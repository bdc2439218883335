"""The HTTP PD handoffs against a scripted prefill/decode pair on real uvicorn: what each leg is
sent (SGLang: the same body plus one bootstrap room; vLLM: the proxy's prefill request, then the
decode request with the prefill answer's ``kv_transfer_params``), where ``cached_tokens`` and usage
come from, and which node a failing leg blames.

Each server plays one role and answers per ``model``: ``ok``, or ``p503`` / ``d503`` (the prefill
/ decode server answers 503). It records every request body and its ``x-request-id``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, Prompt, TokenDelta, connect
from prefixgate.gateway.nodeclient.http_pd import HttpPDClient, HttpPDOptions
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.schema import Sampling
from tests.httpworkers.appserver import serving

PARAMS = {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [1]}
BOOTSTRAP = 18998


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(cached: int, prompt: int = 11, completion: int = 2) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Engine:
    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: list[tuple[str, dict[str, Any]]] = []  # x-request-id, body

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append((request.headers.get("x-request-id", ""), body))
        if body.get("model") == ("p503" if self.role == "prefill" else "d503"):
            return Response(orjson.dumps({"error": {"message": "not now"}}), status_code=503)
        if self.role == "prefill":
            answer: dict[str, Any] = {
                "choices": [{"index": 0, "message": {"content": "H"}, "finish_reason": "length"}],
                "usage": usage(7, completion=1),
            }
            if "kv_transfer_params" in body:
                answer["kv_transfer_params"] = PARAMS
            return Response(orjson.dumps(answer), media_type="application/json")
        events = [sse({"choices": [{"index": 0, "delta": {"content": t}}]}) for t in ("Hel", "lo")]
        events += [sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})]
        events += [sse({"choices": [], "usage": usage(0)}), b"data: [DONE]\n\n"]

        async def body_iter() -> AsyncIterator[bytes]:
            for e in events:
                yield e

        return StreamingResponse(body_iter(), media_type="text/event-stream")

    async def server_info(self, request: Request) -> Response:
        info = {"disaggregation_mode": self.role, "disaggregation_bootstrap_port": BOOTSTRAP}
        return Response(orjson.dumps(info), media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/server_info", self.server_info),
            ]
        )


Pair = tuple[Engine, Engine, HttpPDClient, HttpPDClient]


@contextlib.asynccontextmanager
async def pair(backend: str, bootstrap_port: int | None = None) -> AsyncIterator[Pair]:
    pe, de = Engine("prefill"), Engine("decode")
    async with serving(pe.app()) as purl, serving(de.app()) as durl:
        p = connect(purl, http_pd=HttpPDOptions(backend, bootstrap_port))
        d = connect(durl, http_pd=HttpPDOptions(backend))
        assert isinstance(p, HttpPDClient) and isinstance(d, HttpPDClient)
        try:
            yield pe, de, p, d
        finally:
            await p.close()
            await d.close()


def prompt(model: str = "ok") -> Prompt:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "min_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Prompt("r1", pack_ids([1, 2, 3]), [], Sampling(9), OpenAIBody("chat", body))


async def run(p: HttpPDClient, d: HttpPDClient, pr: Prompt) -> tuple[list[TokenDelta], int, int]:
    assert p.handoff is not None
    stream = p.handoff.start(pr, p, d, timeout=10)
    try:
        out = [x async for x in stream]
    finally:
        await stream.aclose()
    assert stream.prefill is not None
    return out, stream.cached_tokens, stream.prefill.cached_tokens


async def test_sglang_sends_one_body_and_one_room_to_both_legs() -> None:
    async with pair("sglang", BOOTSTRAP + 1) as (pe, de, p, d):
        assert p.capabilities.split and p.capabilities.openai_body
        out, cached, reported = await run(p, d, prompt())
    assert "".join(x.text for x in out) == "Hello" and out[-1].finish_reason == "stop"
    assert (cached, reported) == (7, 7)  # the prefill leg's count, not the decode leg's 0
    assert out[-1].prompt_tokens == 11 and out[-1].completion_tokens == 2  # usage: the decode leg's
    [(prid, pbody)], [(drid, dbody)] = pe.requests, de.requests
    assert prid == drid
    assert dbody["bootstrap_host"] == "127.0.0.1" and dbody["bootstrap_port"] == BOOTSTRAP + 1
    assert 0 <= dbody["bootstrap_room"] < 2**63
    assert dbody["stream"] is True and dbody["stream_options"] == {"include_usage": True}
    assert pbody == {k: v for k, v in dbody.items() if k != "stream_options"} | {"stream": False}


async def test_sglang_takes_the_bootstrap_port_from_server_info_and_a_fresh_room_each_time() -> None:
    async with pair("sglang") as (_pe, de, p, d):
        await run(p, d, prompt())
        await run(p, d, prompt())
    rooms = {body["bootstrap_room"] for _, body in de.requests}
    assert {body["bootstrap_port"] for _, body in de.requests} == {BOOTSTRAP}
    assert len(rooms) == 2


async def test_vllm_relays_the_prefill_answers_kv_transfer_params() -> None:
    async with pair("vllm") as (pe, de, p, d):
        out, cached, reported = await run(p, d, prompt())
    assert "".join(x.text for x in out) == "Hello" and (cached, reported) == (7, 7)
    [(prid, pbody)], [(drid, dbody)] = pe.requests, de.requests
    assert prid == drid and prid.startswith("r1-")  # one request id on both legs
    assert pbody["kv_transfer_params"]["do_remote_decode"] is True
    assert pbody["kv_transfer_params"]["do_remote_prefill"] is False
    assert pbody["max_tokens"] == 1 and pbody["stream"] is False
    assert "stream_options" not in pbody and "min_tokens" not in pbody
    assert dbody["kv_transfer_params"] == PARAMS
    assert dbody["max_tokens"] == 9 and dbody["stream"] is True and dbody["min_tokens"] == 2


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
async def test_a_failing_prefill_leg_is_the_prefill_nodes(backend: str) -> None:
    async with pair(backend, BOOTSTRAP) as (_pe, de, p, d):
        with pytest.raises(NodeFailure) as e:
            await run(p, d, prompt("p503"))
    assert (e.value.node_id, e.value.stage, e.value.kind) == (
        p.address,
        Stage.PREFILL,
        FailureKind.UNAVAILABLE,
    )
    if backend == "vllm":
        assert de.requests == []  # no decode leg without a prefill answer


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
async def test_a_failing_decode_leg_is_the_decode_nodes(backend: str) -> None:
    async with pair(backend, BOOTSTRAP) as (_pe, _de, p, d):
        with pytest.raises(NodeFailure) as e:
            await run(p, d, prompt("d503"))
    assert (e.value.node_id, e.value.stage, e.value.kind) == (
        d.address,
        Stage.DECODE,
        FailureKind.UNAVAILABLE,
    )


async def test_a_pair_across_backends_or_protocols_is_refused() -> None:
    async with pair("sglang", BOOTSTRAP) as (_pe, _de, p, _d):
        plain = connect(p.address)
        other = connect(p.address, http_pd=HttpPDOptions("vllm"))
        for decode in (plain, other):
            assert p.handoff is not None
            stream = p.handoff.start(prompt(), p, decode, timeout=5)
            with pytest.raises(NodeFailure) as e:
                await anext(stream)
            assert e.value.kind == FailureKind.FORMAT_REFUSED and e.value.stage == Stage.TRANSFER
            await decode.close()
    with pytest.raises(ValueError, match="--backend"):
        HttpPDOptions("")


class HeldDecode:
    """A decode worker whose first token waits for ``transferred`` (the KV still arriving), as
    an engine's does; it records the order in which it saw its first token out and the client
    gone."""

    def __init__(self) -> None:
        self.transferred = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.seen.append("request")
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = asyncio.ensure_future(receive())  # http.disconnect, once the client closes
        transferred = asyncio.ensure_future(self.transferred.wait())
        await asyncio.wait({gone, transferred}, return_when=asyncio.FIRST_COMPLETED)
        transferred.cancel()
        if gone.done():
            self.seen.append("closed mid-transfer")
            return
        first = sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        self.seen.append("first token")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone, 30)
        self.seen.append("closed")


async def _until(done: Callable[[], bool], seconds: float) -> None:
    for _ in range(int(seconds / 0.02)):
        if done():
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
async def test_a_decode_leg_closed_mid_transfer_is_aborted_after_its_first_token(backend: str) -> None:
    pe, de = Engine("prefill"), HeldDecode()
    async with serving(pe.app()) as purl, serving(de) as durl:
        p = connect(purl, http_pd=HttpPDOptions(backend, BOOTSTRAP))
        d = connect(durl, http_pd=HttpPDOptions(backend))
        assert isinstance(p, HttpPDClient) and p.handoff is not None
        stream = p.handoff.start(prompt(), p, d, timeout=30)
        first = asyncio.ensure_future(anext(stream))
        await _until(lambda: bool(de.seen), 10)
        assert de.seen == ["request"]
        first.cancel()  # the client went away before the decode leg's first token
        with pytest.raises(asyncio.CancelledError):
            await first
        await stream.aclose()
        # A leg closed now would be seen gone well within this (loopback, one event loop).
        await _until(lambda: len(de.seen) > 1, 2)
        de.transferred.set()
        await _until(lambda: de.seen[-1].startswith("closed"), 10)
        await p.close()
        await d.close()
    assert de.seen == ["request", "first token", "closed"]
