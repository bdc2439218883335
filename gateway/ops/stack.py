"""``prefixgate up``: the whole local stack (simulated nodes + gateway) in one process tree."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

from prefixgate.gateway.config import Settings
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child

_HANDED_OUT: set[int] = set()
_HANDED_OUT_LIMIT = 4096


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that this process has not handed out before.

    The probe socket is closed before the child binds, so the kernel may offer the same port
    again to the next probe; a stack of several nodes started at once then gets one port twice.
    """
    if len(_HANDED_OUT) >= _HANDED_OUT_LIMIT:
        _HANDED_OUT.clear()
    for _ in range(64):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no fresh free port on {host} after 64 tries")


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
