"""The gRPC front end: ``prefixgate.v1.Gateway`` (Generate streams, Complete is unary).

A request is turned into the same OpenAI-shaped body the HTTP API takes, validated by the same
``parse_request`` and served by the same request runner (``gateway.core.runner``) with the same
auth and limits (its largest message is the HTTP body limit); domain errors become gRPC status
codes (``STATUS_CODES``) with the same messages and codes (trailer
``x-prefixgate-error-code``). Standard health and reflection are served beside it. It runs in
the gateway's event loop, started and stopped by the process beside the HTTP front end
(``gateway.ops.server``), so one process serves both. A client that cancels cancels the work
(the handler task is cancelled and the node call with it).

Its connections are bounded as the HTTP front end's are, with the same settings where they
mean the same (``server_options``). On shutdown it stops accepting at once (``begin_stop``);
every call is tracked in the process's ``Inflight`` (``gateway.shutdown``), so a call still
running when the grace ends is cut with the HTTP front end's: it ends with UNAVAILABLE, the
same message and the error code ``shutting_down`` in its trailer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import grpc
import orjson
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixgate.gateway import tracing
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core import choices
from prefixgate.gateway.core.auth import valid_request_id
from prefixgate.gateway.core.choices import Choices
from prefixgate.gateway.core.errors import (
    Conflict,
    DeadlineExceeded,
    Draining,
    Forbidden,
    GatewayError,
    InvalidRequest,
    NotFound,
    Overloaded,
    QuotaExceeded,
    StreamBroken,
    TooLarge,
    Unauthenticated,
    Unavailable,
    invalid,
)
from prefixgate.gateway.core.pipeline import Execution, Prepared
from prefixgate.gateway.core.runner import Caller
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.connections import fd_bounded_connections
from prefixgate.gateway.httpfront.headers import execution_headers
from prefixgate.gateway.logging import bind_request
from prefixgate.gateway.scheduling.classes import PRIORITY_CLASS_HEADER, TTFT_SLO_HEADER
from prefixgate.gateway.shutdown import CUT_CODE, CUT_MESSAGE, Inflight, Tracked
from prefixgate.openai.schema import ParsedRequest, check_message_count, parse_request
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger("prefixgate.grpc")

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REQUEST_ID_KEYS = ("x-prefixgate-request-id", "x-request-id")
_SEND_LIMIT = 64 * 1024 * 1024  # answers are bounded by max_tokens; requests by max_body_bytes

# Domain errors to gRPC status codes: the one mapping of this front end (most specific first).
STATUS_CODES: tuple[tuple[type[GatewayError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (TooLarge, grpc.StatusCode.INVALID_ARGUMENT),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StreamBroken, grpc.StatusCode.UNAVAILABLE),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(s: Settings, share_port: bool = False) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: the HTTP front end's limits where they mean the
    same (docs/settings.md, gRPC server limits), and the gRPC ones. The port is bound alone (a
    second gateway on it fails to start) unless ``share_port``: gateway workers share it."""
    options = [
        ("grpc.max_send_message_length", _SEND_LIMIT),
        ("grpc.max_receive_message_length", s.max_body_bytes),
        ("grpc.max_metadata_size", s.max_header_bytes),
        ("grpc.max_allowed_incoming_connections", fd_bounded_connections(s.max_connections)),
        ("grpc.max_connection_idle_ms", _ms(s.keepalive_timeout_s)),
        ("grpc.server_handshake_timeout_ms", _ms(s.header_timeout_s)),
        ("grpc.max_concurrent_streams", s.grpc_max_concurrent_streams),
        ("grpc.keepalive_time_ms", _ms(s.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(s.grpc_keepalive_timeout_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", round(s.grpc_min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 1 if share_port else 0),
    ]
    if s.grpc_max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(s.grpc_max_connection_age_s)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(s.shutdown_grace_s)))
    return options


def _cut() -> GatewayError:
    """What a call cut by shutdown ends with: the HTTP front end's message and code."""
    return Draining(CUT_MESSAGE, code=CUT_CODE, retry_after=1)


def status_of(e: GatewayError) -> grpc.StatusCode:
    for cls, code in STATUS_CODES:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


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
    if req.HasField("priority"):
        body["priority"] = req.priority
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


def _traced(context: grpc.aio.ServicerContext, rpc: str) -> AbstractContextManager[None]:
    """The call's span (``gateway.tracing``), a child of the client's ``traceparent`` metadata."""
    return tracing.request(
        "prefixgate.request", _metadata(context), **{"rpc.system": "grpc", "rpc.method": rpc}
    )


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


def _usage(ex: Execution) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(
        prompt_tokens=ex.prompt_tokens, completion_tokens=ex.completion_tokens, cached_tokens=ex.cached_tokens
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Translates between ``prefixgate.v1.Gateway`` and the request runner."""

    def __init__(self, svc: GatewayService, inflight: Inflight) -> None:
        self.svc = svc
        self.inflight = inflight

    def _parse(self, req: gateway_pb2.CompletionRequest, *, stream: bool) -> ParsedRequest:
        """``stream``: the call streams its answer (Generate), so the nodes stream it too."""
        s = self.svc.settings
        check_message_count(len(req.messages), s.max_messages)  # before any per-message work
        body, kind = request_body(req)
        body["stream"] = stream
        return parse_request(
            body,
            kind,
            models=self.svc.models,
            default_max_tokens=s.default_max_tokens,
            max_tokens_limit=s.max_tokens_limit,
            max_documents=s.max_documents,
            max_messages=s.max_messages,
            max_content_parts=s.max_content_parts,
        )

    def _caller(self, context: grpc.aio.ServicerContext, rpc: str) -> Caller:
        md = _metadata(context)
        rid = bind_request(valid_request_id(*(md.get(k) for k in REQUEST_ID_KEYS)), rpc=rpc)
        return Caller(
            authorization=md.get("authorization", ""),
            request_id=rid,
            priority_class=md.get(PRIORITY_CLASS_HEADER, ""),
            ttft_slo_ms=md.get(TTFT_SLO_HEADER, ""),
        )

    async def _prepare(
        self, request: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext, rpc: str
    ) -> Prepared:
        """The runner's entry check, then the request prepared as the HTTP API prepares it."""
        runner = self.svc.runner
        entered = runner.enter(self._caller(context, rpc))
        _parsed, prep = await runner.prepare(
            lambda: self._parse(request, stream=rpc == "Generate"), entered.with_body(request.ByteSize())
        )
        if prep.tool_parser:  # parsed tool calls have no field in this API's answers
            raise invalid("tool calls are served on the HTTP API (/v1/chat/completions)", "tools_json")
        return prep

    def _run(self, prep: Prepared) -> AbstractAsyncContextManager[Choices]:
        return self.svc.runner.run(prep, choices.Generate(self.svc.pipeline))

    async def _headers(self, context: grpc.aio.ServicerContext, ch: Choices) -> None:
        if self.svc.settings.response_headers:
            await context.send_initial_metadata(tuple(execution_headers(ch.first).items()))

    async def _fail(self, context: grpc.aio.ServicerContext, e: GatewayError) -> None:
        log.info("request_failed", status=status_of(e).name, code=e.code, error=e.message[:200])
        trailer: list[tuple[str, str]] = [("x-prefixgate-error-code", e.code)]
        if e.retry_after is not None:
            trailer.append(("retry-after", str(max(1, round(e.retry_after)))))
        context.set_trailing_metadata(tuple(trailer))
        message = f"{e.message} (param: {e.param})" if e.param else e.message
        await context.abort(status_of(e), message)

    async def Generate(
        self, request: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.CompletionChunk]:
        with self.inflight.track("grpc") as call, _traced(context, "Generate"):
            try:
                async with self._run(await self._prepare(request, context, "Generate")) as ch:
                    await self._headers(context, ch)
                    ex = ch.first
                    first = True
                    async for _, d in ch.stream():
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
                            call.complete = True  # the last chunk: nothing left to cut
                        first = False
                        yield chunk
            except GatewayError as e:
                await self._fail(context, e)
            except asyncio.CancelledError:
                await self._cut_or_raise(context, call)

    async def Complete(
        self, request: gateway_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CompletionResponse:
        with self.inflight.track("grpc") as call, _traced(context, "Complete"):
            try:
                async with self._run(await self._prepare(request, context, "Complete")) as ch:
                    await self._headers(context, ch)
                    text = "".join([d.text async for _, d in ch.stream()])
                    ex = ch.first
                    return gateway_pb2.CompletionResponse(
                        id=ex.request_id,
                        text=text,
                        finish_reason=ex.finish_reason,
                        usage=_usage(ex),
                        route=ex.route,
                        prefill_node=ex.prefill_node.id if ex.prefill_node else "",
                        decode_node=ex.decode_node.id,
                    )
            except GatewayError as e:
                await self._fail(context, e)
                raise  # not reached: abort raises
            except asyncio.CancelledError:
                await self._cut_or_raise(context, call)
                raise  # not reached: abort raises

    async def _cut_or_raise(self, context: grpc.aio.ServicerContext, call: Tracked) -> None:
        """A call cancelled by the shutdown's cut ends with its status; any other cancellation
        (the client left, the server stopped) goes on."""
        if not call.resume_if_cut():
            raise asyncio.CancelledError
        await self._fail(context, _cut())


class GrpcFront:
    """The gRPC server of one gateway: Gateway service, health and reflection."""

    def __init__(
        self,
        svc: GatewayService,
        host: str,
        port: int,
        inflight: Inflight | None = None,
        share_port: bool = False,
    ) -> None:
        self.svc = svc
        self.share_port = share_port
        self.host = host
        self.port = port
        self.inflight = inflight if inflight is not None else Inflight()
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the port (a free one when ``port`` is 0)."""
        server = grpc.aio.server(options=server_options(self.svc.settings, self.share_port))
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(self.svc, self.inflight), server)
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

    def begin_stop(self, grace: float) -> None:
        """Stop accepting now (the listener closes, connections get GOAWAY, health turns
        NOT_SERVING); calls still running ``grace`` seconds later are cancelled by the server.
        The shutdown's cut (``Inflight.end_all``) comes before that and ends them with their
        status. Idempotent; ``stop`` waits for it."""
        if self._server is None or self._stopping is not None:
            return
        server = self._server
        self._stopping = asyncio.get_running_loop().create_task(self._stop(server, grace), name="grpc-stop")

    async def _stop(self, server: grpc.aio.Server, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await server.stop(grace)

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is None:
            return
        self.begin_stop(grace)
        assert self._stopping is not None
        await self._stopping
        self._server = None
        log.info("grpc_front_stopped", address=self.address)
