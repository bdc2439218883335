"""The floor under prefixgate's request path: its server and client libraries, and nothing else.

uvicorn (httptools, uvloop) takes a chat, aiohttp relays it to one node and the node's answer
goes back as it came: no parsing, routing, metrics or log line. ``bench instructions --floor``
counts it beside the routers, so a table says how much of a request over ``http://`` is these
libraries (which no change to prefixgate's own code removes) and how much is prefixgate.

Beside it, ``essentials``: the same relay doing, in straight-line code, what every gateway
request needs at the least: the body parsed and its messages checked, the chat rendered and
hashed block by block, the blocks looked up and recorded in an index, the least-loaded node
chosen, the answer parsed and given its id, a counter, a histogram and a JSON log line. What it
costs above the floor is what those parts cost written lean; what prefixgate costs above it is
its layers and the features the essentials leave out (tenancy, scheduling, breakers, retries,
deadlines, tracing).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import orjson
import xxhash
from prometheus_client import CollectorRegistry, Counter, Histogram

NODE_ENV = "PREFIXGATE_FLOOR_NODE"  # the node's base URL (``http://HOST:PORT``)
MAX_BODY_BYTES = 8 * 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
BLOCK_BYTES = 256  # rendered text hashed in blocks of this size
MAX_INDEX_BLOCKS = 1_000_000
ROLES = frozenset(("system", "user", "assistant", "tool"))

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
                ctype = r.headers.get("content-type", "application/json").encode()
                if ctype.startswith(b"text/event-stream"):  # each chunk on as it comes
                    await _start(send, r.status, ctype)
                    async for chunk in r.content.iter_any():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b""})
                else:
                    await _answer(send, r.status, ctype, await r.read())
        else:
            await _answer(send, 404, b"text/plain", b"not found")


class EssentialsRelay(FloorRelay):
    """The relay, plus the least every gateway request does (the module's docstring)."""

    def __init__(self, node: str) -> None:
        super().__init__(node)
        self._index: dict[int, str] = {}
        self._load = {node: 0}
        registry = CollectorRegistry()
        self._requests = Counter("requests", "Requests", ["outcome"], registry=registry).labels("ok")
        self._latency = Histogram("latency_seconds", "Latency", registry=registry)

    async def _http_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST" or scope["path"] != CHAT_PATH or self._http is None:
            await super()._http_request(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = uuid.uuid4().hex
        raw = await _read_body(receive)
        try:
            chat = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            chat = None
        messages = chat.get("messages") if isinstance(chat, dict) else None
        text = _render(messages) if isinstance(messages, list) else None
        if chat is None or text is None:
            await _answer(send, 400, b"text/plain", b"a chat with messages of role and text content")
            return
        blocks = _block_hashes(text.encode())
        node = min(self._load, key=self._load.__getitem__)
        cached = 0
        for h in blocks:
            if self._index.get(h) != node:
                break
            cached += 1
        self._load[node] += 1
        answer_id = "chatcmpl-" + request_id
        try:
            headers = {"content-type": "application/json", "x-request-id": request_id}
            async with self._http.post(self._node_url, data=orjson.dumps(chat), headers=headers) as r:
                if chat.get("stream"):
                    answer = await _relay_events(r, send, answer_id)
                else:
                    status, answer = r.status, orjson.loads(await r.read())
                    if isinstance(answer, dict):
                        answer["id"] = answer_id
                    await _answer(send, status, b"application/json", orjson.dumps(answer))
        finally:
            self._load[node] -= 1
        if len(self._index) + len(blocks) <= MAX_INDEX_BLOCKS:
            self._index.update(dict.fromkeys(blocks, node))
        seconds = time.perf_counter() - start
        self._requests.inc()
        self._latency.observe(seconds)
        usage = (answer.get("usage") if isinstance(answer, dict) else None) or {}
        line = {
            "event": "request",
            "request_id": request_id,
            "node": node,
            "cached_blocks": cached,
            "prompt_tokens": usage.get("prompt_tokens"),
            "total_ms": round(seconds * 1e3, 2),
        }
        sys.stderr.write(orjson.dumps(line).decode() + "\n")


def _render(messages: list[Any]) -> str | None:
    """The chat as one text (None: a message without a known role and text content)."""
    parts: list[str] = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str) or m.get("role") not in ROLES:
            return None
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts)


def _block_hashes(data: bytes) -> list[int]:
    """Chained hashes of ``data``'s whole blocks: each block's hash is seeded by the one before."""
    out: list[int] = []
    h = 0
    for i in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = xxhash.xxh3_64_intdigest(data[i : i + BLOCK_BYTES], seed=h)
        out.append(h)
    return out


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


async def _relay_events(r: aiohttp.ClientResponse, send: Send, answer_id: str) -> Any:
    """The node's event stream on to the client, each event parsed and given the answer's id as
    it comes; the last event that carried a JSON object (the usage, when asked for)."""
    await _start(send, r.status, b"text/event-stream")
    last: Any = None
    held = b""
    async for chunk in r.content.iter_any():
        *lines, held = (held + chunk).split(b"\n")
        out: list[bytes] = []
        for line in lines:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                event["id"] = answer_id
                last = event
                line = b"data: " + orjson.dumps(event)
            out.append(line + b"\n")
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    await send({"type": "http.response.body", "body": held})
    return last


async def _start(send: Send, status: int, ctype: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})


async def _answer(send: Send, status: int, ctype: bytes, body: bytes) -> None:
    await _start(send, status, ctype)
    await send({"type": "http.response.body", "body": body})


def app() -> FloorRelay:
    """uvicorn's factory: the relay to the node named in ``PREFIXGATE_FLOOR_NODE``."""
    return FloorRelay(os.environ[NODE_ENV])


def essentials() -> EssentialsRelay:
    """uvicorn's factory: the essentials' relay to the node named in ``PREFIXGATE_FLOOR_NODE``."""
    return EssentialsRelay(os.environ[NODE_ENV])


def command(port: int, python: str = sys.executable, factory: str = "app") -> list[str]:
    """The floor (``factory`` "app") or the essentials ("essentials") on ``port``, on the
    gateway's own uvicorn settings (uvloop, httptools)."""
    return [
        python,
        "-m",
        "uvicorn",
        "--factory",
        f"prefixgate.bench.floor:{factory}",
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
