"""OpenTelemetry traces of requests, and W3C trace context carried into the engines.

Off unless an OTLP endpoint is configured through the standard variables
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_SDK_DISABLED``,
``OTEL_TRACES_EXPORTER=none``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_EXPORTER_OTLP_*_PROTOCOL`` / headers / timeout honoured by the
SDK and its exporters). Off, nothing of the SDK is loaded, and a client's ``traceparent`` is passed
to the engines unchanged, as an intermediary that takes no part should.

On, each request is one span (``prefixgate.request``, a child of the client's ``traceparent``
when it sent one) whose context goes to every engine the request reaches (HTTP header; gRPC
metadata, as smg sends it), so the engines' own spans join the trace; when the request ends its
stages are added as child spans from the times already measured for the request log line (queue,
prefill, KV transfer, first token: ``Accounting.finished``), with route, nodes and cached tokens
as attributes. The request's log line carries its ``trace_id``. docs/tracing.md.
"""

from __future__ import annotations

import contextvars
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import structlog

from prefixgate.gateway.logging import bind_fields

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = structlog.get_logger("prefixgate.tracing")

TRACEPARENT_KEY = "traceparent"
TRACESTATE_KEY = "tracestate"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
#: What the engines of this request are sent: ``((key, value), ...)``, empty when there is none.
CONTEXT: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "trace_context", default=()
)
_SPAN: contextvars.ContextVar[Span | None] = contextvars.ContextVar("request_span", default=None)
SHUTDOWN_TIMEOUT_MS = 2000


def trace_id_of(traceparent: str) -> str:
    """The trace id of a valid W3C ``traceparent`` ("" for anything else, never trusted as is)."""
    m = _TRACEPARENT.match(traceparent.strip().lower())
    return m.group(1) if m and m.group(1) != "0" * 32 else ""


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for traces to be exported."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """The SDK's tracer provider with a batching OTLP exporter (gRPC or HTTP, as configured)."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
        )
        exporter: Any
        if protocol.strip().lower() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            exporter = GrpcExporter()
        else:  # the specification's default, http/protobuf
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter()
        attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "prefixgate"}
        self.provider: TracerProvider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("prefixgate")
        self.propagator = TraceContextTextMapPropagator()
        # wall clock of a perf_counter reading: the stages are timed with perf_counter
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()

    def wall_ns(self, perf_s: float) -> int:
        return self._wall_offset_ns + int(perf_s * 1e9)

    def start(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> Span:
        """The request's span, its context the one the engines get (``CONTEXT``)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = self.propagator.extract(
            {k: v for k, v in headers.items() if k in (TRACEPARENT_KEY, TRACESTATE_KEY)}
        )
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes))
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        CONTEXT.set(tuple(carrier.items()))
        _SPAN.set(span)
        trace_id = format(span.get_span_context().trace_id, "032x")
        bind_fields(trace_id=trace_id)
        return span

    def close(self) -> None:
        """Export what is left (bounded), then stop."""
        try:
            self.provider.force_flush(SHUTDOWN_TIMEOUT_MS)
            self.provider.shutdown()
        except Exception as e:  # an unreachable collector must not hold the shutdown
            log.warning("tracing_shutdown_failed", error=repr(e)[:200])


_TRACING: Tracing | None = None


def configure(env: Mapping[str, str] = os.environ) -> Tracing | None:
    """Turn traces on when the environment asks for them (once per process)."""
    global _TRACING
    if _TRACING is None and enabled(env):
        _TRACING = Tracing(env)
        log.info("tracing_on", protocol=env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    return _TRACING


def shutdown() -> None:
    global _TRACING
    tracing, _TRACING = _TRACING, None
    if tracing is not None:
        tracing.close()


_UNTRACED = nullcontext()


def request(name: str, headers: Mapping[str, str], **attributes: Any) -> AbstractContextManager[None]:
    """One request (``with tracing.request(...)``): its span when tracing is on, else the client's
    trace context passed on, at once, and nothing to enter or leave (no generator to wrap)."""
    tracing = _TRACING
    if tracing is None:
        parent = headers.get(TRACEPARENT_KEY, "")
        trace_id = trace_id_of(parent) if parent else ""
        if trace_id:
            state = headers.get(TRACESTATE_KEY, "")
            CONTEXT.set(
                ((TRACEPARENT_KEY, parent.strip().lower()),) + (((TRACESTATE_KEY, state),) if state else ())
            )
            bind_fields(trace_id=trace_id)
        return _UNTRACED
    return _spanned(tracing, name, headers, attributes)


@contextmanager
def _spanned(
    tracing: Tracing, name: str, headers: Mapping[str, str], attributes: dict[str, Any]
) -> Iterator[None]:
    span = tracing.start(name, headers, attributes)
    try:
        yield
    except BaseException as e:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        span.end()


def received(traceparent: str, **fields: Any) -> str:
    """A node's side: the trace context a request came with, into every line of the request,
    and said once (the line an operator finds a request's engine work by); its trace id."""
    trace_id = trace_id_of(traceparent) if traceparent else ""
    if trace_id:
        structlog.contextvars.bind_contextvars(trace_id=trace_id)
        log.info("trace_context_received", traceparent=traceparent.strip().lower(), **fields)
    return trace_id


def active() -> bool:
    """Whether tracing is on: a request's span is then started from all of its headers (its
    propagators may read any), else only its ``traceparent`` and ``tracestate`` are passed on."""
    return _TRACING is not None


def recording() -> bool:
    """Whether this request's span records (tracing on, the request sampled): what a caller
    checks before it builds a span's arguments on the request path."""
    span = _SPAN.get()
    return _TRACING is not None and span is not None and span.is_recording()


def failed_attempt(start_s: float, attempt: int, node: str, stage: str, kind: str, detail: str) -> None:
    """A failed attempt (one that was retried, or the last one) as a child span of the request's,
    from ``start_s`` (perf_counter seconds) to now, its status the error."""
    tracing, span = _TRACING, _SPAN.get()
    if tracing is None or span is None or not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    attributes: dict[str, Any] = {
        "prefixgate.attempt": attempt,
        "prefixgate.node": node,
        "prefixgate.stage": stage,
        "prefixgate.failure": kind,
    }
    child = tracing.tracer.start_span(
        "prefixgate.attempt",
        context=set_span_in_context(span),
        start_time=tracing.wall_ns(start_s),
        attributes=attributes,
    )
    child.set_status(Status(StatusCode.ERROR, detail[:300]))
    child.end()


def stages(
    start_s: float,
    segments: Sequence[tuple[str, float]],
    attributes: Mapping[str, Any],
) -> None:
    """The request's stages as child spans of its span, laid end to end from ``start_s``
    (perf_counter seconds): ``segments`` are (name, seconds); ``attributes`` go on the request's
    span."""
    tracing, span = _TRACING, _SPAN.get()
    if tracing is None or span is None or not span.is_recording():
        return
    from opentelemetry.trace import set_span_in_context

    span.set_attributes(dict(attributes))
    context = set_span_in_context(span)
    at = start_s
    for name, seconds in segments:
        if seconds <= 0:
            continue
        child = tracing.tracer.start_span(name, context=context, start_time=tracing.wall_ns(at))
        at += seconds
        child.end(end_time=tracing.wall_ns(at))
