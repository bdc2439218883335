"""The connection to an HTTP worker: what a request carries, how its connection is reused or
closed, and what the transport's failures become.

The worker is a scripted HTTP/1.1 server on a loopback port (``tests.helpers.serve_http``, a
thread per connection) that writes its answers by hand (chunked), so a test can cut, reset or
stall a stream where it likes, and sees each connection its requests came on and when the client
closed it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway import tracing
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, Prompt, TokenDelta, connect
from prefixgate.gateway.nodeclient.http_openai import MAX_SSE_LINE_BYTES, READ_BUFFER_BYTES, HttpOpenAIClient
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.schema import Sampling
from tests.helpers import Handler, serve_http


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def token(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


DONE = b"data: [DONE]\n\n"


class Worker(Handler):
    """One scripted worker: a request's ``model`` names the script its answer follows."""

    protocol_version = "HTTP/1.1"  # keep-alive: a connection serves request after request
    seen: ClassVar[list[dict[str, Any]]] = []  # each request: path, headers, client port
    gone: ClassVar[threading.Event] = threading.Event()  # a stream's client closed its connection
    ended: ClassVar[list[int]] = []  # the client port of each connection that ended

    def handle(self) -> None:
        try:
            super().handle()
        finally:
            self.ended.append(self.client_address[1])

    def do_GET(self) -> None:
        self.seen.append({"path": self.path, "headers": dict(self.headers), "port": self.client_address[1]})
        body = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
        self.reply(200, body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append(
            {"path": self.path, "headers": dict(self.headers), "port": self.client_address[1], "body": body}
        )
        getattr(self, "script_" + body["model"].replace("-", "_"))()

    def start_stream(self, extra: dict[str, str] | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def whole(self, *events: bytes, extra: dict[str, str] | None = None) -> None:
        self.start_stream(extra)
        for e in events:
            self.chunk(e)
        self.end_stream()

    def script_ok(self) -> None:
        self.whole(token("Hel"), token("lo", "stop"), DONE)

    def script_cookie(self) -> None:  # a worker that sets a cookie: the gateway never sends it back
        self.whole(token("Hel"), token("lo", "stop"), DONE, extra={"set-cookie": "session=abc; Path=/"})

    def script_long_line(self) -> None:
        """One token whose line is exactly MAX_SSE_LINE_BYTES long, written 1 MiB at a time."""
        head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}'
        line = head + b"x" * (MAX_SSE_LINE_BYTES - len(head) - len(tail)) + tail
        assert len(line) == MAX_SSE_LINE_BYTES
        self.start_stream()
        for i in range(0, len(line), 1 << 20):
            self.chunk(line[i : i + (1 << 20)])
        self.chunk(b"\n\n" + token("", "stop") + DONE)
        self.end_stream()

    def script_reset(self) -> None:  # a token, then the connection reset (RST, not FIN)
        self.start_stream()
        self.chunk(token("Hel"))
        time.sleep(0.05)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def script_cut(self) -> None:  # a token, then the connection closed before the body's end
        self.start_stream()
        self.chunk(token("Hel"))
        self.connection.shutdown(socket.SHUT_WR)
        self.close_connection = True

    def script_endless(self) -> None:
        """A token, then a comment every 10 ms until the client closes the connection."""
        self.start_stream()
        self.chunk(token("Hel"))
        try:
            for _ in range(1000):
                time.sleep(0.01)
                self.chunk(b": still here\n")
        except OSError:
            type(self).gone.set()
        self.close_connection = True

    def script_steady(self) -> None:  # six tokens 0.3 s apart: longer than the call's timeout of 1 s
        self.start_stream()
        for i in range(6):
            time.sleep(0.3)
            self.chunk(token(str(i), "stop" if i == 5 else None))
        self.chunk(DONE)
        self.end_stream()

    def script_stall(self) -> None:  # a token, then nothing
        self.start_stream()
        self.chunk(token("Hel"))
        time.sleep(3)
        self.close_connection = True

    def script_hold(self) -> None:
        """No answer: wait (5 s at most) for the client to close the connection."""
        self.wait_gone()

    def script_hold_body(self) -> None:
        """The answer's headers, then no body: wait for the client to close the connection."""
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "100")
        self.end_headers()
        self.wfile.flush()
        self.wait_gone()

    def wait_gone(self) -> None:
        for _ in range(500):
            readable, _, _ = select.select([self.connection], [], [], 0.01)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                type(self).gone.set()
                break
        self.close_connection = True

    def script_redirect(self) -> None:
        self.send_response(307)
        self.send_header("location", "/v1/elsewhere")
        self.send_header("content-length", "0")
        self.end_headers()


