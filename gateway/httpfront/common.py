"""HTTP plumbing shared by the client API (``gateway.httpfront.app``) and the admin API
(``gateway.httpfront.admin``).

Errors are mapped here once: a domain error (``prefixgate.gateway.core.errors``) becomes an OpenAI-format
error with its HTTP status (``prefixgate.openai.errors.from_domain``); anything unexpected becomes a 500.

Two kinds of endpoint: ``guard(handler)`` for a handler that returns its response, and
``Endpoint(handler)`` for one that sends its own (``respond``), so that whatever it holds (an
in-flight slot, a node stream) is released only once the response has been sent or abandoned,
however that ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from prefixgate.gateway import tracing
from prefixgate.gateway.core.auth import valid_request_id
from prefixgate.gateway.core.errors import GatewayError, InvalidRequest, TooLarge
from prefixgate.gateway.core.runner import Caller, RequestRunner
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.connections import DISCONNECT_EXTENSION, DisconnectHook
from prefixgate.gateway.logging import bind_request, current_request_id
from prefixgate.gateway.scheduling.classes import PRIORITY_CLASS_HEADER, TTFT_SLO_HEADER
from prefixgate.openai.errors import APIError, from_domain

log = structlog.get_logger("prefixgate.http")

Handler = Callable[[Request], Awaitable[Response]]
Respond = Callable[[Response], Awaitable[None]]
SelfResponding = Callable[[Request, Respond], Awaitable[None]]
REQUEST_ID_HEADERS = ("x-prefixgate-request-id", "x-request-id")
SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's last event of a stream


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def service_of(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


def runner_of(request: Request) -> RequestRunner:
    return service_of(request).runner


# The headers a request's own path reads (``read_headers``).
_READ = frozenset(
    name.encode()
    for name in (
        "authorization",
        "content-length",
        *REQUEST_ID_HEADERS,
        PRIORITY_CLASS_HEADER,
        TTFT_SLO_HEADER,
        tracing.TRACEPARENT_KEY,
        tracing.TRACESTATE_KEY,
    )
)
_HEADERS_KEY = "prefixgate.headers"


def read_headers(scope: Scope) -> Mapping[str, str]:
    """The headers the request path reads (``_READ``; the first of a repeated one, as starlette's
    ``Headers.get`` gives it), taken in one pass over the scope's list and kept in the scope.
    ``Headers.get`` walks the whole list for each name, and raises and catches a ``KeyError``
    for each name the client did not send, which is most of them: seven lookups a completion."""
    found: dict[str, str] | None = scope.get(_HEADERS_KEY)
    if found is None:
        found = {}
        for name, value in scope["headers"]:
            name = name.lower()
            if name in _READ:
                found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        scope[_HEADERS_KEY] = found
    return found


def request_id_of(request: Request) -> str | None:
    """The client's request id (first valid of the two headers), or None."""
    headers = read_headers(request.scope)
    return valid_request_id(*(headers.get(h) for h in REQUEST_ID_HEADERS))


def caller_of(request: Request) -> Caller:
    """What the runner needs from an HTTP request: credentials, request id, client address."""
    headers = read_headers(request.scope)
    client = request.scope.get("client")
    return Caller(
        authorization=headers.get("authorization", ""),
        request_id=current_request_id() or request_id_of(request),
        client_host=client[0] if client else "",
        priority_class=headers.get(PRIORITY_CLASS_HEADER, ""),
        ttft_slo_ms=headers.get(TTFT_SLO_HEADER, ""),
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes before reading them all."""
    declared = read_headers(request.scope).get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if size > limit:
            raise TooLarge(f"request body is {size} bytes; the limit is {limit}", code="body_too_large")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(request: Request, e: Exception) -> Response:
    """The one place an error becomes an HTTP answer (and a log line)."""
    if isinstance(e, GatewayError):
        e = from_domain(e)
    if not isinstance(e, APIError):
        log.error("unhandled_error", path=request.url.path, exc_info=e)
        return APIError(500, "internal error in the gateway", code="internal_error").response()
    rid = current_request_id()
    if e.status >= 500 or request.url.path.startswith("/v1/"):  # one line per failed request
        log.info("request_failed", path=request.url.path, status=e.status, code=e.code, error=e.message[:200])
    return e.response({"x-prefixgate-request-id": rid} if rid else None)


def guard(handler: Handler) -> Handler:
    """Turn domain errors, APIError and anything unexpected into an OpenAI-shaped response."""

    async def wrapped(request: Request) -> Response:
        bind_request(request_id_of(request), path=request.url.path)  # in every line of this request
        try:
            return await handler(request)
        except Exception as e:
            return error_response(request, e)

    return wrapped


class Endpoint:
    """An ASGI endpoint whose handler sends its own response through ``respond``.

    An error raised before the response started is answered as ``guard`` answers it; after
    that, the status line is gone and the handler ends the body itself (an SSE error event).
    """

    def __init__(self, handler: SelfResponding) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        rid = bind_request(request_id_of(request), path=scope["path"])
        started = False

        async def respond(response: Response) -> None:
            nonlocal started
            started = True
            await response(scope, receive, send)

        with tracing.request(
            "prefixgate.request",
            request.headers if tracing.active() else read_headers(scope),  # a span reads them all
            **{"http.route": scope["path"], "prefixgate.request_id": rid},
        ):
            try:
                await self.handler(request, respond)
            except ClientDisconnect:
                log.info("client_disconnected", path=scope["path"])
            except Exception as e:
                if started:
                    log.error("response_failed", path=scope["path"], exc_info=e)
                    return
                await error_response(request, e)(scope, receive, send)


class EventStream(Response):
    """A ``text/event-stream`` response written by the handler's own task.

    Starlette's ``StreamingResponse`` runs the body in a task group next to a second task that
    listens for the disconnect; here the handler's ``DisconnectWatch`` stays armed for the whole
    stream instead, and cancels the handler (so the body generator and the node's work) when the
    client leaves. It is disarmed (``on_last``) before the last message, since the end of the
    response also reads as a disconnect. One task per stream instead of three.
    """

    media_type = "text/event-stream"

    def __init__(
        self, body: AsyncIterator[bytes], headers: Mapping[str, str], on_last: Callable[[], None]
    ) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.on_last = on_last
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if chunk.endswith(SSE_DONE):  # the last event: written with the end of the body
                self.on_last()
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.on_last()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class DisconnectWatch:
    """Cancel the current task if the client disconnects, from ``arm()`` (once the body is read)
    until ``disarm()`` (before the response's last message).

    Under the gateway's own protocol (``gateway.httpfront.connections``) the request's disconnect hook
    calls back; under any other server a task waits on ``receive()`` for the disconnect.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.gone = False
        self._task: asyncio.Task[None] | None = None
        self._unregister: Callable[[], None] | None = None

    def arm(self) -> None:
        handler = asyncio.current_task()
        assert handler is not None

        def left() -> None:
            self.gone = True
            handler.cancel()

        hook = self.request.scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
        if isinstance(hook, DisconnectHook):
            self._unregister = hook.register(left)
            return

        async def watch() -> None:
            while (await self.request.receive())["type"] != "http.disconnect":
                pass
            left()

        self._task = asyncio.get_running_loop().create_task(watch())

    def disarm(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
