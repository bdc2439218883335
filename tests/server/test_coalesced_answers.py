"""A response of known length leaves the gateway's HTTP protocol in one write, head and body; a
response without one (a stream) still has its head sent at once. A real uvicorn server with the
gateway's protocol on loopback, read with a raw socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import Receive, Scope, Send

from prefixgate.gateway.httpfront.connections import ConnectionLimits, limited_protocol

PAUSE_S = 0.4  # between the answer's head and its body: long enough to see what was sent first
BODY = b'{"answer": "whole"}'


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    whole = scope["path"] == "/whole"
    headers = [(b"content-type", b"application/json")]
    if whole:
        headers.append((b"content-length", str(len(BODY)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await asyncio.sleep(PAUSE_S)
    if whole:
        await send({"type": "http.response.body", "body": BODY})
    else:
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=limited_protocol(ConnectionLimits()),
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _first_read(port: int, path: str, version: str = "1.1") -> tuple[bytes | None, bytes]:
    """What could be read within half the pause (None: nothing), then the whole response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        try:
            early: bytes | None = await asyncio.wait_for(reader.read(65536), PAUSE_S / 2)
        except TimeoutError:
            early = None
        rest = await asyncio.wait_for(reader.read(), 10)
        return early, (early or b"") + rest
    finally:
        writer.close()


async def test_a_whole_answer_is_written_with_its_head_in_one_piece() -> None:
    async with serving() as port:
        early, whole = await _first_read(port, "/whole")
    assert early is None  # the head waited for the body
    head, _, body = whole.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == BODY


async def test_a_stream_has_its_head_sent_before_its_first_event() -> None:
    async with serving() as port:
        early, whole = await _first_read(port, "/stream")
    assert early is not None and early.startswith(b"HTTP/1.1 200") and early.endswith(b"\r\n\r\n")
    assert b"data: 1" in whole


async def test_an_http10_whole_answer_is_one_piece_too() -> None:
    async with serving() as port:
        early, whole = await _first_read(port, "/whole", "1.0")
    assert early is None
    assert whole.endswith(b"\r\n\r\n" + BODY)
