"""Connection limits uvicorn's httptools protocol does not have.

uvicorn only times out a keep-alive connection *after* a response; a socket that never sends a
byte, stops half-way through its headers or its body stays open forever, and httptools buffers a
header of any size. This subclass adds, per connection:

- a header deadline (from accept, or from the first byte of the next request, to the end of the
  headers), a body deadline (from the end of the headers to the end of the body);
- a header-size bound checked as bytes arrive (431, before they are buffered);
- a connection cap held under the process's open-file limit: at the cap a new connection evicts
  the longest-idle connection (no request in progress), or is refused with 503 if none is idle,
  so silent sockets cannot starve real requests of file descriptors;
- close-delimited responses for HTTP/1.0 clients, which cannot read chunked encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from prefixgate.openai.errors import APIError

#: File descriptors kept for everything that is not a client connection (node channels, Redis, logs).
FD_RESERVE = 64

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 32 * 1024
    max_connections: int = 1024


def fd_bounded_connections(requested: int, reserve: int = FD_RESERVE) -> int:
    """``requested``, lowered so that the connections fit under RLIMIT_NOFILE with ``reserve`` spare."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - reserve))


def error_response(status: int, message: str, code: str) -> bytes:
    """A complete ``connection: close`` response in OpenAI's error format, written by the protocol."""
    body = orjson.dumps(APIError(status, message, code=code).body())
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (status, _REASONS.get(status, b""), len(body))
    )
    return head + body


#: ``scope["extensions"]`` key of the request's :class:`DisconnectHook`.
DISCONNECT_EXTENSION = "prefixgate.disconnect"


class DisconnectHook:
    """Callbacks run when a request's connection is lost before its response completed.

    The protocol puts one in every request's scope (``DISCONNECT_EXTENSION``), so a handler can
    learn that its client left without a task of its own waiting on ``receive()`` for it.
    """

    __slots__ = ("callbacks", "fired")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.fired = False

    def register(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` on disconnect (soon, if the client has left already); returns the
        function that unregisters it."""
        if self.fired:
            asyncio.get_running_loop().call_soon(callback)
            return _nothing
        self.callbacks.append(callback)

        def unregister() -> None:
            with contextlib.suppress(ValueError):
                self.callbacks.remove(callback)

        return unregister

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


def _nothing() -> None:
    pass


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing a request already answered."""


class CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 response without Content-Length: the body ends when the connection closes
    (HTTP/1.0 has no chunked encoding)."""

    close_delimited = False

    async def send(self, message: Any) -> None:
        if not self.response_started and message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            status = message["status"]
            if (
                b"content-length" not in names
                and self.scope["method"] != "HEAD"
                and status not in (204, 304)
                and not 100 <= status < 200
            ):
                self.close_delimited = True
                self.chunked_encoding = False  # uvicorn then adds no transfer-encoding
                self.keep_alive = False
        elif self.close_delimited and self.response_started and message["type"] == "http.response.body":
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected or self.response_complete:
                return
            body = message.get("body", b"")
            if body:
                self.transport.write(body)
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()
                self.transport.close()
                self.on_response()
            return
        await super().send(message)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; ``limits`` is set per server by
    :func:`limited_protocol`."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_headers = True
        self._header_bytes = 0
        self._closing = False
        self._idle_since = 0.0
        self._hook: DisconnectHook | None = None

    # -- connection lifecycle -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._reject(
                503, "the gateway has too many open connections; retry shortly", "too_many_connections"
            )
            return
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._disarm()
        super().connection_lost(exc)
        self._client_gone()

    def _client_gone(self) -> None:
        """Tell the current request's handler, if its response is not complete."""
        if self._hook is not None and self.cycle is not None and not self.cycle.response_complete:
            self._hook.fire()

    def _evictable(self) -> bool:
        return (
            not self._closing and (self.cycle is None or self.cycle.response_complete) and not self.pipeline
        )

    def _make_room(self) -> bool:
        """Close the longest-idle connection to admit this one; False if every other is busy."""
        live = 0
        victim: LimitedHttpToolsProtocol | None = None
        for conn in self.connections:
            if not isinstance(conn, LimitedHttpToolsProtocol) or conn._closing:
                continue
            live += 1
            if (
                conn is not self
                and conn._evictable()
                and (victim is None or conn._idle_since < victim._idle_since)
            ):
                victim = conn
        if live <= self.limits.max_connections:
            return True
        if victim is None:
            return False
        victim._close()
        return True

    def _close(self) -> None:
        self._closing = True
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _reject(self, status: int, message: str, code: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(error_response(status, message, code))
        self._close()

    # -- deadlines ------------------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timeout(self) -> None:
        self._deadline = None
        if self._header_bytes:
            self._reject(408, "the request headers did not arrive in time", "header_timeout")
        else:
            self._close()  # silent connection: nothing to answer

    def _body_timeout(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._reject(408, "the request body did not arrive in time", "body_timeout")
        else:
            self._close()
        if cycle is not None:  # the app reads a disconnect and its answer is dropped
            cycle.disconnected = True
            cycle.message_event.set()
            self._client_gone()

    # -- parsing --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._unset_keepalive_if_required()
        if self._reading_headers:
            if self._deadline is None:  # first byte of a request on a kept-alive connection
                self._arm(self.limits.header_timeout_s, self._header_timeout)
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._closing:
                return  # answered already (431 from on_headers_complete)
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._reading_headers and self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large()

    def _headers_too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self._reject(431, f"request headers exceed the limit of {limit} bytes", "headers_too_large")

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._headers_too_large()
            raise _Rejected
        self._reading_headers = False
        self._header_bytes = 0
        super().on_headers_complete()
        if self._closing:
            return
        self._hook = DisconnectHook()  # the request's task starts on the next loop iteration
        extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
        extensions[DISCONNECT_EXTENSION] = self._hook
        self._arm(self.limits.body_timeout_s, self._body_timeout)
        if self.scope.get("http_version") == "1.0" and type(self.cycle) is RequestResponseCycle:
            # uvicorn builds the cycle itself; its layout is unchanged by the subclass.
            self.cycle.__class__ = CloseDelimitedCycle

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._reading_headers = True
        self._header_bytes = 0

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()


def limited_protocol(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` carrying these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
