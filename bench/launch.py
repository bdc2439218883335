"""Processes for the live benchmarks: simulated nodes, a gateway, peer routers; their CPU time.

Every child is started by ``gateway.ops.processes`` (own process group, dies with the benchmark,
SIGTERM then SIGKILL on stop) on loopback, with its output in a log file under a run directory.

Peer routers are not dependencies of prefixgate: they are looked up in a directory of venvs
made by the commands in bench/README.md (``venv-smg``, ``venv-sglang``, ``venv-vllmr``, ``venv-litellm`` under
``--peers-venv``, default ``$PREFIXGATE_PEERS`` or ``$TMPDIR/prefixgate-peers``). Launch flags
follow their documented loopback-safe forms (explicit ``--host``/``--prometheus-host``
127.0.0.1, a 1 s shutdown grace for smg and sglang-router, a master key and the local price map for
LiteLLM).
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import prefixgate
from prefixgate.backends.engine import MAX_GROUP
from prefixgate.bench import floor
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "prefixgate-sim"


def run_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"prefixgate-{prefix}-"))


def spawn(
    name: str,
    cmd: Sequence[str],
    logs: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Child:
    """``cmd`` with its output in ``logs/NAME.log``."""
    return processes.start(name, cmd, env=env, cwd=cwd, log=logs / f"{name}.log")


# -- CPU time -------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields after the command name


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds."""
    f = _stat_fields(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK if f else 0.0


def store_pid(gateway: Child) -> int | None:
    """The pid of the store a gateway's workers share (its own process group), if it runs one."""
    m = gateway.find(r'"pid": ?(\d+)[^{}]*"event": ?"embedded_store_started"')
    return int(m.group(1)) if m else None


def router_cpu_seconds(router: Child) -> float:
    """CPU of a router: its process group, and the embedded store its workers share."""
    store = store_pid(router)
    return group_cpu_seconds(router.pid) + (cpu_seconds(store) if store else 0.0)


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in a process group."""
    total = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat_fields(int(d))
            if f and int(f[2]) == pgid:
                total += int(f[11]) + int(f[12])
    return total / CLK_TCK


def given_env() -> dict[str, str]:
    """This process's environment as the user gave it: without the ``GRPC_EXPERIMENTS`` that
    importing prefixgate set (``prefixgate/__init__.py``), so a baseline tree from before that
    setting runs as it did, and a newer one sets it again itself."""
    env = dict(os.environ)
    if prefixgate.GRPC_EXPERIMENTS_GIVEN is None:
        env.pop("GRPC_EXPERIMENTS", None)
    return env


# -- nodes ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeOptions:
    role: str = "monolithic"
    profile: str = "s5000"
    time_scale: float = 1.0
    capacity_blocks: int = 20_000
    block_size: int = 64
    kv_scale: str = "1/163840"  # one byte a token: monolithic nodes ship no KV, keep memory small
    max_queue: int = 256
    max_concurrency: int = 1
    max_decode_streams: int = 1024
    http: bool = True
    stream_interval: int = MAX_GROUP


def node_command(node_id: str, o: NodeOptions) -> list[str]:
    cmd = processes.prefixgate(
        "node",
        "--role",
        o.role,
        "--port",
        "0",
        "--node-id",
        node_id,
        "--profile",
        o.profile,
        "--time-scale",
        str(o.time_scale),
        "--capacity-blocks",
        str(o.capacity_blocks),
        "--block-size",
        str(o.block_size),
        "--kv-scale",
        o.kv_scale,
        "--max-queue",
        str(o.max_queue),
        "--max-concurrency",
        str(o.max_concurrency),
        "--max-decode-streams",
        str(o.max_decode_streams),
        "--stream-interval",
        str(o.stream_interval),
        "--log-level",
        "warning",
        "--ready-line",
    )
    return [*cmd, "--http-port", "0"] if o.http else cmd


def start_nodes(count: int, options: NodeOptions, logs: Path, timeout: float = 60.0) -> list[Child]:
    """``count`` nodes with gRPC and (``options.http``) HTTP on free loopback ports."""
    children = [spawn(f"node-{i + 1}", node_command(f"node-{i + 1}", options), logs) for i in range(count)]
    processes.wait_all(children, processes.printed(processes.NODE_READY), timeout)
    for c in children:
        line = processes.node_ready_line(c)
        c.address = line["address"]
        if "http_address" in line:
            c.url = f"http://{line['http_address']}"
    return children


# -- gateway --------------------------------------------------------------------------------------


def start_gateway(
    logs: Path,
    *,
    monolithic: Sequence[str] = (),
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
    policy: str = "prefixgate",
    name: str = "prefixgate",
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    python: str = sys.executable,
    extra_args: Sequence[str] = (),
    wrap: Sequence[str] = (),
) -> Child:
    """A gateway on a free loopback port; ``python`` is the interpreter it runs under (another
    checkout's venv runs that checkout's gateway); ``wrap`` comes before the command (a profiler)."""
    port = free_port()
    cmd = [
        *wrap,
        python,
        "-m",
        "prefixgate.cli",
        "gateway",
        "--port",
        str(port),
        "--policy",
        policy,
        *extra_args,
    ]
    for flag, addrs in (("--monolithic", monolithic), ("--prefill", prefill), ("--decode", decode)):
        for a in addrs:
            cmd += [flag, a]
    url = f"http://127.0.0.1:{port}"
    # ``python -m`` puts its working directory first on the path: run from a checkout, it would
    # import that checkout's prefixgate ahead of another tree's on PYTHONPATH (a baseline)
    tree = (env or {}).get("PYTHONPATH", "").split(os.pathsep)[0]
    child = processes.start(
        name,
        cmd,
        ready=processes.answers_http(url + "/readyz"),
        timeout=timeout,
        env={**given_env(), "PREFIXGATE_LOG_FORMAT": "json", **(env or {})},
        inherit_env=False,
        cwd=Path(tree) if tree else None,
        log=logs / f"{name}.log",
    )
    child.url = url
    return child


# -- peers ----------------------------------------------------------------------------------------

PEERS = ("smg", "sglang", "vllm", "litellm")
PEER_LABELS = {
    "smg": "smg cache_aware",
    "sglang": "sglang-router cache_aware",
    "vllm": "vllm-router cache_aware",
    "litellm": "LiteLLM simple-shuffle",
}
PEER_VERSIONS = {
    "smg": "smg==1.13.0",
    "sglang": "sglang-router==0.3.2",
    "vllm": "vllm-router==0.1.17",
    "litellm": "litellm[proxy]==1.108.7",
}
_VENVS = {"smg": "venv-smg", "sglang": "venv-sglang", "vllm": "venv-vllmr", "litellm": "venv-litellm"}
_BINARIES = {"smg": "bin/smg", "sglang": "bin/python", "vllm": "bin/vllm-router", "litellm": "bin/litellm"}


def default_peers_dir() -> Path:
    env = os.environ.get("PREFIXGATE_PEERS")
    if env:
        return Path(env)
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / "prefixgate-peers"


def peer_missing(name: str, venvs: Path) -> str:
    """Why peer ``name`` cannot run from ``venvs`` ("" when it can)."""
    if name not in _VENVS:
        return f"unknown peer {name!r} (choose from {', '.join(PEERS)})"
    exe = venvs / _VENVS[name] / _BINARIES[name]
    if not exe.exists():
        return f"not installed ({exe} missing; see README, Benchmarks)"
    if name == "sglang" and not any((venvs / _VENVS[name]).glob("lib/python*/site-packages/sglang_router")):
        return f"not installed (sglang_router missing in {venvs / _VENVS[name]})"
    return ""


def _litellm_config(workers: Sequence[str], path: Path) -> None:
    lines = ["model_list:"]
    for w in workers:
        lines += [
            f"  - model_name: {MODEL}",
            f'    litellm_params: {{model: openai/{MODEL}, api_base: "{w}/v1", api_key: "none", '
            "input_cost_per_token: 1.0e-9, output_cost_per_token: 1.0e-9}",
        ]
    lines += [
        "router_settings:",
        "  routing_strategy: simple-shuffle",
        "  num_retries: 0",
        "litellm_settings:",
        "  telemetry: false",
        "  drop_params: false",
        "  request_timeout: 600",
        "  set_verbose: false",
        "general_settings:",
        "  disable_spend_logs: true",
        "  disable_reset_budget: true",
    ]
    path.write_text("\n".join(lines) + "\n")


def start_floor(
    logs: Path,
    name: str,
    factory: str,
    node_url: str,
    *,
    timeout: float = 60.0,
    wrap: Sequence[str] = (),
) -> Child:
    """The floor or the essentials (``bench.floor``'s ``factory``) relaying to ``node_url`` on a
    free loopback port; ``wrap`` comes before the command (a profiler)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = processes.start(
        name,
        [*wrap, *floor.command(port, factory=factory)],
        ready=processes.answers_http(url + "/readyz"),
        timeout=timeout,
        env={floor.NODE_ENV: node_url},
        log=logs / f"{name}.log",
    )
    child.url = url
    return child


def start_peer(
    name: str,
    venvs: Path,
    workers: Sequence[str],
    logs: Path,
    timeout: float = 120.0,
    wrap: Sequence[str] = (),
) -> Child:
    """Start peer ``name`` in front of ``workers`` (node HTTP base URLs); wait for a routed request.
    ``wrap`` comes before the command (a profiler)."""
    venv = venvs / _VENVS[name]
    port, prom = free_port(), free_port()
    env: dict[str, str] = {}
    headers: dict[str, str] = {}
    cwd = None
    if name in ("smg", "sglang"):
        # smg launch takes sglang-router's flags (smg is its successor).
        launcher = (
            [str(venv / "bin/smg"), "launch"]
            if name == "smg"
            else [
                str(venv / "bin/python"),
                "-m",
                "sglang_router.launch_router",
            ]
        )
        cmd = [
            *launcher,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prom),
            "--shutdown-grace-period-secs",
            "1",
            "--log-level",
            "warn",
            "--policy",
            "cache_aware",
            "--worker-urls",
            *workers,
        ]
    elif name == "vllm":
        cmd = [
            str(venv / "bin/vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prom),
            "--log-level",
            "warning",
            "--policy",
            "cache_aware",
            "--worker-urls",
            *workers,
        ]
    else:
        cfg = logs / "litellm_config.yaml"
        _litellm_config(workers, cfg)
        key = "sk-local-" + secrets.token_hex(12)
        env = {"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        headers = {"authorization": f"Bearer {key}"}
        cwd = logs
        cmd = [
            str(venv / "bin/litellm"),
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
    url = f"http://127.0.0.1:{port}"
    cmd = [*wrap, *cmd]
    # up once a chat through it is answered: its workers are registered
    child = processes.start(
        name,
        cmd,
        ready=processes.routes_chat(url, MODEL, headers),
        timeout=timeout,
        env={**given_env(), **env},
        inherit_env=False,
        cwd=cwd,
        log=logs / f"{name}.log",
    )
    child.url, child.headers = url, headers
    return child
