"""``prefixgate bench peers``: prefixgate and peer routers side by side, live, on the same nodes.

For each target, in turn and from a cold start: ``--nodes`` fresh simulated monolithic nodes
(``prefixgate node --role monolithic --http-port 0``, same profile and KV capacity), the
router in front of them, the same workload replayed through it (``bench.live``), then
everything stopped. Targets:

- ``prefixgate``: the gateway in front of the nodes as monolithic nodes (``prefixgate gateway
  --monolithic ADDR...``, gRPC ``Generate``), routing with its default policy. This is the
  like-for-like comparison: the same nodes, each serving whole requests. (The split
  prefill/decode mode needs other nodes and is not compared here.)
- ``smg``: smg 1.13.0 ``--policy cache_aware``; ``sglang``: sglang-router 0.3.2
  ``--policy cache_aware``; ``vllm``: vllm-router 0.1.17
  ``--policy cache_aware`` (asks every node for token ids via ``/v1/*/render``);
  ``litellm``: LiteLLM proxy, ``simple-shuffle`` (no cache-aware strategy exists). They talk
  HTTP to the nodes' OpenAI-compatible endpoint (``backends.http_api``).

``--variant LABEL:SETTING=VALUE[,...]`` adds a run of prefixgate with other gateway settings
(passed as ``PREFIXGATE_*`` variables), e.g. ``--variant index-only:inflight_prefixes=false`` for
a before/after of one setting in one run.

Peers come from a directory of venvs (``--peers-venv``; bench/README.md, "Peer routers", has the install
commands); a peer that is not installed is skipped with a line saying so. Nodes render HTTP
prompts as sent (no normalization), as a real engine would; prefixgate normalizes before it
routes. Per target: hit rate (cached / prompt tokens from ``usage``), TTFT p50/p95/p99,
req/s, errors, imbalance (max / mean of prompt tokens each node computed, read from the
nodes' stats) and the router's CPU time per request (its process group, from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from prefixgate.bench import launch, live
from prefixgate.bench.replay import build_workload, workload_format
from prefixgate.bench.report import print_error, write_json
from prefixgate.bench.workloads import FORMATS, Workload
from prefixgate.gateway.ops import processes
from prefixgate.v1 import node_pb2, node_pb2_grpc

TARGETS = ("prefixgate", *launch.PEERS)


def node_counters(nodes: Sequence[processes.Child]) -> dict[str, tuple[int, int]]:
    """node id -> (prompt tokens, prefix-hit tokens) so far, from each node's Stats."""
    out: dict[str, tuple[int, int]] = {}
    for n in nodes:
        with grpc.insecure_channel(n.address) as ch:
            s = node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=5)
        out[n.name] = (int(s.prompt_tokens), int(s.prefix_hit_tokens))
    return out


def computed_tokens(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, float]:
    """Prompt tokens each node had to compute between two readings (its prefill work)."""
    return {
        k: float((after[k][0] - before[k][0]) - (after[k][1] - before[k][1])) for k in after if k in before
    }


def start_router(
    target: str,
    policy: str,
    nodes: Sequence[processes.Child],
    venvs: Path,
    logs: Path,
    env: Mapping[str, str] | None = None,
) -> processes.Child:
    if target == "prefixgate":
        return launch.start_gateway(
            logs, monolithic=[n.address for n in nodes], policy=policy, env=env, name=_log_name(env)
        )
    return launch.start_peer(target, venvs, [n.url for n in nodes], logs)


