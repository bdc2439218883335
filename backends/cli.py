"""``prefixgate node``: run one node. Mounted by the main CLI, or ``python -m prefixgate.backends``.

With ``--port 0`` (or ``--ready-line``) it prints one JSON line to stdout once bound,
``{"event": "node_ready", "node_id": ..., "address": "host:port", "role": ..., "instance_id": ...}``,
so a parent learns the port it got; logs go to stderr as JSON lines. SIGINT/SIGTERM stop the
node cleanly (exit code 0); a port that cannot be bound exits with 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import structlog

from prefixgate.backends.admission import POLICIES
from prefixgate.backends.engine import MAX_GROUP
from prefixgate.backends.kvpages import DEFAULT_KV_SCALE, parse_scale
from prefixgate.backends.node import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_CHUNKED_PREFILL,
    DEFAULT_SCHEDULING_POLICY,
    ROLES,
)
from prefixgate.backends.profiles import PROFILES


def whole_number(what: str) -> Callable[[str], int]:
    """An argument parser's type for a count of tokens, 1 or more; ``what`` names it in the error."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{what} is a whole number of tokens, 1 or more, not {text!r}")
        return n

    return parse


def _scale(text: str) -> float:
    try:
        return parse_scale(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES, required=True, help="what the gateway uses this node for")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default 0: a free one)")
    parser.add_argument(
        "--engine",
        default="sim",
        help="compute engine: sim (default), or tiny[:key=value,...] (a numpy transformer, real compute)",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="cost profile (default: s5000 for prefill, astar otherwise)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated time multiplier (default 1)")
    parser.add_argument(
        "--capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS, help="KV pool size in blocks"
    )
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block (default 64)")
    parser.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="the longest prompt served, in tokens, as SGLang's flag (default 0: the whole KV pool,"
        " capacity-blocks x block-size); reported to the gateway, which routes by it",
    )
    parser.add_argument(
        "--kv-scale",
        type=_scale,
        default=DEFAULT_KV_SCALE,
        help="fraction of the reference model's KV bytes actually shipped, e.g. 1/512 (default)",
    )
    parser.add_argument("--node-id", default=None, help="node id (default host:port)")
    parser.add_argument("--max-queue", type=int, default=64, help="prefills waiting at most (default 64)")
    parser.add_argument("--max-concurrency", type=int, default=1, help="prefills at once (default 1)")
    parser.add_argument("--max-decode-streams", type=int, default=256, help="decode streams at once")
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=DEFAULT_CHUNKED_PREFILL,
        help="tokens a prefill computes before a waiting prefill gets a turn, as SGLang's flag"
        f" (default {DEFAULT_CHUNKED_PREFILL}; 0 or -1: a prefill keeps its slot to the end)",
    )
    parser.add_argument(
        "--stream-interval",
        type=whole_number("a stream interval"),
        default=MAX_GROUP,
        help="tokens a streamed chunk holds at most, as SGLang's flag (default"
        f" {MAX_GROUP}; SGLang's is 1): tokens decoded faster than they can be sent go out in"
        " groups of up to this many",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=POLICIES,
        default=DEFAULT_SCHEDULING_POLICY,
        help="order of waiting prefills, as vLLM's flag: priority (the request's priority, lower"
        f" first; equal ones in arrival order) or fcfs (arrival order; default {DEFAULT_SCHEDULING_POLICY})",
    )
    parser.add_argument("--handle-ttl", type=float, default=60.0, help="seconds a received KV handle waits")
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="PD bootstrap port of a prefill node on the SMG engine protocol (0: a free one; default none)",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=30.0,
        help="seconds a PD leg waits for its peer (default 30)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name on the SMG engine protocol (default prefixgate-ENGINE)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve an OpenAI-compatible HTTP endpoint on this port (0: a free one), for peer routers",
    )
    parser.add_argument(
        "--http-normalize",
        action="store_true",
        help="render HTTP prompts with the gateway's normalization on (default: messages as sent)",
    )
    parser.add_argument("--http-model", default="prefixgate-sim", help="model name of the HTTP endpoint")
    parser.add_argument(
        "--ready-line",
        action="store_true",
        help="print the JSON ready line to stdout even with a fixed --port",
    )


def configure_logging(level: str) -> None:
    """structlog to stderr (keeps stdout for the ready line)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def node_options(args: argparse.Namespace) -> dict[str, Any]:
    """``start_node`` keyword arguments from parsed flags."""
    return {
        "engine": args.engine,
        "profile": args.profile,
        "capacity_blocks": args.capacity_blocks,
        "block_size": args.block_size,
        "context_length": max(0, getattr(args, "context_length", 0)),
        "time_scale": args.time_scale,
        "kv_scale": args.kv_scale,
        "node_id": args.node_id,
        "max_queue": args.max_queue,
        "max_concurrency": args.max_concurrency,
        "max_decode_streams": args.max_decode_streams,
        "handle_ttl_s": args.handle_ttl,
        "chunked_prefill_size": max(0, getattr(args, "chunked_prefill_size", DEFAULT_CHUNKED_PREFILL)),
        "scheduling_policy": getattr(args, "scheduling_policy", DEFAULT_SCHEDULING_POLICY),
        "stream_interval": getattr(args, "stream_interval", MAX_GROUP),
        "bootstrap_port": getattr(args, "bootstrap_port", None),
        "bootstrap_timeout_s": getattr(args, "bootstrap_timeout", 30.0),
        "served_model_name": getattr(args, "served_model_name", None),
    }


def http_options(args: argparse.Namespace) -> Any:
    """``backends.http_api.HTTPOptions`` from parsed flags (None without ``--http-port``)."""
    if getattr(args, "http_port", None) is None:
        return None
    from prefixgate.backends.http_api import HTTPOptions

    return HTTPOptions(model=args.http_model, normalize=args.http_normalize)


def run_node(args: argparse.Namespace) -> int:
    from prefixgate.backends.server import NodeServer, serve

    configure_logging(args.log_level)

    def ready(ns: NodeServer) -> None:
        if args.port != 0 and not args.ready_line:
            return
        line: dict[str, Any] = {
            "event": "node_ready",
            "node_id": ns.node.node_id,
            "address": ns.address,
            "role": ns.node.config.role,
            "instance_id": ns.node.events.instance_id,
        }
        if ns.http is not None:
            line["http_address"] = ns.http.address
        if ns.bootstrap is not None:
            line["bootstrap_port"] = ns.bootstrap.port
        print(json.dumps(line), flush=True)

    try:
        run_loop(
            serve(
                args.role,
                args.host,
                args.port,
                on_ready=ready,
                http_port=args.http_port,
                http_options=http_options(args),
                **node_options(args),
            )
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"prefixgate node: {e}", file=sys.stderr)
        return 1
    return 0


def run_loop(main: Any) -> None:
    """Run a coroutine on uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefixgate.backends", description="run one prefixgate node"
    )
    add_node_arguments(parser)
    return run_node(parser.parse_args(argv))
