"""``prefixgate up``: the whole local stack (simulated nodes + gateway) in one process tree."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prefixgate.gateway.config import Settings
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child

#: The lowest port handed out (``port_range``): above the registered ports of common services.
LOWEST_PORT = 20_000
#: A port handed out is not handed out again, by any process of this user, for this long: the
#: child it was meant for binds it well within that.
HOLD_S = 120.0
_REGISTRY = Path(tempfile.gettempdir()) / f"prefixgate-ports-{os.getuid()}"


def port_range(pair_offset: int = 0) -> range:
    """The ports ``free_port`` picks from: below the kernel's ephemeral range (with ``pair_offset``
    ports to spare above each), where the kernel never picks a port for a connection; one taken
    so between its probe and its child's bind fails the start. Where that leaves fewer than
    1,000, every port above ``LOWEST_PORT``."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low - pair_offset - LOWEST_PORT >= 1_000:
        return range(LOWEST_PORT, ephemeral_low - pair_offset)
    return range(LOWEST_PORT, 65_536 - pair_offset)


@contextmanager
def _handed_out() -> Iterator[dict[int, float]]:
    """The ports handed out in the last ``HOLD_S`` by any process of this user (the port ->
    when), under an exclusive lock, written back on leaving. Processes that start children on
    ports they chose (a test run's workers, a stack and its nodes) otherwise may choose one port
    twice: the port is free until its first child binds it, and the second child then finds the
    first one's server there. Without a writable registry: this process's own choices."""
    try:
        fd = os.open(_REGISTRY, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield _LOCAL
        return
    with os.fdopen(fd, "r+b", buffering=0) as f:  # unbuffered: a failed write fails here
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            lines = f.read().decode("ascii", "replace").split("\n")
        except OSError:  # a file system without locks: no registry
            yield _LOCAL
            return
        now = time.time()
        held: dict[int, float] = {}
        for line in lines:
            port, _, at = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(at) < HOLD_S:
                    held[int(port)] = float(at)
        yield held
        with contextlib.suppress(OSError):  # a full disk costs the registry, not the port
            f.seek(0)
            f.truncate()
            f.write("".join(f"{port} {at}\n" for port, at in held.items()).encode())


_LOCAL: dict[int, float] = {}


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    try:
        with socket.socket(family) as s:
            s.bind((host, port))
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1", *, pair_offset: int = 0) -> int:
    """A port free now (with ``port + pair_offset`` free too, when given: a Redis Cluster node's
    bus) from ``port_range``, that no process of this user was handed in the last ``HOLD_S``.

    The probe socket is closed before the child binds: what keeps the port free meanwhile is its
    range (no connection takes it) and the registry (no other chooser takes it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports = port_range(pair_offset)
    rng = random.Random()
    with _handed_out() as held:
        now = time.time()
        for stale in [p for p, at in _LOCAL.items() if now - at >= HOLD_S]:
            del _LOCAL[stale]
        for _ in range(256):
            port = rng.choice(ports)
            if port in held or port in _LOCAL:
                continue
            if _bindable(family, host, port) and (
                not pair_offset or _bindable(family, host, port + pair_offset)
            ):
                held[port] = _LOCAL[port] = now
                return port
    raise OSError(f"no free port on {host} in {ports.start}..{ports.stop - 1} after 256 tries")


@dataclass
class NodeProcess:
    role: str
    node_id: str
    address: str
    child: Child
    bootstrap_port: int = 0  # a prefill node's SGLang bootstrap port (protocol "smg")


@dataclass
class StackOptions:
    host: str = "127.0.0.1"
    prefill: int = 2
    decode: int = 4
    engine: str = "sim"
    time_scale: float = 1.0
    capacity_blocks: int = 0  # 0: the node's default
    kv_scale: float = 0.0  # 0: the node's default
    block_size: int = 64
    prefill_profile: str = ""
    decode_profile: str = ""
    extra_node_args: list[str] = field(default_factory=list)
    # "prefixgate": our own node protocol; "smg": the SMG engine protocol (grpc:// workers, as
    # SGLang nodes, PD through a bootstrap port on each prefill node)
    protocol: str = "prefixgate"


def node_host(gateway_host: str) -> str:
    """Nodes speak unauthenticated gRPC: they listen on loopback whatever the gateway binds."""
    return "::1" if ":" in gateway_host else "127.0.0.1"


def node_command(role: str, node_id: str, port: int, opts: StackOptions) -> list[str]:
    cmd = processes.prefixgate(
        "node",
        "--role",
        role,
        "--host",
        node_host(opts.host),
        "--port",
        str(port),
        "--node-id",
        node_id,
        "--engine",
        opts.engine,
        "--time-scale",
        str(opts.time_scale),
        "--block-size",
        str(opts.block_size),
        "--ready-line",
    )
    profile = opts.prefill_profile if role == "prefill" else opts.decode_profile
    if profile:
        cmd += ["--profile", profile]
    if opts.capacity_blocks:
        cmd += ["--capacity-blocks", str(opts.capacity_blocks)]
    if opts.kv_scale:
        cmd += ["--kv-scale", str(opts.kv_scale)]
    return cmd + opts.extra_node_args


def start_nodes(opts: StackOptions, timeout: float = 30.0) -> list[NodeProcess]:
    """Every node started at once, then awaited (its ready line: its ports are bound); their
    output goes on to this process's stderr, as it would with the nodes run by hand."""
    nodes: list[NodeProcess] = []
    try:
        for role, count in (("prefill", opts.prefill), ("decode", opts.decode)):
            for i in range(1, count + 1):
                node_address = node_host(opts.host)
                port = free_port(node_address)
                node_id = f"{role}-{i}"
                cmd = node_command(role, node_id, port, opts)
                bootstrap = free_port(node_address) if opts.protocol == "smg" and role == "prefill" else 0
                if bootstrap:
                    cmd += ["--bootstrap-port", str(bootstrap)]
                child = processes.start(node_id, cmd, echo=True)
                host = f"[{node_address}]" if ":" in node_address else node_address
                scheme = "grpc://" if opts.protocol == "smg" else ""
                nodes.append(NodeProcess(role, node_id, f"{scheme}{host}:{port}", child, bootstrap))
    except BaseException:
        stop_nodes(nodes)
        raise
    processes.wait_all([n.child for n in nodes], processes.printed(processes.NODE_READY), timeout)
    return nodes


def stop_nodes(nodes: list[NodeProcess], grace: float = 5.0) -> None:
    processes.stop_all([n.child for n in nodes], grace=grace)


def use_smg_workers(settings: Settings, nodes: list[NodeProcess]) -> None:
    """Our nodes as grpc:// workers: their bootstrap ports, and the tokenizer they ship (token
    ids are the engine's on that protocol; the gateway tokenizes and detokenizes with it)."""
    from prefixgate.backends.hftok import TOKENIZER_DIR

    settings.bootstrap_ports = [f"{n.address}={n.bootstrap_port}" for n in nodes if n.bootstrap_port]
    if not settings.tokenizer and not settings.tokenizer_path:
        settings.tokenizer_path = str(TOKENIZER_DIR)


def _ready_lines(settings: Settings, nodes: list[NodeProcess], elapsed: float) -> None:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    extra = f" (gRPC front end on {host}:{settings.grpc_port})" if settings.grpc_port else ""
    print(f"prefixgate ready in {elapsed:.2f}s: http://{host}:{settings.port}/v1{extra}", flush=True)
    print("  nodes: " + ", ".join(f"{n.node_id}={n.address}" for n in nodes), flush=True)


def _stack_settings(settings: Settings, opts: StackOptions, nodes: list[NodeProcess]) -> None:
    settings.prefill = [n.address for n in nodes if n.role == "prefill"]
    settings.decode = [n.address for n in nodes if n.role == "decode"]
    if opts.protocol == "smg":
        use_smg_workers(settings, nodes)
    if settings.grpc_port == 0:  # the local stack always serves the gRPC front end too
        settings.grpc_port = free_port(settings.host)


def run_stack_workers(settings: Settings, opts: StackOptions) -> int:
    """The stack with its gateway as several workers (``gateway.ops.supervisor``)."""
    from prefixgate.gateway.ops.supervisor import run_workers, worker_count

    t0 = time.perf_counter()
    nodes = start_nodes(opts)
    try:
        _stack_settings(settings, opts, nodes)

        def ready(port: int) -> None:
            settings.port = port
            _ready_lines(settings, nodes, time.perf_counter() - t0)
            print(f"  gateway workers: {worker_count(settings)}", flush=True)

        return run_workers(settings, ready)
    finally:
        stop_nodes(nodes)


async def run_stack(settings: Settings, opts: StackOptions) -> int:
    from prefixgate.gateway import shutdown, tracing
    from prefixgate.gateway.ops.server import EXIT_WORK_CUT, make_server

    t0 = time.perf_counter()
    nodes = start_nodes(opts)
    try:
        _stack_settings(settings, opts, nodes)
        if settings.port == 0:
            settings.port = free_port(settings.host)
        tracing.configure()  # OpenTelemetry traces when the OTEL_* variables name an endpoint
        server, _svc = make_server(settings)
        server.install_signal_handlers()
        serve_task = asyncio.create_task(server.serve())
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.02)
        if serve_task.done():
            return 1
        _ready_lines(settings, nodes, time.perf_counter() - t0)
        await serve_task
        await shutdown.end_leftovers()
        await asyncio.to_thread(tracing.shutdown)
        return EXIT_WORK_CUT if server.work_cut else 0
    finally:
        stop_nodes(nodes)
