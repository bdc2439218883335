"""Run the gateway under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Generator
from types import FrameType

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.service import GatewayService


class GatewayServer(uvicorn.Server):
    """uvicorn without its own signal capture: the caller decides how a signal stops it, so a
    clean SIGTERM exits 0 instead of being re-raised at the end."""

    service: GatewayService | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Stop accepting; in-flight requests and streams get ``timeout_graceful_shutdown``."""
        if self.service is not None:
            self.service.draining = True  # /readyz turns 503 at once
        super().handle_exit(sig, frame)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)


def make_server(
    settings: Settings, service: GatewayService | None = None, sock: socket.socket | None = None
) -> tuple[GatewayServer, GatewayService]:
    svc = service or GatewayService(settings)
    config = uvicorn.Config(
        create_app(svc),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=10,
        limit_concurrency=None,
        backlog=2048,
    )
    server = GatewayServer(config)
    server.service = svc
    return server, svc


async def serve(settings: Settings) -> None:
    server, _ = make_server(settings)
    server.install_signal_handlers()
    await server.serve()


def run(settings: Settings) -> None:
    try:
        import uvloop

        uvloop.run(serve(settings))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(settings))
