"""The request runner on real gateways: one whose nodes are down, and ``prefixgate up``.

On the first, every request is admitted and then fails in execute, which is exactly where an
in-flight slot can leak; the same gateway checks the limits and auth both front ends share.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from gateway.config import Settings
from gateway.server import make_server
from gateway.service import GatewayService
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import Stack
from tests.helpers import free_port

MODEL = "prefixgate-sim"
KEY = "sk-runner-test"
MAX_INFLIGHT = 3
BODY_LIMIT = 256 * 1024
MAX_MESSAGES = 100


@dataclass
class Gateway:
    url: str
    grpc_address: str
    service: GatewayService

    def client(self, key: str = KEY) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def stub(self, channel: grpc.Channel) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def down() -> Iterator[Gateway]:
    """A gateway with one prefill and one decode node that never answer."""
    settings = Settings(
        port=free_port(),
        grpc_port=free_port(),
        prefill=[f"127.0.0.1:{free_port()}"],
        decode=[f"127.0.0.1:{free_port()}"],
        max_inflight=MAX_INFLIGHT,
        max_body_bytes=BODY_LIMIT,
        max_messages=MAX_MESSAGES,
        api_keys=[f"{KEY}=alice"],
        stats_interval_s=5.0,
    )
    server, svc = make_server(settings)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the gateway did not start"
    try:
        yield Gateway(f"http://127.0.0.1:{settings.port}", f"127.0.0.1:{settings.grpc_port}", svc)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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
        r = http.post("/v1/completions", content=orjson.dumps({"model": MODEL, "prompt": prompt}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    md = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(down.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            down.stub(channel).Complete(
                gateway_pb2.CompletionRequest(model=MODEL, prompt=prompt), metadata=md
            )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert down.service.pipeline.inflight == 0


def _inflight(stack: Stack) -> float:
    with stack.admin() as admin:
        for line in admin.get("/metrics").text.splitlines():
            if line.startswith("prefixgate_inflight_requests "):
                return float(line.split()[1])
    raise AssertionError("no prefixgate_inflight_requests in /metrics")


def _settles_at_zero(stack: Stack, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _inflight(stack) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _inflight(stack) == 0


def test_a_stream_holds_its_slot_until_the_client_leaves(stack: Stack) -> None:
    body = {"model": MODEL, "messages": _messages(), "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=stack.root, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")
            assert _inflight(stack) == 1  # held while the stream runs
        # the client closed the connection mid-stream
        assert _settles_at_zero(stack)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200  # and leaves before reading any of the body
        assert _settles_at_zero(stack)
