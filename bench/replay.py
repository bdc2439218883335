"""``prefixgate bench replay``: replay a trace or generated workload against the routing policies.

``--mode sim`` runs the virtual-time simulator (``bench.simulator``) once per policy and
once for the global-LRU bound, prints a table and optionally writes JSON::

    {"workload": {...}, "config": {...},
     "policies": {NAME: {"hit_rate", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "imbalance",
                         "prefill_tokens", ...}},
     "bound": {"hit_rate", "unbounded_hit_rate", ...}}

``--scheduler scheduled`` sends the requests through the gateway's scheduler instead of straight to
the nodes' queues; ``--scheduler-table`` prints one table of FCFS against it on the public traces
pushed past capacity (``bench.sched_table``)::

    {"config": {...}, "rows": [{"trace", "load", "mode", "short_p99_s", "max_wait_s", "hit_rate",
                                "missed", "full", "shed", "expired", ...}], "sweep": [...]}

A live driver reuses ``build_workload`` (requests + ``Workload.openai_body``) and
``bench.report`` (``Outcome`` -> ``summarize`` -> table/JSON).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from prefixgate.bench import sched_table
from prefixgate.bench.profile import PROFILES, get_profile
from prefixgate.bench.report import PolicySummary, print_error, print_table, write_json
from prefixgate.bench.simulator import SimConfig, global_lru_bound, simulate
from prefixgate.bench.workloads import (
    FORMATS,
    GENERATED_FORMATS,
    TRACE_FORMATS,
    Workload,
    WorkloadOptions,
    guess_format,
    load_workload,
)
from prefixgate.gateway.routing import parse_policy

DEFAULT_POLICIES = ("round_robin", "least_loaded", "consistent_hash", "longest_prefix", "prefixgate")
DEFAULT_CAPACITY_TOKENS = 20_000 * 512  # the trace README's middle row: 20,000 blocks of 512 tokens
# Arrivals / X so that 4 s5000 prefill nodes are ~65-80 % busy (see bench/README.md).
DEFAULT_TIME_SCALE = {"mooncake": 10.0, "azure": 60.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace file (default: the shared trace of --format)")
    p.add_argument("--format", choices=FORMATS, help="workload format (default: from --trace, else mooncake)")
    p.add_argument(
        "--mode",
        choices=("sim", "live"),
        default="sim",
        help="sim: virtual-time simulator; live: send the requests to a running server at --url",
    )
    p.add_argument("--prefill-nodes", type=int, default=4)
    p.add_argument(
        "--capacity-tokens",
        type=int,
        default=DEFAULT_CAPACITY_TOKENS,
        help="total KV capacity over the prefill nodes, in tokens (split evenly)",
    )
    p.add_argument("--block-size", type=int, default=64, help="tokens per block (64 = the gateway default)")
    p.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        help="names, or name:key=value,... (the gateway's --policy takes the same specs)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="divide arrival times by X (X > 1 compresses; default 10 for mooncake, 60 for azure, else 1)",
    )
    p.add_argument("--limit", type=int, default=None, help="keep only the first N requests")
    p.add_argument("--fraction", type=float, default=None, help="keep each request with this probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=None, help="generated formats: how many requests")
    p.add_argument(
        "--rate", type=float, default=None, help="generated formats: sessions or questions per second"
    )
    p.add_argument(
        "--normalize",
        choices=("on", "off", "both"),
        default="on",
        help="generated formats: render with normalization on, off, or run both",
    )
    p.add_argument("--profile", choices=sorted(PROFILES), default="s5000")
    p.add_argument(
        "--concurrency", type=int, default=1, help="prefills a node runs at once (sharing its compute)"
    )
    p.add_argument(
        "--ttft-budget",
        type=float,
        default=30.0,
        help="queue-wait estimate beyond which a request falls back",
    )
    p.add_argument(
        "--no-inflight-prefixes",
        action="store_true",
        help="route on the index alone (not counting prefixes routed and still computing)",
    )
    p.add_argument(
        "--scheduler",
        choices=("fcfs", "scheduled"),
        default="fcfs",
        help="fcfs: every request sent to its node's queue at once; scheduled: the gateway's queue holds "
        "what the nodes cannot start (gateway.scheduling)",
    )
    p.add_argument(
        "--scheduler-table",
        action="store_true",
        help="one table: FCFS against the scheduler on --scheduler-traces at --loads x capacity",
    )
    p.add_argument(
        "--scheduler-sweep",
        type=float,
        metavar="LOAD",
        help="with --scheduler-table: also the scheduled mode with other queue and room values at LOAD",
    )
    p.add_argument(
        "--scheduler-traces",
        nargs="+",
        choices=TRACE_FORMATS,
        default=list(TRACE_FORMATS),
        help="the traces of --scheduler-table (each from the traces directory)",
    )
    p.add_argument(
        "--loads", nargs="+", type=float, default=[1.3, 1.6], help="offered load / capacity, each a row"
    )
    p.add_argument(
        "--slo-ms", type=float, default=2000.0, help="the TTFT target the table counts misses against"
    )
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")
    from prefixgate.bench import live

    live.add_arguments(p)


def options(args: argparse.Namespace, fmt: str, normalize: bool = True) -> WorkloadOptions:
    scale = args.time_scale if args.time_scale is not None else DEFAULT_TIME_SCALE.get(fmt, 1.0)
    return WorkloadOptions(
        block_size=args.block_size,
        time_scale=scale,
        limit=args.limit,
        fraction=args.fraction,
        seed=args.seed,
        normalize=normalize,
        requests=args.requests,
        rate=args.rate,
    )


def workload_format(args: argparse.Namespace) -> str:
    if args.format:
        return str(args.format)
    return guess_format(args.trace) if args.trace else "mooncake"


def build_workload(args: argparse.Namespace, normalize: bool = True) -> Workload:
    fmt = workload_format(args)
    return load_workload(fmt, Path(args.trace) if args.trace else None, options(args, fmt, normalize))


def offered_load(workload: Workload, config: SimConfig) -> float:
    """Prefill seconds of every prompt with no cache / (nodes x span of arrivals)."""
    span = workload.duration_s
    if span <= 0:
        return 0.0
    work = sum(config.profile.prefill_s(r.prompt_tokens, 0) for r in workload.requests)
    return work / (config.prefill_nodes * span)


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        prefill_nodes=args.prefill_nodes,
        capacity_blocks=max(1, args.capacity_tokens // args.block_size),
        block_size=args.block_size,
        profile=get_profile(args.profile),
        concurrency=args.concurrency,
        ttft_budget_s=args.ttft_budget,
        inflight=not args.no_inflight_prefixes,
        scheduler=args.scheduler == "scheduled",
    )


def run_scheduler_table(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """FCFS against the scheduler (``bench.sched_table``) with the first of ``--policies``."""
    config = replace(sim_config(args), scheduler=False)
    policy = parse_policy(args.policies[0])
    traces, scales = sched_table.load_traces(args, options)
    slo_s = args.slo_ms / 1000.0
    bases = sched_table.calibrate(traces, policy, config)
    rows = sched_table.run_table(traces, scales, bases, policy, config, args.loads, slo_s, console)
    report: dict[str, Any] = {
        "config": {"policy": args.policies[0], "prefill_nodes": config.prefill_nodes, "slo_ms": args.slo_ms},
        "rows": [r.as_json() for r in rows],
    }
    if args.scheduler_sweep:
        sweep = sched_table.run_sweep(traces, bases, policy, config, args.scheduler_sweep, slo_s, console)
        report["sweep"] = [r.as_json() for r in sweep]
    return report


def run_sim(workload: Workload, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    config = sim_config(args)
    reqs = workload.requests
    load = offered_load(workload, config)
    mean_prompt = workload.prompt_tokens / max(1, len(reqs))
    console.print(
        f"[bold]{workload.description}[/]: {len(reqs)} requests over {workload.duration_s:.0f} s, "
        f"mean prompt {mean_prompt:.0f} tokens; {config.prefill_nodes} prefill nodes "
        f"({config.profile.name}), capacity {args.capacity_tokens:,} tokens ({config.capacity_blocks:,} "
        f"blocks of {config.block_size}); offered load with no cache {load * 100:.0f} %; {config.mode}"
    )
    policies = {spec: parse_policy(spec) for spec in args.policies}  # every spec checked before any run
    results: dict[str, PolicySummary] = {}
    for spec, policy in policies.items():
        results[spec] = simulate(reqs, policy, config)
    bound = global_lru_bound(reqs, config.capacity_blocks, config.block_size)
    print_table(f"{workload.name}: simulated, {config.prefill_nodes} prefill nodes", results, bound, console)
    return {
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "requests": len(reqs),
            "duration_s": round(workload.duration_s, 3),
            "prompt_tokens": workload.prompt_tokens,
            "offered_load": round(load, 4),
            **workload.params,
        },
        "config": {
            "mode": "sim",
            "prefill_nodes": config.prefill_nodes,
            "capacity_tokens": args.capacity_tokens,
            "capacity_blocks": config.capacity_blocks,
            "block_size": config.block_size,
            "profile": config.profile.name,
            "concurrency": config.concurrency,
            "ttft_budget_s": config.ttft_budget_s,
            "inflight_prefixes": config.inflight,
            "scheduler": config.mode,
        },
        "policies": {name: s.as_json() for name, s in results.items()},
        "bound": {k: round(v, 6) for k, v in bound.items()},
    }


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(160, Console().width))
    fmt = workload_format(args)
    try:
        if args.scheduler_table:
            report = run_scheduler_table(args, console)
        elif args.mode == "live":
            from prefixgate.bench import live

            report = live.run_replay(build_workload(args, args.normalize != "off"), args, console)
        elif args.normalize == "both" and fmt in GENERATED_FORMATS:
            report = run_sim(build_workload(args, True), args, console)
            report["without_normalization"] = run_sim(build_workload(args, False), args, console)
        else:
            report = run_sim(build_workload(args, args.normalize != "off"), args, console)
    except (OSError, ValueError) as e:
        print_error(console, e)
        return 2
    if args.json_out:
        write_json(args.json_out, report, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench replay", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
