"""``prefixgate bench ...``: mounts the benchmarks under the main command (``prefixgate/cli.py``)."""

from __future__ import annotations

import argparse
from typing import Any


def _tiny(args: argparse.Namespace) -> int:
    from prefixgate.bench import tiny_bench

    return int(tiny_bench.main(list(args.rest)) or 0)


def add_bench_parser(sub: Any, text: str) -> None:
    """Add the ``bench`` subcommands (replay, hotpath, index, toolcalls, detok, zmq-flood, tiny, peers,
    overhead, instructions, lines, chaos, fairness, limits, loopstall)."""
    from prefixgate.bench import hotpath, replay

    bench = sub.add_parser("bench", help=text)
    inner = bench.add_subparsers(dest="bench", required=True)

    rp = inner.add_parser("replay", help="replay a trace or generated workload through the routing policies")
    replay.add_arguments(rp)
    rp.set_defaults(func=replay.run)

    hp = inner.add_parser("hotpath", help="normalize + tokenize + hash time for 1K/32K/128K-token prompts")
    hotpath.add_arguments(hp)
    hp.set_defaults(func=hotpath.run)

    from prefixgate.bench import index_bench

    ix = inner.add_parser("index", help="index lookup latency, write throughput, Redis memory per block")
    index_bench.add_arguments(ix)
    ix.set_defaults(func=index_bench.run_args)

    from prefixgate.bench import toolcall_cost

    tc = inner.add_parser("toolcalls", help="tool-call parsing cost per KB of a streamed answer")
    toolcall_cost.add_arguments(tc)
    tc.set_defaults(func=toolcall_cost.run)

    tb = inner.add_parser("tiny", help="tiny engine: TTFT with and without a prefix hit, KV transfer")
    tb.add_argument(
        "rest", nargs=argparse.REMAINDER, help="arguments of python -m prefixgate.bench.tiny_bench"
    )
    tb.set_defaults(func=_tiny)

    from prefixgate.bench import detok_cost

    dt = inner.add_parser("detok", help="detokenizer cost per output token, 1 KB to 1 MB of text")
    detok_cost.add_arguments(dt)
    dt.set_defaults(func=detok_cost.run)

    from prefixgate.bench import overhead, peers

    pe = inner.add_parser(
        "peers", help="prefixgate vs sglang-router / vllm-router / LiteLLM, live, same nodes"
    )
    peers.add_arguments(pe)
    pe.set_defaults(func=peers.run)

    ov = inner.add_parser(
        "overhead", help="latency and CPU a router adds: client->node vs client->router->node"
    )
    overhead.add_arguments(ov)
    ov.set_defaults(func=overhead.run)

    from prefixgate.bench import instructions

    ins = inner.add_parser(
        "instructions", help="CPU instructions a request costs a router, counted under callgrind"
    )
    instructions.add_arguments(ins)
    ins.set_defaults(func=instructions.run)

    from prefixgate.bench import lines

    ln = inner.add_parser(
        "lines", help="Python lines a request runs, by function (own and inclusive), counted"
    )
    lines.add_arguments(ln)
    ln.set_defaults(func=lines.run)

    from prefixgate.bench import zmq_flood

    zf = inner.add_parser(
        "zmq-flood", help="/healthz and RSS of a gateway while a ZMQ KV event publisher floods it"
    )
    zmq_flood.add_arguments(zf)
    zf.set_defaults(func=zmq_flood.run)

    from prefixgate.bench import chaos

    ch = inner.add_parser(
        "chaos", help="mixed load while nodes and Redis are killed, stopped and restarted; leaks after"
    )
    chaos.add_arguments(ch)
    ch.set_defaults(func=chaos.run)

    from prefixgate.bench import fairness

    fa = inner.add_parser(
        "fairness", help="one tenant floods: the other's TTFT with and without the gateway-held queue"
    )
    fairness.add_arguments(fa)
    fa.set_defaults(func=fairness.run)

    from prefixgate.bench import loop_stall

    ls = inner.add_parser(
        "loopstall", help="/healthz latency while cold ~124K-token chats pass through a grpc:// worker"
    )
    loop_stall.add_arguments(ls)
    ls.set_defaults(func=loop_stall.run)

    from prefixgate.bench import limits

    li = inner.add_parser(
        "limits", help="two replicas on one Redis under a tokens-per-minute limit: admitted per minute"
    )
    limits.add_arguments(li)
    li.set_defaults(func=limits.run)