def worker(**overrides: Callable[..., None]) -> type[Worker]:
    """A fresh worker class (its own record of requests)."""
    return type("ThisWorker", (Worker,), {"seen": [], "ended": [], "gone": threading.Event(), **overrides})


@pytest.fixture
def served() -> Iterator[tuple[type[Worker], str]]:
    cls = worker()
    with serve_http(cls) as url:
        yield cls, url


def prompt(model: str, rid: str = "r1") -> Prompt:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return Prompt(rid, pack_ids([1, 2, 3]), [], Sampling(4), OpenAIBody("chat", body))


async def collect(client: HttpOpenAIClient, model: str, timeout: float = 10) -> list[TokenDelta]:
    stream = client.generate(prompt(model), timeout=timeout)
    try:
        async with asyncio.timeout(20):
            return [d async for d in stream]
    finally:
        await stream.aclose()


async def failure(client: HttpOpenAIClient, model: str, timeout: float = 10) -> tuple[NodeFailure, int]:
    """The attempt's failure and how many deltas came before it."""
    got = 0
    with pytest.raises(NodeFailure) as info:
        stream = client.generate(prompt(model), timeout=timeout)
        async with asyncio.timeout(20):
            async for _ in stream:
                got += 1
    return info.value, got


def client_of(url: str, **options: Any) -> HttpOpenAIClient:
    client = connect(url, **options)
    assert isinstance(client, HttpOpenAIClient)
    return client


