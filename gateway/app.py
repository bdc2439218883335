"""The HTTP front end: OpenAI-compatible API on Starlette."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.errors import APIError, invalid
from gateway.logging import bind_request, current_request_id
from gateway.pipeline import Execution, StreamBroken
from gateway.schema import ParsedRequest, parse_json, parse_request
from gateway.service import GatewayService

log = structlog.get_logger("prefixgate.http")

Handler = Callable[[Request], Awaitable[Response]]


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _svc(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise invalid("invalid Content-Length header") from None
        if size > limit:
            raise APIError(413, f"request body is {size} bytes; the limit is {limit}", code="body_too_large")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def authenticate(svc: GatewayService, request: Request) -> str | None:
    """The caller's tenant when API keys are configured (401 otherwise); None without keys."""
    keys = svc.settings.api_key_map()
    if not keys:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    tenant = keys.get(token.strip())
    if tenant is None:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")
    return tenant


def tenant_of(svc: GatewayService, request: Request, user: str) -> str:
    """The key's tenant, or the ``user`` field when no keys are configured."""
    tenant = authenticate(svc, request)
    return user if tenant is None else tenant


def request_id_of(request: Request) -> str | None:
    rid = request.headers.get("x-prefixgate-request-id") or request.headers.get("x-request-id")
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return None


