"""Run the gateway: one service, and its front ends side by side around it in one process and
loop: HTTP under uvicorn (uvloop + httptools, with connection limits, the HTTP access policy and
a bounded shutdown), the gRPC front end and the metrics listener when their ports are set.

Shutdown (docs/faults.md): a signal stops both front ends accepting; requests still open on
either after ``shutdown_grace_s`` are cut (``gateway.shutdown.Inflight``), which makes the exit
status ``EXIT_WORK_CUT``; then every part closes as a logged, bounded ``shutdown_stage``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from functools import partial
from types import FrameType
from typing import Any

import structlog
import uvicorn

from prefixgate.cachetier.replicated import WorkerSlot
from prefixgate.gateway import shutdown, tracing
from prefixgate.gateway.cluster.workers import tenancy_refusal
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.grpcfront.servicer import GrpcFront
from prefixgate.gateway.httpfront.app import COMPLETION_ENDPOINTS, create_app
from prefixgate.gateway.httpfront.connections import (
    ConnectionLimits,
    fd_bounded_connections,
    limited_protocol,
)
from prefixgate.gateway.httpfront.guard import HttpGuard
from prefixgate.gateway.httpfront.hotroutes import HotRoutes
from prefixgate.gateway.httpfront.metrics_listener import MetricsListener
from prefixgate.gateway.shutdown import Inflight
from prefixgate.gateway.tokens.engine import TokenizerLoadError
from prefixgate.gateway.tokens.wiring import resolve_tokenizer

log = structlog.get_logger("prefixgate.server")

#: Exit status when the shutdown grace ended requests that were still running.
EXIT_WORK_CUT = 4
EXIT_STARTUP_FAILED = 3  # as uvicorn's own startup failure
#: Time given to cut requests to write their last event and close, after the grace.
_CUT_MARGIN_S = 2.0


@contextlib.asynccontextmanager
async def side_fronts(
    service: GatewayService, inflight: Inflight | None = None, share_port: bool = False
) -> AsyncIterator[GrpcFront | None]:
    """The service started, then the gRPC front end (its calls tracked in ``inflight`` with the
    HTTP front end's requests; its port shared with the other gateway workers when
    ``share_port``) and the metrics listener beside the HTTP one (which runs inside); on exit
    they stop, then the service, each a logged ``shutdown_stage``."""
    settings = service.settings
    await service.start()
    grpc_front = None
    prometheus = None
    try:
        if settings.grpc_port:
            grpc_front = GrpcFront(service, settings.host, settings.grpc_port, inflight, share_port)
            await grpc_front.start()
        if settings.prometheus_port:
            prometheus = MetricsListener(
                service, settings.prometheus_host or settings.host, settings.prometheus_port
            )
            await prometheus.start()
        yield grpc_front
    finally:
        t0 = time.monotonic()
        if grpc_front is not None:  # begun at the signal already: this waits for its calls
            grace = settings.shutdown_grace_s + _CUT_MARGIN_S
            await shutdown.stage("grpc", partial(grpc_front.stop, grace), grace + _CUT_MARGIN_S)
        if prometheus is not None:
            await shutdown.stage("metrics_listener", prometheus.stop, 2.0)
        await service.stop()
        log.info("shutdown_done", seconds=round(time.monotonic() - t0, 3))


class GatewayServer(uvicorn.Server):
    """uvicorn serving the HTTP front end between the start and the stop of the service and
    the other front ends (``side_fronts``), without its own signal capture: the caller decides
    how a signal stops it, so a clean SIGTERM exits 0 instead of being re-raised at the end.

    A signal stops both front ends accepting at once; ``shutdown_grace_s`` later the requests
    still open on either are cut (``gateway.shutdown``)."""

    service: GatewayService | None = None
    inflight: Inflight | None = None
    grpc_front: GrpcFront | None = None
    shutdown_grace_s: float = 10.0
    _cut_timer: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        assert self.service is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    self.grpc_front = await stack.enter_async_context(  # handed sockets: a worker
                        side_fronts(self.service, self.inflight, share_port=sockets is not None)
                    )
                except Exception:  # as uvicorn answers an app whose startup failed
                    logging.getLogger("uvicorn.error").exception("Application startup failed. Exiting.")
                    sys.exit(EXIT_STARTUP_FAILED)
                await super().serve(sockets)
        finally:
            if self._cut_timer is not None:
                self._cut_timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Stop accepting on both front ends; in-flight requests and streams get ``shutdown_grace_s``."""
        if self.service is not None:
            self.service.draining = True  # /readyz turns 503 at once
        if self._cut_timer is None:
            loop = asyncio.get_running_loop()
            self._cut_timer = loop.call_later(self.shutdown_grace_s, self._cut_open_work)
            log.info("shutdown_started", signal=signal.Signals(sig).name, grace_s=self.shutdown_grace_s)
            if self.grpc_front is not None:
                self.grpc_front.begin_stop(self.shutdown_grace_s + _CUT_MARGIN_S)
        super().handle_exit(sig, frame)

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, except that requests still running when the grace ends are ended
        by the guard (streams get an SSE error event) instead of being cancelled mid-write."""
        t0 = time.monotonic()
        outcome = "ok"
        try:
            await super().shutdown(sockets)
        except BaseException:
            outcome = "error"
            raise
        finally:
            log.info("shutdown_stage", stage="http", seconds=round(time.monotonic() - t0, 3), outcome=outcome)

    def _cut_open_work(self) -> None:
        if self.inflight is not None and len(self.inflight):
            cut = self.inflight.end_all()
            log.warning(
                "shutdown_grace_ended",
                cut_requests=cut,
                grace_s=self.shutdown_grace_s,
                **{f"cut_{front}": n for front, n in sorted(self.inflight.cut_by_front.items())},
            )

    @property
    def work_cut(self) -> int:
        return self.inflight.cut if self.inflight is not None else 0


def connection_limits(settings: Settings) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_connections=fd_bounded_connections(settings.max_connections),
    )


def make_server(
    settings: Settings, service: GatewayService | None = None, sock: socket.socket | None = None
) -> tuple[GatewayServer, GatewayService]:
    svc = service or GatewayService(settings)
    inflight = Inflight()
    config = uvicorn.Config(
        HttpGuard(HotRoutes(create_app(svc), COMPLETION_ENDPOINTS), settings, inflight),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=limited_protocol(connection_limits(settings)),
        lifespan="off",  # the server starts and stops the service itself (``side_fronts``)
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # the guard applies the proxy policy (gateway.http_guard)
        timeout_keep_alive=max(1, round(settings.keepalive_timeout_s)),
        timeout_graceful_shutdown=max(0, round(settings.shutdown_grace_s + _CUT_MARGIN_S)),
        limit_concurrency=None,
        backlog=2048,
    )
    server = GatewayServer(config)
    server.service = svc
    server.inflight = inflight
    server.shutdown_grace_s = settings.shutdown_grace_s
    return server, svc


async def prepared(settings: Settings) -> Settings | int:
    """The settings with the workers' tokenizer resolved, or the exit status 2 after saying in
    one line why not (the tokenizer cannot be had, the tenants cannot be kept apart)."""
    refusal = tenancy_refusal(settings)
    if refusal:
        print(f"prefixgate gateway: {refusal}", file=sys.stderr, flush=True)
        return 2
    try:
        return await resolve_tokenizer(settings)
    except TokenizerLoadError as e:
        print(f"prefixgate gateway: {e}", file=sys.stderr, flush=True)
        return 2


async def serve(
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    on_ready: Callable[[], None] | None = None,
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
    writes_node_events: bool = True,
    replicated_index: WorkerSlot | None = None,
) -> int:
    """Serve until a signal; the exit status (``EXIT_WORK_CUT`` if the grace cut requests; 2 as
    ``prepared`` says). A gateway worker serves ``sockets`` (the listener its supervisor bound),
    stops on SIGTERM alone (Ctrl-C is the supervisor's) and calls ``on_ready`` once it serves.
    On its supervisor's store it routes on an index of its own that its siblings keep the same
    (``replicated_index``: its place among them); on a user's Redis all but one leave writing
    the nodes' KV events to the shared index to that one (``writes_node_events``)."""
    ready = await prepared(settings)
    if isinstance(ready, int):
        return ready
    tracing.configure()  # OpenTelemetry traces when the OTEL_* variables name an endpoint
    service = GatewayService(ready, writes_node_events=writes_node_events, replicated_index=replicated_index)
    server, _ = make_server(ready, service)
    server.install_signal_handlers(signals)
    serving = asyncio.ensure_future(server.serve(sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        # What the start made (tokenizers, templates, routes, metrics: some 75,000 objects with
        # a model's tokenizer) lives as long as the gateway. Frozen, a full collection no longer
        # walks it: one took 36 ms of the two-core benchmark machine, every request waiting.
        gc.freeze()
        if on_ready is not None:
            on_ready()
    await serving
    await shutdown.end_leftovers()
    await asyncio.to_thread(tracing.shutdown)  # the spans left are exported (bounded)
    return EXIT_WORK_CUT if server.work_cut else 0


#: How long a thread holding the GIL keeps it while another waits (CPython's default is 5 ms).
#: A render thread's Python (chat template, segment cuts, hashing of a long prompt) would make
#: the event loop wait that long at each turn, several turns a request.
GIL_SWITCH_INTERVAL_S = 0.001


def run(settings: Settings, main: Callable[[], Coroutine[Any, Any, int]] | None = None) -> int:
    """``serve`` (or ``main``) on uvloop; the loop's own teardown (cancelling the tasks left,
    the executor) is the last ``shutdown_stage``."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    runner = asyncio.Runner(loop_factory=factory)
    try:
        return runner.run(main() if main is not None else serve(settings))
    finally:
        t0 = time.monotonic()
        runner.close()
        log.info("shutdown_stage", stage="loop", seconds=round(time.monotonic() - t0, 3), outcome="ok")
