"""The HTTP access policy, applied before any route runs (pure ASGI: it is on every request's path).

- **Client address**: ``Forwarded``, ``X-Forwarded-For`` and ``X-Real-IP`` are believed only from
  peers listed in ``trusted_proxies``, and all three alike: behind a trusted proxy the client is
  loopback only if every header present says so; a trusted proxy that names no client leaves it
  unknown (never loopback). From any other peer these headers are ignored.
- **JSON only**: POST/PUT/PATCH bodies on ``/v1/`` and ``/admin`` need ``Content-Type:
  application/json`` (415 otherwise), so a cross-site form or ``text/plain`` fetch cannot drive
  them; a request with no body at all passes (browsers send an ``Origin`` with it, checked below).
- **Admin from a browser**: an ``Origin`` other than the request's own host (or ``admin_origins``)
  is refused; without an admin token (loopback trust) the ``Host`` must be a loopback name, which
  defeats DNS rebinding.
- **Metrics**: ``/metrics`` needs ``Authorization: Bearer <metrics_token>`` when one is set.
- **Shutdown**: every request in flight is tracked, so that the ones still running when the
  shutdown grace ends are ended cleanly (``gateway.shutdown.Inflight.end_all``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from prefixgate.gateway.config import Settings
from prefixgate.gateway.shutdown import CUT_CODE, CUT_MESSAGE, Inflight, Tracked
from prefixgate.openai.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_WANTED = frozenset(
    {b"content-type", b"content-length", b"transfer-encoding", b"host", b"origin", b"authorization"}
)
_PROXY_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})
_SSE = b"text/event-stream"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address.lower() == "localhost"


def _host_name(host: str) -> str:
    """``host[:port]`` or ``[v6]:port`` without the port, lower-case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_host(host: str) -> bool:
    name = _host_name(host)
    return name.endswith(".localhost") or name in _LOOPBACK_NAMES or is_loopback(name)


