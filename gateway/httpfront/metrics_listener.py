"""A listener of its own for ``/metrics`` (``prometheus_port``, smg's ``--prometheus-port``).

It serves the same exposition as ``/metrics`` on the main port, behind the same metrics token,
and nothing else (404). It runs in the gateway's process and loop, started and stopped with the
gateway (``gateway.ops.server``): a scraper pointed at smg's metrics port keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.guard import HttpGuard
from prefixgate.openai.errors import APIError

log = structlog.get_logger("prefixgate.metrics")


async def scrape(svc: GatewayService) -> Response:
    """The Prometheus exposition; index occupancy is read at scrape time (a slow or absent index
    leaves the last values)."""
    try:
        svc.metrics.refresh_index(await asyncio.wait_for(svc.index.stats(), 1.0))
    except Exception as e:
        log.warning("index_stats_failed", error=repr(e)[:200])
    svc.metrics.refresh_tokenizers(svc.tokenizer_cache_bytes())
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class _QuietServer(uvicorn.Server):
    """uvicorn leaving signals to the gateway's own server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class MetricsListener:
    def __init__(self, svc: GatewayService, host: str, port: int) -> None:
        self.svc = svc
        self.host = host
        self.port = port
        self._server: _QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind (an address in use fails here, before the gateway reports ready) and serve."""
        svc = self.svc

        async def metrics(request: Request) -> Response:
            return await scrape(svc)

        async def not_found(request: Request, exc: Exception) -> Response:
            return APIError(
                404, f"only /metrics is served here, not {request.url.path}", code="not_found"
            ).response()

        app = Starlette(
            routes=[Route("/metrics", metrics, methods=["GET"])], exception_handlers={404: not_found}
        )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"prometheus listener: cannot bind {self.host}:{self.port}: {e.strerror}") from None
        config = uvicorn.Config(
            HttpGuard(app, svc.settings),
            loop="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=max(1, round(svc.settings.keepalive_timeout_s)),
            timeout_graceful_shutdown=1,
        )
        self._server = _QuietServer(config)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="prometheus-listener")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()
        log.info("prometheus_listener_started", address=f"{self.host}:{self.port}", path="/metrics")

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, 5.0)
