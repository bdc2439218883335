"""The admin API (``/admin``): bearer admin token, or loopback clients only when none is set."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import ORJSONResponse, _guard, _svc, read_body
from gateway.errors import APIError, invalid
from gateway.schema import parse_json

Handler = Callable[[Request], Awaitable[Response]]
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
SWITCHES = ("disaggregation", "prefix_routing", "normalization")


def require_admin(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        token = _svc(request).settings.admin_token
        if token:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                raise APIError(
                    401,
                    "admin token required: send 'Authorization: Bearer <admin token>'",
                    code="invalid_admin_token",
                )
        else:
            client = request.client.host if request.client else ""
            if client not in LOOPBACK and not client.startswith("127."):
                raise APIError(
                    403,
                    "the admin API without an admin token answers loopback clients only",
                    code="admin_loopback_only",
                )
        return await handler(request)

    return _guard(wrapped)


async def get_switches(request: Request) -> Response:
    sw = _svc(request).pipeline.switches
    return ORJSONResponse({name: getattr(sw, name) for name in SWITCHES})


async def put_switches(request: Request) -> Response:
    svc = _svc(request)
    body = parse_json(await read_body(request, 64 * 1024))
    unknown = set(body) - set(SWITCHES)
    if unknown:
        raise invalid(f"unknown switch(es) {sorted(unknown)}; known: {list(SWITCHES)}", sorted(unknown)[0])
    for name, value in body.items():
        if not isinstance(value, bool):
            raise invalid(f"switch '{name}' must be true or false", name)
    sw = svc.pipeline.switches
    for name, value in body.items():
        setattr(sw, name, value)
    return ORJSONResponse({name: getattr(sw, name) for name in SWITCHES})


def admin_routes() -> list[Route]:
    return [
        Route("/admin/switches", require_admin(get_switches), methods=["GET"]),
        Route("/admin/switches", require_admin(put_switches), methods=["PUT"]),
    ]
