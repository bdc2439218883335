"""Whole answers over ``grpc://`` (docs/engines.md, Whole answers): the whole gateway in front of
our nodes. A request the client takes whole (no ``stream``) is asked of the engine with
``stream=false`` and answers exactly as the same request streamed (text, finish, usage with
cached tokens, log probabilities), on one node and split; streaming stays where the gateway needs
the increments (a stop string an SGLang engine does not apply); the first-token timeout does not
cut a whole answer; and a client gone before a split whole answer has its decode leg aborted as
soon as the prefill leg handed the KV over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import orjson
import pytest

from prefixgate.backends.smg_service import SglangSchedulerService
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import free_port
from tests.smgwire.conftest import HF, MODEL, StartNode
from tests.smgwire.test_gateway_over_grpc import body, gateway


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(node role, ``stream``) of every Generate our nodes get (started after this fixture)."""
    seen: list[tuple[str, bool]] = []
    original = SglangSchedulerService.Generate

    async def recording(self: SglangSchedulerService, request: Any, context: Any) -> AsyncIterator[Any]:
        seen.append((self.node.config.role, request.stream))
        async for msg in original(self, request, context):
            yield msg

    monkeypatch.setattr(SglangSchedulerService, "Generate", recording)
    return seen


@pytest.fixture
def aborted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, bool]]:
    """(node role, when, whether the node still ran the request) of every Abort our nodes get."""
    seen: list[tuple[str, float, bool]] = []
    original = SglangSchedulerService.Abort

    async def recording(self: SglangSchedulerService, request: Any, context: Any) -> Any:
        running = request.request_id in self._aborts
        seen.append((self.node.config.role, time.monotonic(), running))
        return await original(self, request, context)

    monkeypatch.setattr(SglangSchedulerService, "Abort", recording)
    return seen


