"""Run the gateway under uvicorn (uvloop + httptools), with connection limits, the HTTP access
policy and a bounded shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Generator
from types import FrameType

import structlog
import uvicorn

from prefixgate.gateway.cluster.workers import tenancy_refusal
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import COMPLETION_ENDPOINTS, create_app
from prefixgate.gateway.httpfront.connections import (
    ConnectionLimits,
    fd_bounded_connections,
    limited_protocol,
)
from prefixgate.gateway.httpfront.guard import HttpGuard, Inflight
from prefixgate.gateway.httpfront.hotroutes import HotRoutes
from prefixgate.gateway.tokens.engine import TokenizerLoadError
from prefixgate.gateway.tokens.wiring import resolve_tokenizer

log = structlog.get_logger("prefixgate.server")

#: Exit status when the shutdown grace ended requests that were still running.
EXIT_WORK_CUT = 4  # uvicorn exits 3 when it cannot start
#: Time given to cut requests to write their last event and close, after the grace.
_CUT_MARGIN_S = 2.0


class GatewayServer(uvicorn.Server):
    """uvicorn without its own signal capture: the caller decides how a signal stops it, so a
    clean SIGTERM exits 0 instead of being re-raised at the end."""

    service: GatewayService | None = None
    inflight: Inflight | None = None
    shutdown_grace_s: float = 10.0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Stop accepting; in-flight requests and streams get ``shutdown_grace_s``."""
        if self.service is not None:
            self.service.draining = True  # /readyz turns 503 at once
        super().handle_exit(sig, frame)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, except that requests still running when the grace ends are ended
        by the guard (streams get an SSE error event) instead of being cancelled mid-write."""
        cut_timer = asyncio.get_running_loop().call_later(self.shutdown_grace_s, self._cut_open_work)
        try:
            await super().shutdown(sockets)
        finally:
            cut_timer.cancel()

    def _cut_open_work(self) -> None:
        if self.inflight is not None and len(self.inflight):
            cut = self.inflight.end_all()
            log.warning("shutdown_grace_ended", cut_requests=cut, grace_s=self.shutdown_grace_s)

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
        lifespan="on",
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


async def serve(settings: Settings) -> int:
    """Serve until a signal; the exit status (``EXIT_WORK_CUT`` if the grace cut requests; 2 when
    the workers' tokenizer cannot be had or the tenants cannot be kept apart, said in one line)."""
    refusal = tenancy_refusal(settings)
    if refusal:
        print(f"prefixgate gateway: {refusal}", file=sys.stderr, flush=True)
        return 2
    try:
        settings = await resolve_tokenizer(settings)
    except TokenizerLoadError as e:
        print(f"prefixgate gateway: {e}", file=sys.stderr, flush=True)
        return 2
    server, _ = make_server(settings)
    server.install_signal_handlers()
    await server.serve()
    return EXIT_WORK_CUT if server.work_cut else 0


def run(settings: Settings) -> int:
    try:
        import uvloop

        return uvloop.run(serve(settings))
    except ImportError:  # pragma: no cover
        return asyncio.run(serve(settings))