def _strip_port(node: str) -> str:
    node = node.strip().strip('"')
    if node.startswith("["):
        return node[1 : node.find("]")] if "]" in node else node
    return node.rsplit(":", 1)[0] if node.count(":") == 1 else node


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` nodes of a ``Forwarded`` header (RFC 7239), in hop order."""
    out = []
    for element in value.split(","):
        for pair in element.split(";"):
            name, _, node = pair.partition("=")
            if name.strip().lower() == "for" and node:
                out.append(_strip_port(node))
    return out


def _text(value: bytes, default: str = "") -> str:
    return value.decode("latin-1") if value else default


def _json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class ProxyPolicy:
    """Who the client is, given the peer and the proxy headers."""

    def __init__(self, trusted: list[str]) -> None:
        self.networks = [ipaddress.ip_network(t.strip(), strict=False) for t in trusted if t.strip()]

    def trusts(self, address: str) -> bool:
        if not self.networks:
            return False
        try:
            ip = ipaddress.ip_address(address.strip("[]"))
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def _rightmost_untrusted(self, chain: list[str]) -> str:
        for hop in reversed(chain):
            if not self.trusts(hop):
                return hop
        return chain[0]

    def client(self, peer: str, headers: dict[bytes, bytes]) -> str:
        """The client address: ``peer`` unless it is a trusted proxy; then the address the proxy
        headers give (the first non-loopback one if they disagree), or ``unknown``."""
        if not self.trusts(peer):
            return peer
        candidates = []
        if b"forwarded" in headers:
            chain = [n for n in _forwarded_for(_text(headers[b"forwarded"])) if n]
            if chain:
                candidates.append(self._rightmost_untrusted(chain))
        if b"x-forwarded-for" in headers:
            chain = [h.strip() for h in _text(headers[b"x-forwarded-for"]).split(",") if h.strip()]
            if chain:
                candidates.append(self._rightmost_untrusted(chain))
        if b"x-real-ip" in headers and headers[b"x-real-ip"].strip():
            candidates.append(_text(headers[b"x-real-ip"]).strip())
        if not candidates:
            return "unknown"
        return next((c for c in candidates if not is_loopback(c)), candidates[0])


async def run_tracked(inflight: Inflight, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one request tracked in ``inflight``; if shutdown cuts it, end it as documented."""
    with inflight.track("http") as req:

        async def tracked_send(message: Message) -> None:
            if req.started:
                if not message.get("more_body", False):
                    req.complete = True
            elif message["type"] == "http.response.start":
                req.started = True
                for name, value in message.get("headers", ()):
                    if name == b"content-type":
                        req.sse = value.startswith(_SSE)
            await send(message)

        try:
            await app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            if not req.resume_if_cut():
                raise
            # a client that does not read can hold this write until uvicorn's own deadline
            # cancels it: the connection is then closed with nothing more to say
            with contextlib.suppress(asyncio.CancelledError):
                await _finish_cut(req, send)


_SHUTDOWN = APIError(503, CUT_MESSAGE, code=CUT_CODE, retry_after=1)


async def _finish_cut(req: Tracked, send: Send) -> None:
    """End a request cut by shutdown as the API documents a mid-stream failure."""
    if not req.started:
        await _send_error(send, _SHUTDOWN)
    elif req.sse and not req.complete:
        event = b"data: " + orjson.dumps(_SHUTDOWN.body()) + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": False})


async def _send_error(send: Send, err: APIError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(err.retry_after))).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HttpGuard:
    """ASGI middleware applying the policy in this module's docstring."""

    def __init__(self, app: ASGIApp, settings: Settings, inflight: Inflight | None = None) -> None:
        self.app = app
        self.proxies = ProxyPolicy(settings.trusted_proxies)
        self.loopback_trust = not settings.admin_token
        self.admin_origins = frozenset(o.rstrip("/").lower() for o in settings.admin_origins)
        self.metrics_token = settings.metrics_token.encode()
        self.inflight = inflight if inflight is not None else Inflight()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is not None:
            extra = [(b"www-authenticate", b"Bearer")] if refusal.status == 401 else None
            await _send_error(send, refusal, extra)
            return
        await run_tracked(self.inflight, self.app, scope, receive, send)

    def check(self, scope: Scope) -> APIError | None:
        """The refusal for this request, or None; may rewrite ``scope["client"]``."""
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            if name in _WANTED:
                headers[name] = value
            elif name in _PROXY_HEADERS:
                headers[name] = headers[name] + b"," + value if name in headers else value
        if self.proxies.networks:
            peer = scope["client"][0] if scope.get("client") else ""
            client = self.proxies.client(peer, headers)
            if client != peer:
                scope["client"] = (client, 0)

        path: str = scope["path"]
        if path == "/metrics" and self.metrics_token:
            scheme, _, token = _text(headers.get(b"authorization", b"")).partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.metrics_token
            ):
                return APIError(
                    401,
                    "metrics token required: send 'Authorization: Bearer <token>'",
                    code="invalid_metrics_token",
                )
            return None
        admin = path.startswith("/admin")
        if admin:
            refusal = self._admin_origin(headers)
            if refusal is not None:
                return refusal
        if scope["method"] in _BODY_METHODS and (admin or path.startswith("/v1/")):
            content_type = headers.get(b"content-type", b"")
            bodyless = (
                not content_type
                and headers.get(b"content-length", b"0") == b"0"
                and b"transfer-encoding" not in headers
            )
            if (
                content_type != b"application/json"
                and not bodyless
                and not _json_media_type(_text(content_type))
            ):
                shown = _text(content_type) or "none"
                return APIError(
                    415,
                    f"request bodies must be JSON (Content-Type: application/json); got {shown}",
                    code="unsupported_media_type",
                )
        return None

    def _admin_origin(self, headers: dict[bytes, bytes]) -> APIError | None:
        host = _text(headers.get(b"host", b""))
        origin = _text(headers.get(b"origin", b"")).rstrip("/").lower()
        if origin and origin not in self.admin_origins:
            _, _, origin_host = origin.partition("://")
            if origin_host != host.lower():
                return APIError(
                    403, f"the admin API does not answer pages from {origin}", code="admin_origin_not_allowed"
                )
        if self.loopback_trust and not is_loopback_host(host):
            return APIError(
                403,
                "without an admin token the admin API answers requests addressed to a loopback host only",
                code="admin_host_not_allowed",
            )
        return None
