"""Run the gateway under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.service import GatewayService


def make_server(
    settings: Settings, service: GatewayService | None = None, sock: socket.socket | None = None
) -> tuple[uvicorn.Server, GatewayService]:
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
    return uvicorn.Server(config), svc


async def serve(settings: Settings) -> None:
    server, _ = make_server(settings)
    await server.serve()


def run(settings: Settings) -> None:
    try:
        import uvloop

        uvloop.run(serve(settings))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(settings))
