"""The HTTP front end: OpenAI-compatible API on Starlette.

Completions are served through the request runner (``gateway.core.runner``); the plumbing shared
with the admin API (error mapping, body reading, request ids) is in ``gateway.httpfront.common``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixgate.gateway.config import KEYLESS_TENANT
from prefixgate.gateway.core import choices
from prefixgate.gateway.core import embeddings as core_embeddings
from prefixgate.gateway.core.errors import NotFound, invalid
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront import responses
from prefixgate.gateway.httpfront.admin import admin_routes
from prefixgate.gateway.httpfront.common import (
    DisconnectWatch,
    Endpoint,
    EventStream,
    ORJSONResponse,
    Respond,
    caller_of,
    guard,
    read_body,
    service_of,
)
from prefixgate.gateway.httpfront.headers import execution_headers
from prefixgate.gateway.httpfront.metrics_listener import scrape
from prefixgate.gateway.httpfront.smg_workers import smg_worker_routes
from prefixgate.openai.embeddings import parse_embeddings
from prefixgate.openai.errors import APIError
from prefixgate.openai.schema import ParsedRequest, document_id, parse_request

log = structlog.get_logger("prefixgate.http")


def authenticate(svc: GatewayService, request: Request) -> str | None:
    """The caller's tenant when API keys are configured (401 otherwise); None without keys."""
    return svc.runner.authenticate(caller_of(request))


def tenant_of(svc: GatewayService, request: Request) -> str:
    """The key's tenant; without keys the one shared tenant (``user`` is never an identity)."""
    tenant = authenticate(svc, request)
    return KEYLESS_TENANT if tenant is None else tenant


def parse_completion_body(svc: GatewayService, body: dict[str, Any], kind: str) -> ParsedRequest:
    """Validate a client body (cheap limits first, then the full schema)."""
    s = svc.settings
    return parse_request(
        body,
        kind,
        models=svc.models,
        default_max_tokens=s.default_max_tokens,
        max_tokens_limit=s.max_tokens_limit,
        max_documents=s.max_documents,
        max_messages=s.max_messages,
        max_content_parts=s.max_content_parts,
    )


async def completions(request: Request, respond: Respond, kind: str) -> None:
    """Serve one completion through the runner; the slot is held until the response is sent.

    A request is cancelled (work on the nodes included) when the client leaves before its
    answer, or, streaming, before its last event.
    """
    svc = service_of(request)
    runner = svc.runner
    watch = DisconnectWatch(request)
    try:
        context = runner.enter(caller_of(request))
        raw = await read_body(request, svc.settings.max_body_bytes)
        watch.arm()
        body = await runner.parse_body(raw)
        parsed, prep = await runner.prepare(
            lambda: parse_completion_body(svc, body, kind), context.with_body(len(raw)), body=body
        )
        async with runner.run(prep, choices.Generate(svc.pipeline, parsed.n)) as ex:
            headers = execution_headers(ex.first) if svc.settings.response_headers else {}
            if parsed.stream:  # the watch stays armed until the stream's last message
                async with aclosing(responses.stream(ex, parsed, kind)) as events:
                    await respond(EventStream(events, {**headers, "cache-control": "no-cache"}, watch.disarm))
                return
            response = await responses.complete(ex, parsed, kind, headers)
            watch.disarm()
            await respond(response)
    except asyncio.CancelledError:
        if watch.gone:  # the client left: its work was cancelled, there is no one to answer
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            log.info("client_disconnected", path=request.scope["path"])
            return
        raise
    finally:
        watch.disarm()


async def chat_completions(request: Request, respond: Respond) -> None:
    await completions(request, respond, "chat")


async def text_completions(request: Request, respond: Respond) -> None:
    await completions(request, respond, "completion")


async def list_models(request: Request) -> Response:
    svc = service_of(request)
    authenticate(svc, request)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "prefixgate"} for m in sorted(svc.models)]
    return ORJSONResponse({"object": "list", "data": data})


