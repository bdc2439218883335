"""The request runner on real gateways: one whose nodes are down, and ``prefixgate up``.

On the first, every request is admitted and then fails in execute, which is exactly where an
in-flight slot can leak; the same gateway checks the limits and auth both front ends share.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.pipeline import Delta, Prepared
from prefixgate.gateway.core.pipeline import StreamBroken as PipelineStreamBroken
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.ops.server import make_server
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import free_port

MODEL = "prefixgate-sim"
KEY = "sk-runner-test"
MAX_INFLIGHT = 3
BODY_LIMIT = 256 * 1024
MAX_MESSAGES = 100
MAX_VALUES = 10_000


@dataclass
class Gateway:
    url: str
    grpc_address: str
    service: GatewayService

    def client(self, key: str = KEY) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def stub(self, channel: grpc.Channel) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(channel)


@contextmanager
def serve(settings: Settings) -> Iterator[GatewayService]:
    """The gateway (HTTP and, when ``grpc_port`` is set, gRPC) on a thread of its own."""
    server, svc = make_server(settings)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the gateway did not start"
    try:
        yield svc
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _dead_nodes() -> dict[str, list[str]]:
    return {"prefill": [f"127.0.0.1:{free_port()}"], "decode": [f"127.0.0.1:{free_port()}"]}


@pytest.fixture(scope="module")
def down() -> Iterator[Gateway]:
    """A gateway with one prefill and one decode node that never answer."""
    settings = Settings(
        port=free_port(),
        grpc_port=free_port(),
        max_inflight=MAX_INFLIGHT,
        max_body_bytes=BODY_LIMIT,
        max_messages=MAX_MESSAGES,
        max_json_values=MAX_VALUES,
        api_keys=[f"{KEY}=alice"],
        stats_interval_s=5.0,
        **_dead_nodes(),  # type: ignore[arg-type]
    )
    with serve(settings) as svc:
        yield Gateway(f"http://127.0.0.1:{settings.port}", f"127.0.0.1:{settings.grpc_port}", svc)


def _messages(n: int = 1) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {i}"} for i in range(n)]


def test_failed_streams_release_their_slots(down: Gateway) -> None:
    client = down.client()
    for _ in range(MAX_INFLIGHT + 2):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=_messages(), stream=True)  # type: ignore[arg-type]
        assert info.value.status_code == 503, info.value.response.text
    assert down.service.pipeline.inflight == 0
    # Not 429: the failed streams left no slot behind.
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="hello", stream=True)
    assert info.value.status_code == 503
    assert down.service.pipeline.inflight == 0


def test_failed_grpc_calls_release_their_slots(down: Gateway) -> None:
    md = (("authorization", f"Bearer {KEY}"),)
    req = gateway_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=4)
    with grpc.insecure_channel(down.grpc_address) as channel:
        stub = down.stub(channel)
        for _ in range(MAX_INFLIGHT + 1):
            for rpc in (stub.Complete, stub.Generate):
                with pytest.raises(grpc.RpcError) as info:
                    call = rpc(req, metadata=md, timeout=30)
                    if rpc is stub.Generate:
                        list(call)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert down.service.pipeline.inflight == 0


def test_both_front_ends_refuse_a_missing_key_alike(down: Gateway) -> None:
    with httpx.Client(base_url=down.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": _messages()})
    assert r.status_code == 401
    http_error = r.json()["error"]
    assert http_error["code"] == "invalid_api_key"
    req = gateway_pb2.CompletionRequest(model=MODEL, prompt="hello")
    with grpc.insecure_channel(down.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            down.stub(channel).Complete(req, timeout=30)
    err = info.value
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert err.details() == http_error["message"]  # type: ignore[attr-defined]
    assert dict(err.trailing_metadata())["x-prefixgate-error-code"] == "invalid_api_key"  # type: ignore[attr-defined]
    with pytest.raises(openai.AuthenticationError) as wrong:
        down.client(key="sk-nope").chat.completions.create(model=MODEL, messages=_messages())  # type: ignore[arg-type]
    assert wrong.value.code == "invalid_api_key"


def test_too_many_messages_is_a_413_naming_the_field(down: Gateway) -> None:
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            down.client().chat.completions.create(
                model=MODEL,
                messages=_messages(MAX_MESSAGES + 1),  # type: ignore[arg-type]
                stream=stream,
            )
        assert info.value.status_code == 413
        body = info.value.response.json()["error"]
        assert body["param"] == "messages" and body["code"] == "too_many_messages"
        assert f"at most {MAX_MESSAGES}" in body["message"]
    md = (("authorization", f"Bearer {KEY}"),)
    req = gateway_pb2.CompletionRequest(
        model=MODEL, messages=[gateway_pb2.ChatMessage(role="user", content="x")] * (MAX_MESSAGES + 1)
    )
    with grpc.insecure_channel(down.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as grpc_info:
            down.stub(channel).Complete(req, metadata=md, timeout=30)
    assert grpc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "at most 100" in grpc_info.value.details()  # type: ignore[attr-defined]


def test_grpc_takes_no_larger_message_than_http(down: Gateway) -> None:
    prompt = "x" * (BODY_LIMIT + 1024)
    with httpx.Client(base_url=down.url, timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
        r = http.post(
            "/v1/completions",
            content=orjson.dumps({"model": MODEL, "prompt": prompt}),
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    md = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(down.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            down.stub(channel).Complete(
                gateway_pb2.CompletionRequest(model=MODEL, prompt=prompt), metadata=md
            )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert down.service.pipeline.inflight == 0


@dataclass(frozen=True)
class NodeName:
    """What the response headers read of a node."""

    id: str


class ScriptedExecution:
    """An execution that streams one token every 10 ms for up to 30 s, or breaks after ``break_after``."""

    def __init__(self, request_id: str, break_after: int | None = None) -> None:
        self.request_id = request_id
        self.break_after = break_after
        self.route, self.prefill_node, self.decode_node = "disaggregated", None, NodeName("decode-1")
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = 3, 0, 0
        self.finish_reason = ""
        self.closed = threading.Event()

    async def stream(self) -> AsyncIterator[Delta]:
        for i in range(3000):
            if i == self.break_after:
                raise PipelineStreamBroken("decode node decode-1 failed mid-stream: UNAVAILABLE")
            self.completion_tokens = i + 1
            yield Delta("tok ", "", i + 1)
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.closed.set()


@pytest.fixture
def scripted(down: Gateway) -> Iterator[list[ScriptedExecution]]:
    """Executions the pipeline hands out instead of calling (down) nodes."""
    started: list[ScriptedExecution] = []
    pipeline = down.service.pipeline

    async def execute(prep: Prepared) -> ScriptedExecution:
        ex = ScriptedExecution(prep.request_id, break_after=3 if "break" in prep.request_id else None)
        started.append(ex)
        return ex

    pipeline.execute = execute  # type: ignore[assignment,method-assign]
    try:
        yield started
    finally:
        del pipeline.execute  # type: ignore[attr-defined]


def _settles_at_zero(down: Gateway, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while down.service.pipeline.inflight and time.monotonic() < deadline:
        time.sleep(0.02)
    return down.service.pipeline.inflight == 0


def _stream_body() -> dict[str, object]:
    return {"model": MODEL, "messages": _messages(), "stream": True}


def test_a_stream_holds_its_slot_until_the_client_leaves(
    down: Gateway, scripted: list[ScriptedExecution]
) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=down.url, timeout=30, headers=headers) as http:
        with http.stream("POST", "/v1/chat/completions", json=_stream_body()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            time.sleep(0.2)
            assert down.service.pipeline.inflight == 1  # held while the stream runs
        # the client left mid-stream (30 s of tokens were still to come)
        assert _settles_at_zero(down)
        assert scripted[-1].closed.wait(5) and scripted[-1].completion_tokens < 1000

        with http.stream("POST", "/v1/chat/completions", json=_stream_body()) as r:
            assert r.status_code == 200  # and leaves without reading any of the body
        assert _settles_at_zero(down)
        assert scripted[-1].closed.wait(5)


def test_a_stream_broken_mid_way_ends_with_an_error_event_and_releases(
    down: Gateway, scripted: list[ScriptedExecution]
) -> None:
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": "break-1"}
    with httpx.Client(base_url=down.url, timeout=30, headers=headers) as http:
        r = http.post("/v1/chat/completions", json=_stream_body())
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert r.status_code == 200 and len(events) == 4 and "[DONE]" not in events
        error = orjson.loads(events[-1])["error"]
        assert error["code"] == "stream_broken" and error["type"] == "server_error"
        assert error["message"].startswith("generation failed after it started: decode node decode-1")
        assert _settles_at_zero(down)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": _messages()})
        assert r.status_code == 502 and r.json()["error"]["code"] == "stream_broken"
    assert _settles_at_zero(down)
    assert all(ex.closed.is_set() for ex in scripted)


def test_a_body_of_too_many_values_is_refused_whatever_the_field(down: Gateway) -> None:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=down.url, timeout=30, headers=headers) as http:
        for extra in (10, MAX_VALUES * 2):  # parsed in this process, then in a worker process
            junk = orjson.dumps(
                {"model": MODEL, "messages": _messages(), "metadata": [0] * (MAX_VALUES + extra)}
            )
            assert down.service.runner.bodies.inline(junk) == (extra == 10)
            r = http.post("/v1/chat/completions", content=junk)
            assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_values", r.text
        r = http.post("/v1/chat/completions", content=b'{"model": ' + b"[" * 70_000 + b"]" * 70_000 + b"}")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"  # too deep for orjson
    assert down.service.pipeline.inflight == 0


def test_huge_bodies_do_not_stall_the_event_loop() -> None:
    """Two clients sending 450k-message bodies (7.2 MB, under the 8 MB limit) while /healthz is
    polled: each body takes about a second of parsing, none of it on the event loop."""
    settings = Settings(port=free_port(), stats_interval_s=5.0, **_dead_nodes())  # type: ignore[arg-type]
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user"}] * 450_000})
    assert len(body) < settings.max_body_bytes
    with serve(settings):
        url = f"http://127.0.0.1:{settings.port}"
        # 4 s: each attacker keeps a body (about a second of parsing) in flight throughout, and
        # /healthz is asked some 100 times meanwhile
        stop = time.monotonic() + 4
        statuses: list[int] = []

        def attack() -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                while time.monotonic() < stop:
                    r = c.post(
                        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                    )
                    statuses.append(r.status_code)

        attackers = [threading.Thread(target=attack) for _ in range(2)]
        for a in attackers:
            a.start()
        latencies: list[float] = []
        with httpx.Client(base_url=url, timeout=60) as c:
            time.sleep(0.5)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
        for a in attackers:
            a.join(timeout=60)
    assert statuses and set(statuses) == {413}
    latencies.sort()
    assert len(latencies) > 20 and latencies[len(latencies) // 2] < 0.25, latencies
