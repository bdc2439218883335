"""The ``prefixgate`` command: up, gateway, node, bench, admin.

The composition root: the one module that reaches every package (gateway, nodes, benchmarks,
admin client) to mount its subcommand. Only the command that runs is mounted whole, and what a
subcommand alone needs is imported inside it, so ``prefixgate node`` loads neither the gateway,
the benchmarks nor the Redis client (tests/surface/test_command_imports.py): every process of a
cluster, and every worker a supervisor restarts, starts sooner.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixgate.gateway.ops.smg_flags import SmgFlagRefused, add_smg_arguments, check_pd, smg_overrides

if TYPE_CHECKING:
    from prefixgate.gateway.config import Settings

#: Each command's one line in ``prefixgate --help``. A command's flags, and the modules they come
#: from, are loaded only for the command that runs (all of them for the top-level help): a node
#: does not import the benchmarks or the gateway, and each process of a cluster starts sooner.
COMMANDS = {
    "up": "start gateway + simulated nodes locally",
    "gateway": "run the gateway alone",
    "node": "run one node",
    "bench": "run a benchmark (prints a table; --json FILE writes the figures)",
    "admin": "talk to the admin API",
}


def _gateway_args(p: argparse.ArgumentParser, *, stack: bool) -> None:
    p.add_argument("--config", help="TOML config file (also PREFIXGATE_CONFIG)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000; 0 picks a free one)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC front-end port (0: off)")
    p.add_argument(
        "--redis", default=None, help="redis://host:port/db for the shared index (default: embedded)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway processes sharing the port, index and state (default 1; 0: one per core)",
    )
    p.add_argument("--model", default=None, help="served model name")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="bytes4 (default) | hf:/path/tokenizer.json | engine (the model's own, from the workers)"
        " | engine:DIR",
    )
    p.add_argument(
        "--tokenizer-path",
        default=None,
        metavar="DIR",
        help="the model's tokenizer directory (tokenizer.json + chat template); implies --tokenizer engine",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="tool-call format of the model (hermes, qwen25, llama3, mistral, pythonic; none: off;"
        " default: read from the chat template)",
    )
    p.add_argument(
        "--policy", default=None, help="routing policy: name or name:key=value,... (default prefixgate)"
    )
    p.add_argument("--admin-token", default=None)
    p.add_argument("--api-key", action="append", dest="api_keys", default=None, metavar="KEY=TENANT")
    p.add_argument(
        "--tenant-cache",
        choices=["isolated", "shared"],
        default=None,
        help="grpc:// workers keep one prefix cache for every tenant: refuse them with several "
        "tenants (isolated, the default) or share their cache (shared)",
    )
    p.add_argument(
        "--engine-priority",
        choices=["off", "on", "inverted"],
        default=None,
        help="send http:// workers each request's priority: off (never, the default), on (as is:"
        " vLLM --scheduling-policy priority) or inverted (negated: SGLang --enable-priority-scheduling"
        " without --schedule-low-priority-values-first)",
    )
    p.add_argument("--log-format", choices=["auto", "json", "console"], default=None)
    quotas = p.add_argument_group("per-tenant quotas (also PREFIXGATE_* and the config file)")
    quotas.add_argument("--pin-quota-blocks-per-node", type=int, default=None, metavar="N")
    quotas.add_argument("--pin-quota-node-share", type=float, default=None, metavar="FRACTION")
    quotas.add_argument("--pin-quota-blocks", type=int, default=None, metavar="N")
    quotas.add_argument("--pin-max-seconds", type=float, default=None, metavar="S")
    quotas.add_argument("--document-quota-count", type=int, default=None, metavar="N")
    quotas.add_argument("--document-quota-bytes", type=int, default=None, metavar="BYTES")
    quotas.add_argument("--document-store-bytes", type=int, default=None, metavar="BYTES")
    quotas.add_argument("--tenant-tokens-per-minute", type=int, default=None, metavar="N")
    quotas.add_argument("--tenant-requests-per-minute", type=int, default=None, metavar="N")
    quotas.add_argument("--key-tokens-per-minute", type=int, default=None, metavar="N")
    quotas.add_argument("--key-requests-per-minute", type=int, default=None, metavar="N")
    quotas.add_argument(
        "--tenant-limit",
        action="append",
        dest="tenant_limits",
        default=None,
        metavar="TENANT:tpm=N,rpm=N",
        help="a tenant's own rate limits (repeatable)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        dest="header_timeout_s",
        metavar="S",
        help="seconds for a request's headers to arrive (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        dest="body_timeout_s",
        metavar="S",
        help="seconds for a request's body to arrive after its headers (default 60)",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=None,
        dest="keepalive_timeout_s",
        metavar="S",
        help="idle keep-alive connections are closed after this (default 5)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open client connections (default 1024, kept under the open-file limit)",
    )
    p.add_argument(
        "--max-header-bytes", type=int, default=None, help="request line + headers (default 32768)"
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=None,
        dest="shutdown_grace_s",
        metavar="S",
        help="seconds open requests get after SIGTERM (default 10)",
    )
    p.add_argument(
        "--trusted-proxy",
        action="append",
        default=None,
        dest="trusted_proxies",
        metavar="ADDR",
        help="a proxy (address or CIDR) whose Forwarded / X-Forwarded-For / X-Real-IP are believed",
    )
    p.add_argument(
        "--admin-origin",
        action="append",
        default=None,
        dest="admin_origins",
        metavar="ORIGIN",
        help="a browser Origin allowed to call /admin (besides the gateway's own)",
    )
    p.add_argument("--metrics-token", default=None, help="bearer token required by /metrics (default: none)")
    if not stack:
        p.add_argument(
            "--prefill",
            action="append",
            nargs="+",
            default=None,
            metavar="URL",
            help="prefill worker: grpc://HOST:PORT [BOOTSTRAP_PORT] (SGLang/vLLM) or HOST:PORT (ours)",
        )
        p.add_argument(
            "--decode", action="append", default=None, metavar="URL", help="decode worker (grpc://HOST:PORT)"
        )
        p.add_argument(
            "--worker-urls",
            action="append",
            nargs="+",
            default=None,
            metavar="URL",
            help="workers of a monolithic pool: grpc://HOST:PORT (SGLang/vLLM) or http://HOST:PORT "
            "(any OpenAI-compatible server)",
        )
        p.add_argument(
            "--backend",
            choices=["sglang", "vllm"],
            default=None,
            help="runtime of the grpc:// workers (default: detected per worker)",
        )
        p.add_argument(
            "--monolithic", action="append", default=None, metavar="ADDR", help="monolithic node host:port"
        )
        p.add_argument(
            "--kv-events",
            action="append",
            default=None,
            dest="kv_events",
            metavar="WORKER=tcp://H:P",
            help="take WORKER's KV events from its engine's ZMQ publisher "
            "(tcp://H:P[?replay=tcp://H:Q&topic=T]; repeatable)",
        )


def _overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


_GATEWAY_KEYS = (
    "host",
    "workers",
    "port",
    "grpc_port",
    "redis",
    "model",
    "block_size",
    "tokenizer",
    "tokenizer_path",
    "tool_call_parser",
    "policy",
    "admin_token",
    "api_keys",
    "tenant_cache",
    "engine_priority",
    "log_format",
    "pin_quota_blocks_per_node",
    "pin_quota_node_share",
    "pin_quota_blocks",
    "pin_max_seconds",
    "document_quota_count",
    "document_quota_bytes",
    "document_store_bytes",
    "tenant_tokens_per_minute",
    "tenant_requests_per_minute",
    "key_tokens_per_minute",
    "key_requests_per_minute",
    "tenant_limits",
    "header_timeout_s",
    "body_timeout_s",
    "keepalive_timeout_s",
    "max_connections",
    "max_header_bytes",
    "shutdown_grace_s",
    "trusted_proxies",
    "admin_origins",
    "metrics_token",
    "prefill",
    "decode",
    "monolithic",
    "kv_events",
    "worker_urls",
    "backend",
)


def _settings(args: argparse.Namespace, keys: Sequence[str]) -> Settings | None:
    """The settings, or None after saying on stderr which one is wrong."""
    from prefixgate.gateway.config import load_settings

    try:
        return load_settings(args.config, _overrides(args, keys))
    except ValueError as e:
        print(f"prefixgate {args.command}: {e}", file=sys.stderr)
        return None


def gateway_settings(args: argparse.Namespace) -> Settings:
    """``prefixgate gateway``'s settings from its parsed flags (smg launch's among them:
    ``gateway.ops.smg_flags``); ValueError says in one line what is wrong."""
    from prefixgate.gateway.cluster import workers
    from prefixgate.gateway.config import load_settings

    args.prefill = workers.flag_entries(args.prefill)
    args.worker_urls = workers.flat_urls(args.worker_urls)
    try:
        smg = smg_overrides(args)
    except SmgFlagRefused as e:
        raise ValueError(str(e)) from None
    settings = load_settings(args.config, {**_overrides(args, _GATEWAY_KEYS), **smg})
    pd = check_pd(args, settings.prefill, settings.decode)
    if pd is not None:
        raise ValueError(pd)
    return settings


def cmd_gateway(args: argparse.Namespace) -> int:
    try:
        settings = gateway_settings(args)
    except ValueError as e:
        print(f"prefixgate gateway: {e}", file=sys.stderr)
        return 2
    from prefixgate.gateway.logging import configure_logging
    from prefixgate.gateway.ops.server import run

    configure_logging(settings.log_format, settings.log_level)
    if not (
        settings.decode
        or settings.monolithic
        or settings.worker_urls
        or settings.discovery_file
        or settings.discovery_dns
        or settings.discovery_kubernetes
    ):
        print(
            "prefixgate gateway: give at least one --decode or --monolithic node or --worker-urls"
            " (or discovery_file, discovery_dns or discovery_kubernetes to find them)",
            file=sys.stderr,
        )
        return 2
    from prefixgate.gateway.ops.supervisor import run_workers, worker_count

    if worker_count(settings) > 1:
        return run_workers(settings)
    return run(settings)


def cmd_up(args: argparse.Namespace) -> int:
    from prefixgate.gateway.logging import configure_logging
    from prefixgate.gateway.ops.stack import StackOptions, run_stack

    stack_keys = [
        k for k in _GATEWAY_KEYS if k not in ("prefill", "decode", "monolithic", "worker_urls", "backend")
    ]
    settings = _settings(args, stack_keys)
    if settings is None:
        return 2
    configure_logging(settings.log_format, settings.log_level)
    opts = StackOptions(
        host=settings.host,
        prefill=args.prefill,
        decode=args.decode,
        engine=args.engine,
        time_scale=args.time_scale,
        capacity_blocks=args.capacity_blocks,
        block_size=settings.block_size,
        protocol=args.protocol,
    )
    from prefixgate.gateway.ops.supervisor import worker_count

    if worker_count(settings) > 1:
        from prefixgate.gateway.ops.stack import run_stack_workers

        return run_stack_workers(settings, opts)
    try:
        import uvloop

        return uvloop.run(run_stack(settings, opts))
    except KeyboardInterrupt:
        return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only ``command``'s flags beside the others' names."""
    parser = argparse.ArgumentParser(prog="prefixgate", description="Disaggregated LLM serving gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        if command is None or command == name:
            _ADD[name](sub, text)
        else:
            sub.add_parser(name, help=text)
    return parser


def _add_up(sub: Any, text: str) -> None:
    up = sub.add_parser("up", help=text)
    _gateway_args(up, stack=True)
    up.add_argument("--prefill", type=int, default=2, help="prefill nodes (default 2)")
    up.add_argument("--decode", type=int, default=4, help="decode nodes (default 4)")
    up.add_argument("--engine", default="sim", help="node engine (default sim)")
    up.add_argument("--time-scale", type=float, default=1.0, help="simulated time multiplier (default 1)")
    up.add_argument("--capacity-blocks", type=int, default=0, help="KV blocks per node (default: node's)")
    up.add_argument(
        "--protocol",
        choices=["prefixgate", "smg"],
        default="prefixgate",
        help="how the gateway talks to the nodes: ours (default) or the SMG engine protocol (grpc://)",
    )
    up.set_defaults(func=cmd_up)


def _add_gateway(sub: Any, text: str) -> None:
    gw = sub.add_parser("gateway", help=text)
    _gateway_args(gw, stack=False)
    add_smg_arguments(gw)
    gw.set_defaults(func=cmd_gateway)


def _add_node(sub: Any, text: str) -> None:
    from prefixgate.backends.cli import add_node_arguments, run_node

    node = sub.add_parser("node", help=text)
    add_node_arguments(node)
    node.set_defaults(func=run_node)


def _add_bench(sub: Any, text: str) -> None:
    from prefixgate.bench.cli import add_bench_parser

    add_bench_parser(sub, text)


def _add_admin(sub: Any, text: str) -> None:
    from prefixgate.gateway.ops.admin_cli import add_admin_parser

    add_admin_parser(sub, text)


_ADD = {"up": _add_up, "gateway": _add_gateway, "node": _add_node, "bench": _add_bench, "admin": _add_admin}


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names first (its flags follow it), if it names one."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser(_command(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    except SmgFlagRefused as e:  # one line naming the flag, as for every settings error
        print(f"prefixgate gateway: {e}", file=sys.stderr)
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