async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings``: checked here, answered by a worker that serves them
    (``gateway.core.embeddings``), its answer passed on as it gave it."""
    svc = service_of(request)
    ctx = svc.runner.enter(caller_of(request))
    body = await svc.runner.parse_body(await read_body(request, svc.settings.max_body_bytes))
    models = svc.models
    default = next(iter(models)) if len(models) == 1 else svc.settings.default_model
    req = parse_embeddings(body, default)
    if req.model not in models:
        raise NotFound(f"the model {req.model!r} does not exist", param="model", code="model_not_found")
    node, answer = await core_embeddings.embed(
        svc.pool.nodes, req, {**body, "model": req.model}, ctx.request_id, svc.settings.retry_max_attempts
    )
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0
    svc.usage.record(ctx.tenant, req.model, int(tokens) if isinstance(tokens, int) else 0, 0, 0)
    headers = {"x-prefixgate-request-id": ctx.request_id, "x-prefixgate-node": node.id}
    return ORJSONResponse(dict(answer), headers=headers)


async def openapi(request: Request) -> Response:
    from prefixgate.gateway.httpfront.openapi import openapi_spec

    return ORJSONResponse(openapi_spec(sorted(service_of(request).models)))


async def healthz(request: Request) -> Response:
    return ORJSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    svc = service_of(request)
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
    return await scrape(service_of(request))


async def documents_create(request: Request) -> Response:
    svc = service_of(request)
    tenant = tenant_of(svc, request)
    body = await svc.runner.parse_body(await read_body(request, svc.settings.max_body_bytes))
    text, doc_id = body.get("text"), body.get("id")
    if not isinstance(text, str) or not text:
        raise invalid("'text' must be a non-empty string", "text")
    if doc_id is not None:
        doc_id = document_id(doc_id, "id")
    doc_id = await svc.documents.put(tenant, text, doc_id)
    return ORJSONResponse({"id": doc_id, "object": "document", "bytes": len(text.encode())}, status_code=201)


async def documents_get(request: Request) -> Response:
    svc = service_of(request)
    tenant = tenant_of(svc, request)
    doc = await svc.documents.get(tenant, request.path_params["doc_id"])
    return ORJSONResponse({"id": doc.id, "object": "document", "text": doc.text})


async def documents_delete(request: Request) -> Response:
    svc = service_of(request)
    tenant = tenant_of(svc, request)
    doc_id = request.path_params["doc_id"]
    if not await svc.documents.delete(tenant, doc_id):
        raise NotFound(f"document {doc_id!r} not found", code="document_not_found")
    return ORJSONResponse({"id": doc_id, "object": "document", "deleted": True})


#: The client API's completion endpoints, by path (POST); ``gateway.httpfront.hotroutes`` dispatches them
#: ahead of Starlette.
COMPLETION_ENDPOINTS = {
    "/v1/chat/completions": Endpoint(chat_completions),
    "/v1/completions": Endpoint(text_completions),
}


def routes() -> list[Route]:
    return [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in COMPLETION_ENDPOINTS.items()),
        Route("/v1/models", guard(list_models), methods=["GET"]),
        Route("/v1/embeddings", guard(embeddings), methods=["POST"]),
        Route("/v1/documents", guard(documents_create), methods=["POST"]),
        Route("/v1/documents/{doc_id:str}", guard(documents_get), methods=["GET"]),
        Route("/v1/documents/{doc_id:str}", guard(documents_delete), methods=["DELETE"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", guard(readyz), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


async def _not_found(request: Request, exc: Exception) -> Response:
    return APIError(404, f"no route for {request.method} {request.url.path}", code="not_found").response()


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return APIError(
        405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed"
    ).response()


def create_app(service: GatewayService) -> Starlette:
    """The HTTP front end of ``service``. Its lifespan starts and stops the service, for an app
    run alone (tests); the gateway's process (``gateway.ops.server``) starts the service and the
    front ends side by side instead."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(
        routes=routes() + admin_routes() + smg_worker_routes(),
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed},
    )
    app.state.service = service
    return app
