"""``prefixgate bench fairness``: one tenant floods, another's TTFT, live on our nodes.

One prefill and one decode node (sim, the default ``s5000`` profile at time scale 1) behind a
gateway with two API keys. Tenant B sends streamed chats at ``--rate`` requests a second (open
loop: a request is sent on time whether or not the previous one is answered), first alone, then
while tenant A sends ``--flood`` times as many of the same size. Each configuration gets a fresh
stack: the gateway-held queue at the defaults, and without it (``scheduler_node_requests = 0``:
every request sent to the node at once, which serves them first come, first served).

The table: B's TTFT p50/p99 alone and under the flood (and their ratio), A's answers a second
(from its first request to its last answer: the capacity it got) and refusals, and B's
failures. A fair scheduler keeps B near its quiet figures and gives A the capacity B leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from prefixgate.bench import launch
from prefixgate.gateway.ops import processes

MODEL = "prefixgate-sim"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=4.0, help="tenant B's requests a second")
    p.add_argument("--flood", type=float, default=10.0, help="tenant A's rate as a multiple of B's")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--words", type=int, default=1500, help="words in each prompt (~1.3 tokens a word)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the nodes' time scale: above 1 the nodes, not this machine's gateway, are the bottleneck",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the figures to this file")


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)
    failed: int = 0
    refused: int = 0  # 429
    started: float = 0.0
    last_done: float = 0.0  # when its last answer ended

    @property
    def served_per_s(self) -> float:
        """Answers a second from its first request sent to its last answer done."""
        span = self.last_done - self.started
        return len(self.ttft) / span if span > 0 else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def _chat(c: httpx.AsyncClient, base: str, tenant: str, words: int, out: Phase) -> None:
    prompt = f"{uuid.uuid4().hex} " + "a fair share of the prefill queue " * (words // 7)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "stream": True,
    }
    t0 = time.perf_counter()
    try:
        async with c.stream(
            "POST",
            base + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEYS[tenant]}"},
        ) as r:
            if r.status_code == 429:
                out.refused += 1
                return
            if r.status_code != 200:
                out.failed += 1
                return
            first = 0.0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and not first:
                    first = time.perf_counter() - t0
            out.ttft.append(first)
            out.last_done = max(out.last_done, time.perf_counter())
    except httpx.HTTPError:
        out.failed += 1


async def _open_loop(
    base: str, tenant: str, rate: float, seconds: float, words: int, rng: random.Random
) -> Phase:
    out = Phase()
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        start = out.started = time.perf_counter()
        at = 0.0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_chat(c, base, tenant, words, out)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out


async def _phases(base: str, args: argparse.Namespace) -> dict[str, Phase]:
    rng = random.Random(args.seed)
    quiet = await _open_loop(base, "b", args.rate, args.seconds, args.words, rng)
    flood_rate = args.rate * args.flood
    b_task = asyncio.create_task(
        _open_loop(base, "b", args.rate, args.seconds, args.words, random.Random(args.seed + 1))
    )
    a = await _open_loop(base, "a", flood_rate, args.seconds, args.words, random.Random(args.seed + 2))
    b = await b_task
    return {"b_quiet": quiet, "b_flood": b, "a_flood": a}


def _stack(env: dict[str, str], time_scale: float) -> tuple[list[processes.Child], str]:
    logs = launch.run_dir("fairness")
    opts = launch.NodeOptions(http=False, time_scale=time_scale)
    prefill = launch.start_nodes(1, replace(opts, role="prefill"), logs)
    decode = launch.start_nodes(1, replace(opts, role="decode"), logs)
    keys = ",".join(f"{k}={t}" for t, k in KEYS.items())
    gw = launch.start_gateway(
        logs,
        prefill=[prefill[0].address],
        decode=[decode[0].address],
        env={"PREFIXGATE_API_KEYS": keys, **env},
    )
    return [*prefill, *decode, gw], str(gw.url)


def run(args: argparse.Namespace) -> int:
    configs = {
        "gateway-held queue (default)": {},
        "no queue (node FCFS)": {"PREFIXGATE_SCHEDULER_NODE_REQUESTS": "0"},
    }
    rows: list[dict[str, Any]] = []
    for label, env in configs.items():
        procs, base = _stack(env, args.time_scale)
        try:
            got = asyncio.run(_phases(base, args))
        finally:
            processes.stop_all(reversed(procs))
        q, b, a = got["b_quiet"], got["b_flood"], got["a_flood"]
        rows.append(
            {
                "config": label,
                "b_quiet_p50_ms": q.pct(0.5),
                "b_quiet_p99_ms": q.pct(0.99),
                "b_flood_p50_ms": b.pct(0.5),
                "b_flood_p99_ms": b.pct(0.99),
                "b_p99_ratio": b.pct(0.99) / q.pct(0.99),
                "b_failed": b.failed + b.refused + q.failed + q.refused,
                "a_served_per_s": a.served_per_s,
                "a_refused": a.refused,
                "a_failed": a.failed,
                "a_p50_ms": a.pct(0.5),
            }
        )
    print(
        f"tenant B at {args.rate:g} req/s, tenant A at {args.rate * args.flood:g} req/s, "
        f"{args.words} words a prompt, {args.seconds:g} s a phase, nodes at time scale {args.time_scale:g}"
    )
    print(
        "| config | B alone p50/p99 ms | B under flood p50/p99 ms | B p99 ratio | B failed "
        "| A served/s | A 429 | A p50 ms |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['config']} | {r['b_quiet_p50_ms']:.0f} / {r['b_quiet_p99_ms']:.0f} | "
            f"{r['b_flood_p50_ms']:.0f} / {r['b_flood_p99_ms']:.0f} | {r['b_p99_ratio']:.2f}x | "
            f"{r['b_failed']} | "
            f"{r['a_served_per_s']:.1f} | {r['a_refused']} | {r['a_p50_ms']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"func": None}, "rows": rows}, f, indent=2, default=str)
    return 0
