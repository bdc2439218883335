"""The floor under prefixgate's request path: its server and client libraries, and nothing else.

uvicorn (httptools, uvloop) takes a chat, aiohttp relays it to one node and the node's answer
goes back as it came: no parsing, routing, metrics or log line. ``bench instructions --floor``
counts it beside the routers, so a table says how much of a request over ``http://`` is these
libraries (which no change to prefixgate's own code removes) and how much is prefixgate.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

NODE_ENV = "PREFIXGATE_FLOOR_NODE"  # the node's base URL (``http://HOST:PORT``)
MAX_BODY_BYTES = 8 * 1024 * 1024
CHAT_PATH = "/v1/chat/completions"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class FloorRelay:
    """An ASGI app: ``POST /v1/chat/completions`` relayed to the node, ``GET /readyz``; 404 else."""

    def __init__(self, node: str) -> None:
        self._node_url = node.rstrip("/") + CHAT_PATH
        self._http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http_request(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # the gateway's own session settings (``gateway.nodeclient.http_openai``) that
                # change what a call costs: no cookies, nothing decompressed
                self._http = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._http is not None:
                    await self._http.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/readyz":
            await _answer(send, 200, b"application/json", b'{"ready":true}')
        elif method == "POST" and path == CHAT_PATH and self._http is not None:
            body = await _read_body(receive)
            if body is None:
                await _answer(send, 413, b"text/plain", b"body too large")
                return
            headers = {"content-type": "application/json"}
            async with self._http.post(self._node_url, data=body, headers=headers) as r:
                answer = await r.read()
                ctype = r.headers.get("content-type", "application/json").encode()
                await _answer(send, r.status, ctype, answer)
        else:
            await _answer(send, 404, b"text/plain", b"not found")


async def _read_body(receive: Receive) -> bytes | None:
    """The request's body, or None past ``MAX_BODY_BYTES``."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(send: Send, status: int, ctype: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": body})


def app() -> FloorRelay:
    """uvicorn's factory: the relay to the node named in ``PREFIXGATE_FLOOR_NODE``."""
    return FloorRelay(os.environ[NODE_ENV])


def command(port: int, python: str = sys.executable) -> list[str]:
    """The floor on ``port``, on the gateway's own uvicorn settings (uvloop, httptools)."""
    return [
        python,
        "-m",
        "uvicorn",
        "--factory",
        "prefixgate.bench.floor:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
    ]