async def test_a_request_carries_the_workers_key_its_id_and_trace_and_no_cookie(
    served: tuple[type[Worker], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, url = served
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):  # never through a proxy
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    client = client_of(url, api_key="worker-key")
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token_ = tracing.CONTEXT.set((("traceparent", traceparent),))
    try:
        assert [d.text for d in await collect(client, "cookie")] == ["Hel", "lo"]
        assert [d.text for d in await collect(client, "ok")] == ["Hel", "lo"]
    finally:
        tracing.CONTEXT.reset(token_)
        await client.close()
    first, second = cls.seen
    h = {k.lower(): v for k, v in second["headers"].items()}
    assert second["path"] == "/v1/chat/completions" and second["body"]["stream"] is True
    assert h["authorization"] == "Bearer worker-key" and h["user-agent"] == "prefixgate"
    assert h["x-request-id"] == "r1" and h["traceparent"] == traceparent
    assert h["accept"] == "text/event-stream" and h["content-type"] == "application/json"
    assert h["accept-encoding"] == "identity"  # nothing to decompress
    assert "cookie" not in h  # the first answer's cookie was not kept
    assert first["port"] == second["port"]  # a stream read to its end leaves its connection for the next


async def test_a_redirect_is_not_followed(served: tuple[type[Worker], str]) -> None:
    cls, url = served
    client = client_of(url)
    try:
        e, got = await failure(client, "redirect")
    finally:
        await client.close()
    assert got == 0 and (e.kind, e.stage) == (FailureKind.INTERNAL, Stage.GENERATE) and "HTTP 307" in e.detail
    assert [s["path"] for s in cls.seen] == ["/v1/chat/completions"]


async def test_an_sse_line_past_aiohttps_own_line_limit_is_read_up_to_the_bound(
    served: tuple[type[Worker], str],
) -> None:
    _, url = served
    client = client_of(url)
    try:
        deltas = await collect(client, "long-line")
    finally:
        await client.close()
    # aiohttp's own reader stops a line at twice its read buffer; the adapter splits the lines
    assert MAX_SSE_LINE_BYTES > 2 * READ_BUFFER_BYTES
    text = deltas[0].text
    assert len(text) > MAX_SSE_LINE_BYTES - 100 and set(text) == {"x"}
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("model", ["reset", "cut"])
async def test_a_worker_that_drops_the_connection_mid_stream_fails_the_attempt(
    served: tuple[type[Worker], str], model: str
) -> None:
    _, url = served
    client = client_of(url)
    try:
        e, got = await failure(client, model)
        assert client.inflight == 0
    finally:
        await client.close()
    assert got == 1  # the token before the connection went
    assert (e.kind, e.stage, e.node_id) == (FailureKind.UNAVAILABLE, Stage.GENERATE, url)


async def test_a_stream_closed_early_closes_its_connection(served: tuple[type[Worker], str]) -> None:
    cls, url = served
    client = client_of(url)
    try:
        stream = client.generate(prompt("endless"), timeout=10)
        assert (await anext(stream)).text == "Hel"
        await stream.aclose()
        assert await asyncio.to_thread(cls.gone.wait, 5)  # the worker saw its client go
        assert [d.text for d in await collect(client, "ok")] == ["Hel", "lo"]
    finally:
        await client.close()
    assert cls.seen[0]["port"] != cls.seen[1]["port"]  # not back in the pool: a new connection


async def test_a_stream_that_keeps_coming_outlives_its_timeout_and_one_that_stalls_does_not(
    served: tuple[type[Worker], str],
) -> None:
    _, url = served
    client = client_of(url)
    try:
        # the timeout bounds each wait for the worker, not the whole stream
        steady = await collect(client, "steady", timeout=1.0)
        assert "".join(d.text for d in steady) == "012345" and steady[-1].finish_reason == "stop"
        t0 = time.monotonic()
        e, got = await failure(client, "stall", timeout=0.5)
    finally:
        await client.close()
    assert got == 1 and (e.kind, e.stage) == (FailureKind.TIMEOUT, Stage.GENERATE)
    assert time.monotonic() - t0 < 2.5


async def test_close_ends_the_pool_and_its_connections_without_a_warning(
    served: tuple[type[Worker], str], caplog: pytest.LogCaptureFixture
) -> None:
    cls, url = served
    unused = client_of(url)  # never called: nothing to close
    await unused.close()
    client = client_of(url)
    status = await client.status(timeout=5)
    assert status.models == ("m",)
    ports = {s["port"] for s in cls.seen}
    assert ports and not cls.ended  # kept alive in the pool
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        await client.close()
        for _ in range(100):  # the worker sees each connection close
            if ports <= set(cls.ended):
                break
            await asyncio.sleep(0.02)
        assert ports <= set(cls.ended)
        await client.close()  # closing twice is harmless
        with pytest.raises(RuntimeError, match="closed"):
            await client.status(timeout=5)
        del client
        gc.collect()
        await asyncio.sleep(0.05)
    assert not [r for r in caplog.records if "nclosed" in r.getMessage()]


@pytest.mark.parametrize("model", ["hold", "hold-body"])  # before the answer's headers, or its body
async def test_a_cancelled_call_closes_its_connection(served: tuple[type[Worker], str], model: str) -> None:
    """How a prefill leg is aborted: its non-streamed call cancelled while the engine works."""
    cls, url = served
    client = client_of(url)
    try:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False}
        call = asyncio.create_task(client.answer(OpenAIBody("chat", body), "r1", Stage.PREFILL, 10))
        for _ in range(250):
            if cls.seen:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the headers of hold-body are read: the call waits for its body
        assert cls.seen and not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await asyncio.to_thread(cls.gone.wait, 5)  # the worker saw its client go
    finally:
        await client.close()
