"""A real Redis Cluster on loopback (3 masters, 3 replicas in a temp directory): what the
cluster tests run on and what ``prefixgate bench index --cluster`` measures.

Needs ``redis-server`` and ``redis-cli`` on the PATH; every node binds 127.0.0.1 only and runs
without persistence, so a node restarted comes back empty (its ``nodes.conf`` keeps its
identity and slots).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port

BUS_OFFSET = 10_000  # a cluster node's bus listens on its port + 10000


def start_redis(port: int, *args: str, timeout: float = 10.0) -> Child:
    """A redis-server on 127.0.0.1:``port`` without persistence (``args`` add to its config),
    through the one launcher; ready once it answers PING. Every test and benchmark Redis starts here."""

    def pong(_child: Child) -> bool:
        try:
            return bool(redis.Redis(port=port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return processes.start(f"redis-server :{port}", [*argv, *args], ready=pong, timeout=timeout)


class RedisClusterHarness:
    """A real Redis Cluster on loopback: 3 masters and 3 replicas in a temp directory.

    Fast failure detection (``cluster-node-timeout``) so a failover drill takes seconds.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters, self.replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            self.ports.append(self._new_port())
        self.procs: dict[int, Child] = {}
        self.dir = tempfile.mkdtemp(prefix="prefixgate-cluster-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisClusterHarness:
        try:
            for i, port in enumerate(self.ports):
                self.ports[i] = self._start_new_node(port)
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

    def _start_new_node(self, port: int, attempts: int = 3) -> int:
        """Start a node of the cluster being made on ``port``, or on another free pair if a
        process took one of its two ports first (Redis then exits: "Failed listening"); the
        port it listens on."""
        for _ in range(attempts - 1):
            try:
                self.start_node(port)
                return port
            except processes.StartFailed:
                port = self._new_port()
        self.start_node(port)
        return port

    def _new_port(self) -> int:
        """A free port pair no node of this cluster has."""
        port = free_port(pair_offset=BUS_OFFSET)
        while port in self.ports:
            port = free_port(pair_offset=BUS_OFFSET)
        return port

    def start_node(self, port: int) -> None:
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        self.procs[port] = start_redis(
            port,
            "--dir", node_dir,
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
        )  # fmt: skip

    def cli(self, port: int, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, timeout=10)
        return out.stdout.decode().strip()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and sees as many masters as it should."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p, proc in self.procs.items() if proc.alive()]
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
            seen_by = next(p for p, proc in self.procs.items() if proc.alive())
        out = []
        for line in self.cli(seen_by, "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                out.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(out)

    def replicas_of(self, master_port: int) -> list[int]:
        """Ports of the replicas that follow the master on ``master_port``."""
        seen_by = next(p for p, proc in self.procs.items() if proc.alive())
        rows = [line.split() for line in self.cli(seen_by, "cluster", "nodes").splitlines()]

        def port_of(fields: list[str]) -> int:
            return int(fields[1].split("@")[0].rsplit(":", 1)[1])

        master_id = next(f[0] for f in rows if port_of(f) == master_port)
        return sorted(port_of(f) for f in rows if "slave" in f[2] and f[3] == master_id)

    def restart(self, port: int) -> None:
        """Start a killed node again: same identity and slots (``nodes.conf``), no data."""
        self.start_node(port)

    def kill(self, port: int) -> None:
        self.procs.pop(port).stop(signal.SIGKILL)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