async def streamed(http: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer put together as the whole one reads: text, finish, usage, log probabilities."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage = "", None, None
    logprobs: list[Any] = []
    async with http.stream("POST", path, json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or ():
                delta = c.get("delta") or {}
                text += delta.get("content") or c.get("text") or ""
                finish = c.get("finish_reason") or finish
                logprobs += ((c.get("logprobs") or {}).get("content")) or []
    return {"text": text, "finish": finish, "usage": usage, "logprobs": logprobs}


async def whole(http: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    r = await http.post(path, json=payload)
    assert r.status_code == 200, r.text
    data = r.json()
    c = data["choices"][0]
    text = c["message"]["content"] if "message" in c else c["text"]
    logprobs = (c.get("logprobs") or {}).get("content") or []
    return {"text": text, "finish": c["finish_reason"], "usage": data["usage"], "logprobs": logprobs}


def chat(**kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Tell me about prefix caches and KV pages. " * 6}]
    return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **kw}


async def test_a_request_taken_whole_is_asked_whole_and_answers_as_streamed(
    nodes: StartNode, asked: list[tuple[str, bool]]
) -> None:
    ns = await nodes("monolithic")
    async with gateway("--worker-urls", f"grpc://{ns.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for path, payload in (("/v1/completions", body(max_tokens=12)), ("/v1/chat/completions", chat())):
                cold = await whole(http, path, payload)
                warm = await streamed(http, path, payload)
                again = await whole(http, path, payload)
                assert cold["text"] and cold["finish"] == "length" == warm["finish"]
                assert cold["text"] == warm["text"] == again["text"]
                assert cold["usage"]["completion_tokens"] == warm["usage"]["completion_tokens"] == 12
                assert warm["usage"] == again["usage"]  # cached tokens included
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [s for _, s in asked] == [False, True, False] * 2


async def test_the_grpc_apis_generate_streams_and_complete_is_answered_whole(
    nodes: StartNode, asked: list[tuple[str, bool]]
) -> None:
    ns = await nodes("monolithic")
    port = free_port()
    async with gateway("--worker-urls", f"grpc://{ns.address}", "--grpc-port", str(port)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            req = gateway_pb2.CompletionRequest(model=MODEL, prompt=body()["prompt"], max_tokens=8)
            req.temperature = 0
            chunks = [c async for c in stub.Generate(req, timeout=30)]
            complete = await stub.Complete(req, timeout=30)
    assert "".join(c.text for c in chunks) == complete.text and complete.finish_reason == "length"
    assert [s for _, s in asked] == [True, False]


async def test_log_probabilities_of_a_whole_answer_are_the_streamed_ones(
    nodes: StartNode, asked: list[tuple[str, bool]]
) -> None:
    ns = await nodes("monolithic", engine="tiny")
    payload = chat(model="prefixgate-tiny", max_tokens=6, logprobs=True, top_logprobs=2)
    async with gateway("--worker-urls", f"grpc://{ns.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            one = await whole(http, "/v1/chat/completions", payload)
            other = await streamed(http, "/v1/chat/completions", payload)
    assert len(one["logprobs"]) == 6 and one["logprobs"] == other["logprobs"]
    assert one["text"] == other["text"]
    assert [s for _, s in asked] == [False, True]


async def test_a_stop_string_the_engine_does_not_apply_keeps_it_streaming(
    nodes: StartNode, asked: list[tuple[str, bool]]
) -> None:
    """SGLang is sent no stop strings: the gateway must see the output as it comes to end it at
    one, so the engine streams, and the text is cut where the streamed one is."""
    ns = await nodes("monolithic")
    async with gateway("--worker-urls", f"grpc://{ns.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            full = (await whole(http, "/v1/completions", body(max_tokens=16)))["text"]
            ids = HF.encode(full, add_special_tokens=False).ids
            stop = HF.decode(ids[4:6])  # two tokens into the answer
            assert len(stop) > 1 and stop in full
            payload = body(max_tokens=16, stop=[stop])
            one = await whole(http, "/v1/completions", payload)
            other = await streamed(http, "/v1/completions", payload)
    assert one["text"] == other["text"] == full[: full.index(stop)]
    assert one["finish"] == other["finish"] == "stop"
    assert [s for _, s in asked] == [False, True, True]


async def test_split_whole_answer_asks_both_legs_whole_and_answers_as_streamed(
    nodes: StartNode, asked: list[tuple[str, bool]]
) -> None:
    pre, dec = await nodes("prefill"), await nodes("decode")
    flags = ["--prefill", f"grpc://{pre.address}", "--decode", f"grpc://{dec.address}"]
    async with gateway(*flags) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            one = await whole(http, "/v1/completions", body(max_tokens=12))
            other = await streamed(http, "/v1/completions", body(max_tokens=12))
    assert one["text"] and one["text"] == other["text"] and one["finish"] == other["finish"] == "length"
    assert one["usage"]["completion_tokens"] == other["usage"]["completion_tokens"] == 12
    assert sorted(asked[:2]) == [("decode", False), ("prefill", False)]
    assert sorted(asked[2:]) == [("decode", True), ("prefill", True)]


async def test_the_first_token_timeout_does_not_cut_a_whole_answer(nodes: StartNode) -> None:
    """A whole answer comes when the generation is over: with a first-token timeout shorter than
    the generation, a streamed request is served in time and a whole one too, not retried."""
    ns = await nodes("monolithic", time_scale=1.0)  # ~10 ms a token
    env = {"PREFIXGATE_FIRST_TOKEN_TIMEOUT_S": "0.5"}
    async with gateway("--worker-urls", f"grpc://{ns.address}", env=env) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            began = time.monotonic()
            one = await whole(http, "/v1/completions", body(max_tokens=120))
            took = time.monotonic() - began
            other = await streamed(http, "/v1/completions", body(max_tokens=120))
            retries = (await http.get("/metrics")).text
    assert took > 0.5, took  # the generation outlasted the first-token timeout
    assert one["text"] == other["text"] and one["usage"]["completion_tokens"] == 120
    assert not any(
        line.startswith("prefixgate_retries_total{") and not line.endswith(" 0.0")
        for line in retries.splitlines()
    )


async def test_a_client_gone_before_a_split_whole_answer_aborts_the_decode_leg_at_once(
    nodes: StartNode, aborted: list[tuple[str, float, bool]]
) -> None:
    """The decode leg's first item is its whole answer: once the prefill leg has handed the KV
    over (it ends after the hand-off), nothing is in flight to the decode node and its leg is
    aborted when the client goes, while the engine still runs it, not once the answer is done."""
    pre, dec = await nodes("prefill"), await nodes("decode", time_scale=3.0)  # ~6 s of decoding
    flags = ["--prefill", f"grpc://{pre.address}", "--decode", f"grpc://{dec.address}"]
    async with gateway(*flags) as base:
        async with httpx.AsyncClient(base_url=base, timeout=1.0) as http:
            with pytest.raises(httpx.ReadTimeout):  # the client goes after 1 s
                await http.post("/v1/completions", json=body(max_tokens=500))
            gone = time.monotonic()
        deadline = gone + 8
        while not any(role == "decode" for role, *_ in aborted) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    when, running = next((t, r) for role, t, r in aborted if role == "decode")
    assert running and when - gone < 2.5, (when - gone, running)


async def test_a_client_gone_before_a_whole_answer_aborts_the_engines_work(
    nodes: StartNode, aborted: list[tuple[str, float, bool]]
) -> None:
    ns = await nodes("monolithic", time_scale=3.0)  # ~6 s of decoding
    async with gateway("--worker-urls", f"grpc://{ns.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=1.0) as http:
            with pytest.raises(httpx.ReadTimeout):  # the client goes after 1 s
                await http.post("/v1/completions", json=body(max_tokens=500))
            gone = time.monotonic()
        deadline = gone + 8
        while not aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert [(role, running) for role, _, running in aborted] == [("monolithic", True)]
    assert aborted[0][1] - gone < 2.5
