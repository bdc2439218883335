"""The gRPC front end: ``prefixgate.v1.Gateway`` (Generate streams, Complete is unary).

A request is turned into the same OpenAI-shaped body the HTTP API takes, validated by the same
``parse_request`` and served by the same ``Pipeline.prepare``/``execute``; HTTP-style errors
become gRPC status codes (``STATUS_CODES``) with the same messages. Standard health and
reflection are served beside it. It runs in the gateway's event loop, started and stopped with
the HTTP app's lifespan, so one process serves both. A client that cancels cancels the work
(the handler task is cancelled and the node call with it).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import orjson
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.errors import APIError, invalid
from gateway.logging import bind_request
from gateway.pipeline import Execution, StreamBroken
from gateway.schema import ParsedRequest, parse_request
from gateway.service import GatewayService
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger("prefixgate.grpc")

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REQUEST_ID_KEYS = ("x-prefixgate-request-id", "x-request-id")
_MAX_MESSAGE = 64 * 1024 * 1024

STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(e: APIError) -> grpc.StatusCode:
    return STATUS_CODES.get(
        e.status, grpc.StatusCode.INTERNAL if e.status >= 500 else grpc.StatusCode.UNKNOWN
    )


def request_body(req: gateway_pb2.CompletionRequest) -> tuple[dict[str, Any], str]:
    """The OpenAI-shaped body and kind ("chat" when messages are given) of a gRPC request."""
    body: dict[str, Any] = {"model": req.model}
    if req.max_tokens:
        body["max_tokens"] = req.max_tokens
    if req.HasField("temperature"):
        body["temperature"] = round(req.temperature, 6)  # float32 on the wire
    if req.HasField("top_p"):
        body["top_p"] = round(req.top_p, 6)
    if req.HasField("seed"):
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.user:
        body["user"] = req.user
    if req.documents:
        body["documents"] = [{"id": d.id or None, "text": d.text} for d in req.documents]
    if req.document_ids:
        body["document_ids"] = list(req.document_ids)
    if req.tools_json:
        try:
            body["tools"] = orjson.loads(req.tools_json)
        except orjson.JSONDecodeError as e:
            raise invalid(f"'tools_json' is not valid JSON: {e}", "tools_json") from None
    if req.messages:
        body["messages"] = [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
            for m in req.messages
        ]
        return body, "chat"
    body["prompt"] = req.prompt
    return body, "completion"


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


def _request_id(md: dict[str, str]) -> str | None:
    for key in REQUEST_ID_KEYS:
        rid = md.get(key)
        if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
            return rid
    return None


def _usage(ex: Execution) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(
        prompt_tokens=ex.prompt_tokens, completion_tokens=ex.completion_tokens, cached_tokens=ex.cached_tokens
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Translates between ``prefixgate.v1.Gateway`` and the pipeline."""

    def __init__(self, svc: GatewayService) -> None:
        self.svc = svc

    def _tenant(self, md: dict[str, str], user: str) -> str:
        keys = self.svc.settings.api_key_map()
        if not keys:
            return user
        scheme, _, token = md.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send metadata 'authorization: Bearer <key>'")
        for key, tenant in keys.items():
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                return tenant
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def _parse(self, req: gateway_pb2.CompletionRequest) -> ParsedRequest:
        s = self.svc.settings
        body, kind = request_body(req)
        return parse_request(
            body,
            kind,
            models=self.svc.models,
            default_max_tokens=s.default_max_tokens,
            max_tokens_limit=s.max_tokens_limit,
            max_documents=s.max_documents,
        )

    async def _start(
        self, req: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext, rpc: str
    ) -> tuple[Execution, Callable[[], None]]:
        """Validate, admit and start the request; the caller must close it and call release."""
        svc = self.svc
        md = _metadata(context)
        rid = bind_request(_request_id(md), rpc=rpc)
        if svc.draining:
            raise APIError(503, "the gateway is shutting down", code="shutting_down", retry_after=1)
        parsed = self._parse(req)
        prep = svc.pipeline.prepare(parsed, self._tenant(md, parsed.user), rid)
        release = svc.pipeline.admit()
        try:
            ex = await svc.pipeline.execute(prep)
        except BaseException:
            release()
            raise
        if svc.settings.response_headers:
            await context.send_initial_metadata(tuple(ex.headers().items()))
        return ex, release

    async def _fail(self, context: grpc.aio.ServicerContext, e: APIError) -> None:
        log.info("request_failed", status=e.status, code=e.code, error=e.message[:200])
        trailer: list[tuple[str, str]] = []
        if e.code:
            trailer.append(("x-prefixgate-error-code", e.code))
        if e.retry_after is not None:
            trailer.append(("retry-after", str(max(1, round(e.retry_after)))))
        if trailer:
            context.set_trailing_metadata(tuple(trailer))
        message = f"{e.message} (param: {e.param})" if e.param else e.message
        await context.abort(status_of(e), message)

    async def Generate(
        self, request: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.CompletionChunk]:
        try:
            ex, release = await self._start(request, context, "Generate")
        except APIError as e:
            await self._fail(context, e)
            return
        try:
            first = True
            async for d in ex.stream():
                if not (d.text or d.finish_reason or first):
                    continue
                chunk = gateway_pb2.CompletionChunk(
                    id=ex.request_id, text=d.text, finish_reason=d.finish_reason
                )
                if first or d.finish_reason:
                    chunk.route = ex.route
                    chunk.prefill_node = ex.prefill_node.id if ex.prefill_node else ""
                    chunk.decode_node = ex.decode_node.id
                if d.finish_reason:
                    chunk.usage.CopyFrom(_usage(ex))
                first = False
                yield chunk
        except StreamBroken as e:
            await self._fail(
                context, APIError(502, f"generation failed after it started: {e}", code="stream_broken")
            )
        finally:
            await ex.close()
            release()

    async def Complete(
        self, request: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CompletionResponse:
        try:
            ex, release = await self._start(request, context, "Complete")
        except APIError as e:
            await self._fail(context, e)
            raise  # not reached: abort raises
        parts: list[str] = []
        try:
            async for d in ex.stream():
                parts.append(d.text)
        except StreamBroken as e:
            await self._fail(
                context, APIError(502, f"generation failed after it started: {e}", code="stream_broken")
            )
        finally:
            await ex.close()
            release()
        return gateway_pb2.CompletionResponse(
            id=ex.request_id,
            text="".join(parts),
            finish_reason=ex.finish_reason,
            usage=_usage(ex),
            route=ex.route,
            prefill_node=ex.prefill_node.id if ex.prefill_node else "",
            decode_node=ex.decode_node.id,
        )


class GrpcFront:
    """The gRPC server of one gateway: Gateway service, health and reflection."""

    def __init__(self, svc: GatewayService, host: str, port: int) -> None:
        self.svc = svc
        self.host = host
        self.port = port
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the port (a free one when ``port`` is 0)."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ]
        )
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(self.svc), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (GATEWAY_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        bound = int(server.add_insecure_port(self.address))
        if not bound:
            raise OSError(f"cannot bind the gRPC front end on {self.address}")
        self.port = bound
        await server.start()
        self._server = server
        for service in ("", GATEWAY_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("grpc_front_started", address=self.address)
        return bound

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        await self.health.enter_graceful_shutdown()
        await server.stop(grace)
        log.info("grpc_front_stopped", address=self.address)