def _usage(ex: Execution) -> dict[str, Any]:
    return {
        "prompt_tokens": ex.prompt_tokens,
        "completion_tokens": ex.completion_tokens,
        "total_tokens": ex.prompt_tokens + ex.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ex.cached_tokens},
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _watch_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work`` in this task; if the client goes away first, cancel it (nothing left running).

    One watcher task per request: it cancels the handler's own task on ``http.disconnect``.
    """
    handler = asyncio.current_task()
    assert handler is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        handler.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            handler.uncancel()
            return Response(status_code=499)
        raise
    finally:
        watcher.cancel()


async def completions(request: Request, kind: str) -> Response:
    svc = _svc(request)
    s = svc.settings
    rid = current_request_id() or bind_request(request_id_of(request), path=request.url.path)
    if svc.draining:
        raise APIError(503, "the gateway is shutting down", code="shutting_down", retry_after=1)
    key_tenant = authenticate(svc, request)
    body = parse_json(await read_body(request, s.max_body_bytes))
    parsed = parse_request(
        body,
        kind,
        models=svc.models,
        default_max_tokens=s.default_max_tokens,
        max_tokens_limit=s.max_tokens_limit,
        max_documents=s.max_documents,
    )
    tenant = parsed.user if key_tenant is None else key_tenant
    prep = svc.pipeline.prepare(parsed, tenant, rid)
    release = svc.pipeline.admit()

    try:
        if parsed.stream:
            ex = await svc.pipeline.execute(prep)
            headers = ex.headers() if s.response_headers else {}
            return StreamingResponse(
                _stream(ex, parsed, kind, release),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        return await _watch_disconnect(request, _complete(svc, prep, parsed, kind))
    finally:
        if not parsed.stream:
            release()


async def _complete(svc: GatewayService, prep: Any, parsed: ParsedRequest, kind: str) -> Response:
    ex = await svc.pipeline.execute(prep)
    parts: list[str] = []
    try:
        async for d in ex.stream():
            parts.append(d.text)
    except StreamBroken as e:
        raise APIError(502, f"generation failed after it started: {e}", code="stream_broken") from e
    finally:
        await ex.close()
    text = "".join(parts)
    created = int(time.time())
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": ex.finish_reason,
            "logprobs": None,
        }
        obj, rid = "chat.completion", f"chatcmpl-{ex.request_id}"
    else:
        choice = {"index": 0, "text": text, "finish_reason": ex.finish_reason, "logprobs": None}
        obj, rid = "text_completion", f"cmpl-{ex.request_id}"
    payload = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": parsed.model,
        "choices": [choice],
        "usage": _usage(ex),
        "system_fingerprint": "prefixgate",
    }
    headers = ex.headers() if svc.settings.response_headers else {}
    return ORJSONResponse(payload, headers=headers)


async def _stream(
    ex: Execution, parsed: ParsedRequest, kind: str, release: Callable[[], None]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    chat = kind == "chat"
    rid = f"chatcmpl-{ex.request_id}" if chat else f"cmpl-{ex.request_id}"
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": parsed.model,
        "system_fingerprint": "prefixgate",
    }

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        out = {**base, "choices": [choice]}
        if parsed.include_usage:
            out["usage"] = None
        return out

    try:
        first = True
        async for d in ex.stream():
            if d.text or first or d.finish_reason:
                yield _sse(chunk(d.text, d.finish_reason or None, first))
                first = False
        if parsed.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(ex)})
        yield b"data: [DONE]\n\n"
    except StreamBroken as e:
        err = APIError(502, f"generation failed after it started: {e}", code="stream_broken")
        yield _sse(err.body())
    finally:
        await ex.close()
        release()


async def chat_completions(request: Request) -> Response:
    return await completions(request, "chat")


async def text_completions(request: Request) -> Response:
    return await completions(request, "completion")


async def list_models(request: Request) -> Response:
    svc = _svc(request)
    authenticate(svc, request)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "prefixgate"} for m in sorted(svc.models)]
    return ORJSONResponse({"object": "list", "data": data})


async def openapi(request: Request) -> Response:
    from gateway.openapi import openapi_spec

    return ORJSONResponse(openapi_spec(sorted(_svc(request).models)))


async def healthz(request: Request) -> Response:
    return ORJSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    svc = _svc(request)
    pool = svc.pool
    prefill, decode = pool.routable("prefill"), pool.routable("decode")
    mono = pool.routable("monolithic")
    ready = bool(decode or mono) and not svc.draining
    body = {
        "ready": ready,
        "prefill": len(prefill),
        "decode": len(decode),
        "monolithic": len(mono),
        "index": svc.index.backend,
    }
    return ORJSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    svc = _svc(request)
    try:  # index occupancy is read at scrape time; a slow or absent index leaves the last values
        svc.metrics.refresh_index(await asyncio.wait_for(svc.index.stats(), 1.0))
    except Exception as e:
        log.warning("index_stats_failed", error=repr(e)[:200])
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def documents_create(request: Request) -> Response:
    svc = _svc(request)
    authenticate(svc, request)
    body = parse_json(await read_body(request, svc.settings.max_body_bytes))
    text, doc_id = body.get("text"), body.get("id")
    if not isinstance(text, str) or not text:
        raise invalid("'text' must be a non-empty string", "text")
    if doc_id is not None and (not isinstance(doc_id, str) or not doc_id or len(doc_id) > 256):
        raise invalid("'id' must be a string of 1 to 256 characters", "id")
    user = body.get("user")
    tenant = tenant_of(svc, request, user if isinstance(user, str) else "")
    doc_id = svc.documents.put(tenant, text, doc_id)
    return ORJSONResponse({"id": doc_id, "object": "document", "bytes": len(text.encode())}, status_code=201)


async def documents_get(request: Request) -> Response:
    svc = _svc(request)
    tenant = tenant_of(svc, request, request.query_params.get("user", ""))
    doc = svc.documents.get(tenant, request.path_params["doc_id"])
    return ORJSONResponse({"id": doc.id, "object": "document", "text": doc.text})


async def documents_delete(request: Request) -> Response:
    svc = _svc(request)
    tenant = tenant_of(svc, request, request.query_params.get("user", ""))
    doc_id = request.path_params["doc_id"]
    if not svc.documents.delete(tenant, doc_id):
        raise APIError(404, f"document {doc_id!r} not found", code="document_not_found")
    return ORJSONResponse({"id": doc_id, "object": "document", "deleted": True})


def _guard(handler: Handler) -> Handler:
    """Turn APIError (and anything unexpected) into an OpenAI-shaped error response."""

    async def wrapped(request: Request) -> Response:
        bind_request(request_id_of(request), path=request.url.path)  # in every line of this request
        try:
            return await handler(request)
        except APIError as e:
            rid = current_request_id()
            if e.status >= 500 or request.url.path.startswith("/v1/"):  # one line per failed request
                log.info(
                    "request_failed",
                    path=request.url.path,
                    status=e.status,
                    code=e.code,
                    error=e.message[:200],
                )
            return e.response({"x-prefixgate-request-id": rid} if rid else None)
        except Exception:
            log.exception("unhandled_error", path=request.url.path)
            return APIError(500, "internal error in the gateway", code="internal_error").response()

    return wrapped


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", _guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", _guard(text_completions), methods=["POST"]),
        Route("/v1/models", _guard(list_models), methods=["GET"]),
        Route("/v1/documents", _guard(documents_create), methods=["POST"]),
        Route("/v1/documents/{doc_id:str}", _guard(documents_get), methods=["GET"]),
        Route("/v1/documents/{doc_id:str}", _guard(documents_delete), methods=["DELETE"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", _guard(readyz), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


async def _not_found(request: Request, exc: Exception) -> Response:
    return APIError(404, f"no route for {request.method} {request.url.path}", code="not_found").response()


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return APIError(
        405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed"
    ).response()


def create_app(service: GatewayService) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from gateway.grpc_front import GrpcFront

        await service.start()
        front = None
        try:
            if service.settings.grpc_port:  # the gRPC front end shares this process and loop
                front = GrpcFront(service, service.settings.host, service.settings.grpc_port)
                await front.start()
            yield
        finally:
            if front is not None:
                await front.stop()
            await service.stop()

    from gateway.admin import admin_routes

    app = Starlette(
        routes=routes() + admin_routes(),
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed},
    )
    app.state.service = service
    return app
