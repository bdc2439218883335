"""Test support for the Redis index: where Redis is, private key prefixes, a loopback TCP proxy,
private redis-servers and a private Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

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
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_pong(self.port, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, timeout=10)
        return out.stdout.decode().strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 50000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_pong(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, timeout=5)
        if ping.stdout.strip() == b"PONG":
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


class RedisClusterHarness:
    """A real Redis Cluster on loopback: 3 masters and 3 replicas in a temp directory.

    Fast failure detection (``cluster-node-timeout``) so a failover drill takes seconds.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters, self.replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            port = _free_cluster_port()
            if port not in self.ports:
                self.ports.append(port)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.dir = tempfile.mkdtemp(prefix="prefixgate-cluster-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisClusterHarness:
        try:
            for port in self.ports:
                self.start_node(port)
            subprocess.run(
                ["redis-cli", "--cluster", "create"]
                + [f"127.0.0.1:{p}" for p in self.ports]
                + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True,
                timeout=60,
                check=True,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, port: int) -> None:
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", node_dir,
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "",
                "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.procs[port] = proc
        wait_pong(port, proc)

    def cli(self, port: int, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, timeout=10)
        return out.stdout.decode().strip()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and sees as many masters as it should."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            if all(self._ok(p) for p in live):
                return
            time.sleep(0.1)
        raise TimeoutError("Redis Cluster not ok: " + self.cli(self.ports[0], "cluster", "nodes"))

    def _ok(self, port: int) -> bool:
        state_ok = "cluster_state:ok" in self.cli(port, "cluster", "info")
        return state_ok and len(self.master_ports(port)) >= self.masters

    def master_ports(self, seen_by: int = 0) -> list[int]:
        """Masters not marked failed, as the node on port ``seen_by`` (any live one) sees them."""
        if not seen_by:
            seen_by = next(p for p, proc in self.procs.items() if proc.poll() is None)
        out = []
        for line in self.cli(seen_by, "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                out.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(out)

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
