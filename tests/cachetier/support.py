"""Test support for the Redis index: where Redis is, private key prefixes, a loopback TCP proxy,
private redis-servers and a private Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import uuid

import pytest

from prefixgate.bench.redis_cluster import RedisClusterHarness, start_redis
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port as _free_port

__all__ = ["PrivateRedis", "RedisClusterHarness", "TcpProxy", "redis_url", "test_prefix"]

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"


def redis_url() -> str:
    """The test Redis; skipped only off CI when it is unreachable (CI must have it)."""
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            s.settimeout(1.0)
            if s.recv(16).startswith(b"+PONG"):
                return REDIS_URL
    except OSError:
        pass
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"Redis at {REDIS_HOST}:{REDIS_PORT} is unreachable and CI is set")
    pytest.skip(f"Redis at {REDIS_HOST}:{REDIS_PORT} is unreachable")


def test_prefix() -> str:
    return f"prefixgate-test-{uuid.uuid4().hex[:12]}:"


test_prefix.__test__ = False  # type: ignore[attr-defined]


class TcpProxy:
    """Forwards 127.0.0.1:<port> to Redis; can refuse, black-hole, or forward again.

    Lets a test cut the index off from Redis without touching the shared Redis itself.
    """

    def __init__(self, target: tuple[str, int] = (REDIS_HOST, REDIS_PORT)) -> None:
        self.target = target
        self.port = 0
        self.blackhole = False
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Close the listener and every open connection (the port then refuses)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        for t in list(self._pumps):
            t.cancel()
        for t in list(self._pumps):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))
        for src, dst in ((reader, up_w), (up_r, writer)):
            t = asyncio.get_running_loop().create_task(self._pump(src, dst))
            self._pumps.add(t)
            t.add_done_callback(self._pumps.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                if self.blackhole:
                    continue  # swallow: the peer sees a server that stopped answering
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.close()
            self._writers.discard(dst)


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port: restartable, configurable.

    No persistence, so a restart loses every key, as a restart of a cache usually does.
    """

    def __init__(self, *args: str, port: int = 0) -> None:
        self.args = list(args)
        self.port = port or _free_port()
        self.proc: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.proc = start_redis(self.port, *self.args)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(signal.SIGKILL)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, timeout=10)
        return out.stdout.decode().strip()