def _log_name(env: Mapping[str, str] | None) -> str:
    if not env:
        return "prefixgate"
    return "prefixgate-" + "-".join(f"{k.removeprefix('PREFIXGATE_').lower()}-{v}" for k, v in env.items())


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``LABEL:SETTING=VALUE[,SETTING=VALUE...]`` -> (label, ``PREFIXGATE_*`` environment)."""
    label, sep, rest = spec.partition(":")
    env: dict[str, str] = {}
    for item in rest.split(",") if sep else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--variant {spec!r}: settings are SETTING=VALUE, comma-separated")
        env["PREFIXGATE_" + key.strip().upper().replace("-", "_")] = value.strip()
    if not label.strip() or not env:
        raise ValueError(f"--variant {spec!r}: use LABEL:SETTING=VALUE[,SETTING=VALUE...]")
    return label.strip(), env


def run_target(
    target: str,
    workload: Workload,
    args: argparse.Namespace,
    node_opts: launch.NodeOptions,
    logs: Path,
    console: Console,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    nodes = launch.start_nodes(args.nodes, node_opts, logs)
    router: processes.Child | None = None
    try:
        router = start_router(target, args.policy, nodes, Path(args.peers_venv), logs, env)
        opts = live.LiveOptions(
            url=router.url,
            clients=args.clients,
            duration_s=args.duration,
            closed_loop=args.closed_loop,
            max_output_tokens=args.max_output_tokens or None,
            request_timeout_s=args.request_timeout,
            headers=router.headers,
            keepalive=not args.no_keepalive,
            label=target,
        )
        before = node_counters(nodes)
        cpu0 = launch.group_cpu_seconds(router.pid)
        run = asyncio.run(live.replay(workload, opts))
        cpu = launch.group_cpu_seconds(router.pid) - cpu0
        work = computed_tokens(before, node_counters(nodes))
        result = live.summary(run, work)
        result["router_cpu_ms_per_req"] = round(cpu * 1000 / max(1, len(run.records)), 3)
        return result
    finally:
        processes.stop_all([c for c in (router, *nodes) if c is not None], grace=3.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace file (default: the shared trace of --format)")
    p.add_argument("--format", choices=FORMATS, help="workload format (default: from --trace, else mooncake)")
    p.add_argument("--limit", type=int, default=None, help="keep only the first N requests")
    p.add_argument("--fraction", type=float, default=None, help="keep each request with this probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=None, help="generated formats: how many requests")
    p.add_argument("--rate", type=float, default=None, help="generated formats: arrivals per second")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="divide arrival times by X (default 10 for mooncake, 60 for azure, else 1)",
    )
    p.add_argument(
        "--peers",
        default=",".join(launch.PEERS),
        help="peers besides prefixgate, comma-separated: smg,sglang,vllm,litellm (default all; '' none)",
    )
    p.add_argument("--no-prefixgate", action="store_true", help="run the peers only")
    p.add_argument(
        "--peers-venv",
        default=str(launch.default_peers_dir()),
        help="directory holding venv-smg, venv-sglang, venv-vllmr, venv-litellm (default $PREFIXGATE_PEERS "
        "or $TMPDIR/prefixgate-peers)",
    )
    p.add_argument("--policy", default="prefixgate", help="prefixgate's routing policy (default prefixgate)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:SETTING=VALUE[,...]",
        help="also run prefixgate with these gateway settings, e.g. index-only:inflight_prefixes=false",
    )
    p.add_argument("--nodes", type=int, default=4, help="simulated monolithic nodes (default 4)")
    p.add_argument("--node-profile", default="s5000", help="node cost profile (default s5000)")
    p.add_argument("--node-time-scale", type=float, default=1.0, help="node simulated-time multiplier")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=20_000,
        help="KV blocks per node (64 tokens each; default 20,000)",
    )
    p.add_argument("--clients", type=int, default=64, help="requests in flight at most (default 64)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of workload per target (default 30)")
    p.add_argument(
        "--closed-loop", action="store_true", help="ignore arrival times; keep --clients in flight"
    )
    p.add_argument("--max-output-tokens", type=int, default=32, help="cap on max_tokens (0: none)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--no-keepalive", action="store_true", help="a new connection per request")
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")
    p.set_defaults(block_size=64)  # the gateway's and the nodes' block size


def targets_of(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(targets to run, skipped peer -> reason)."""
    wanted = [] if args.no_prefixgate else ["prefixgate"]
    skipped: dict[str, str] = {}
    for name in (x.strip() for x in args.peers.split(",")):
        if not name:
            continue
        reason = launch.peer_missing(name, Path(args.peers_venv))
        if reason:
            skipped[name] = reason
        else:
            wanted.append(name)
    return wanted, skipped


def label(target: str, policy: str) -> str:
    return f"prefixgate {policy}" if target == "prefixgate" else launch.PEER_LABELS[target]


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(150, Console().width))
    try:
        workload = build_workload(args, True)
    except (OSError, ValueError) as e:
        print_error(console, e)
        return 2
    targets, skipped = targets_of(args)
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as e:
        print_error(console, e)
        return 2
    for name, reason in skipped.items():
        console.print(f"[yellow]skipped[/] {name}: {reason}")
    node_opts = replace(
        launch.NodeOptions(),
        profile=args.node_profile,
        time_scale=args.node_time_scale,
        capacity_blocks=args.capacity_blocks,
    )
    logs = launch.run_dir("peers")
    console.print(
        f"[bold]{workload.description}[/]; {args.nodes} monolithic nodes ({args.node_profile}, "
        f"{args.capacity_blocks:,} blocks each), {args.duration:g} s per target, at most {args.clients} "
        f"in flight, output capped at {args.max_output_tokens or 'no cap'} tokens; logs in {logs}"
    )
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    runs: list[tuple[str, str, dict[str, str] | None]] = [(t, label(t, args.policy), None) for t in targets]
    runs[1:1] = [("prefixgate", f"prefixgate ({v})", env) for v, env in variants.items()]
    for target, name, env in runs:
        console.print(f"running {name} ...")
        t0 = time.monotonic()
        try:
            results[name] = run_target(target, workload, args, node_opts, logs, console, env)
        except (OSError, RuntimeError, TimeoutError, grpc.RpcError) as e:
            failed[name] = str(e).splitlines()[0][:300]
            console.print(f"[red]failed[/] {name}: {failed[name]}")
            continue
        console.print(f"  done in {time.monotonic() - t0:.0f} s")
    sent = max((r.get("sent", 0) for r in results.values()), default=0)
    bound = live.bound(workload.requests[:sent], args.nodes * args.capacity_blocks, workload.block_size)
    table = live.render(
        f"{workload.name}: live, same {args.nodes} nodes, same requests",
        results,
        extra=("router_cpu_ms_per_req",),
        extra_labels=("CPU ms/req",),
    )
    table.caption = (
        f"global-LRU bound over the first {sent} requests at the same total capacity: "
        f"{bound['hit_rate'] * 100:.1f} % hit rate; imbalance = max/mean of prompt tokens computed per node"
    )
    console.print(table)
    report = {
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "format": workload_format(args),
            **workload.params,
        },
        "config": {
            "mode": "live",
            "nodes": args.nodes,
            "node_profile": args.node_profile,
            "node_time_scale": args.node_time_scale,
            "capacity_blocks_per_node": args.capacity_blocks,
            "clients": args.clients,
            "duration_s": args.duration,
            "closed_loop": args.closed_loop,
            "max_output_tokens": args.max_output_tokens,
            "keepalive": not args.no_keepalive,
            "node_http_normalization": False,
            "peers": {t: launch.PEER_VERSIONS[t] for t in targets if t in launch.PEER_VERSIONS},
            "variants": variants,
        },
        "policies": results,
        "bound": bound,
        "skipped": skipped,
        "failed": failed,
    }
    if args.json_out:
        write_json(args.json_out, report, console)
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench peers", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
