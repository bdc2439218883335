"""Run the gateway under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Generator

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.service import GatewayService


class GatewayServer(uvicorn.Server):
    """uvicorn without its own signal capture: the caller decides how a signal stops it, so a
    clean SIGTERM exits 0 instead of being re-raised at the end."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

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
    return GatewayServer(config), svc


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
