"""``prefixgate bench limits``: two gateway replicas on one Redis under a tenant's tokens-per-minute
limit, hammered through both; what they admitted per minute against the limit.

One prefill and one decode node of ours (fast simulated time), two gateways (real processes)
sharing a Redis (``--redis``, a private key prefix) with ``--tenant-tokens-per-minute L`` and one
API key. ``--concurrency`` clients send chats back to back for ``--seconds``, alternating between
the replicas; a refused request (429) pauses ``--pause`` s before the client's next one, but the
first client sends every 10th of its refusals again once its Retry-After has passed. Each
answer is recorded (status, the tokens its ``usage`` counts, ``Retry-After``, the time sent).

Printed: the tokens admitted in each rolling minute that ends on a whole second (the limiter's
buckets are seconds) against L, the largest of them, refusals, and two Retry-After checks: under
load, how often a refused request sent again after its Retry-After was admitted (others compete
for the room that opens), and once the load has stopped, whether a refused probe sent again after
its Retry-After was admitted (it must be: the time is honest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from prefixgate.bench.drill_cluster import NodeProc, spawn
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port

MODEL = "prefixgate-sim"
KEY = "bench-limits-key"
TENANT = "acme"
WINDOW_S = 60


@dataclass
class Deployment:
    """Our nodes and two gateway replicas on one Redis, one tenant with a TPM limit."""

    redis: str
    tpm: int
    prefix: str = field(default_factory=lambda: f"prefixgate-limits-{uuid.uuid4().hex[:8]}:")
    replicas: int = 2
    node_args: list[str] = field(default_factory=lambda: ["--time-scale", "0.05"])
    extra_env: dict[str, str] = field(default_factory=dict)
    nodes: list[NodeProc] = field(default_factory=list)
    gateways: list[Child] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    grpc_ports: list[int] = field(default_factory=list)  # each replica's gRPC front (tests)
    grpc: bool = False

    def start(self) -> Deployment:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.nodes = [
            NodeProc("prefill", "prefill-1", free_port(), self.node_args),
            NodeProc("decode", "decode-1", free_port(), self.node_args),
        ]
        for n in self.nodes:
            n.launch()
        ready = processes.printed(processes.NODE_READY)
        processes.wait_all([n.proc for n in self.nodes if n.proc], ready, 30)
        env = {
            "PREFIXGATE_REDIS_PREFIX": self.prefix,
            "PREFIXGATE_STATS_INTERVAL_S": "0.2",
            "PREFIXGATE_TENANT_TOKENS_PER_MINUTE": str(self.tpm),
            **self.extra_env,
        }
        for _ in range(self.replicas):
            port = free_port()
            args = ["gateway", "--port", str(port), "--redis", self.redis, "--api-key", f"{KEY}={TENANT}"]
            args += ["--prefill", self.nodes[0].address, "--decode", self.nodes[1].address]
            if self.grpc:
                self.grpc_ports.append(free_port())
                args += ["--grpc-port", str(self.grpc_ports[-1])]
            self.gateways.append(spawn(args, env=env))
            self.urls.append(f"http://127.0.0.1:{port}")
        for gw, url in zip(self.gateways, self.urls, strict=True):
            gw.wait_until(processes.answers_http(url + "/readyz", lambda r: r.json()["prefill"] == 1), 30)

    def stop(self) -> None:
        processes.stop_all(self.gateways)
        processes.stop_all([n.proc for n in self.nodes if n.proc is not None])


def chat_body(i: int, max_tokens: int, words: int = 40) -> dict[str, Any]:
    text = " ".join(f"w{(i * 31 + j) % 997}" for j in range(words))
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}


@dataclass
class Sample:
    sent: float  # wall clock
    status: int
    tokens: int = 0  # usage prompt + completion of a 200
    retry_after: int | None = None
    message: str = ""
    retried_admitted: bool | None = None  # sent again after its Retry-After: admitted?


HEADERS = {"authorization": f"Bearer {KEY}"}


async def send(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    sent = time.time()
    r = await http.post(url + "/v1/chat/completions", json=body, headers=HEADERS)
    s = Sample(sent, r.status_code)
    if r.status_code == 200:
        u = r.json()["usage"]
        s.tokens = int(u["prompt_tokens"]) + int(u["completion_tokens"])
    else:
        with contextlib.suppress(Exception):
            s.message = str(r.json()["error"]["message"])
        ra = r.headers.get("retry-after")
        s.retry_after = int(ra) if ra is not None else None
    return s


async def hammer(
    urls: Sequence[str],
    seconds: float,
    concurrency: int,
    max_tokens: int,
    pause: float = 0.05,
    retry_every: int = 0,
) -> list[Sample]:
    """``concurrency`` clients back to back for ``seconds``, alternating replicas; the first
    client sends every ``retry_every``-th refusal (0: none) again after its Retry-After."""
    samples: list[Sample] = []
    end = time.monotonic() + seconds
    refusals = 0

    async def client(c: int) -> None:
        nonlocal refusals
        i = c
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            while time.monotonic() < end:
                body = chat_body(i, max_tokens)
                s = await send(http, urls[i % len(urls)], body)
                samples.append(s)
                i += concurrency
                if s.status != 429:
                    continue
                refusals += 1
                polite = c == 0 and retry_every and refusals % retry_every == 0
                if polite and s.retry_after is not None:
                    if time.monotonic() + s.retry_after < end:
                        await asyncio.sleep(s.retry_after)
                        again = await send(http, urls[i % len(urls)], body)
                        samples.append(again)
                        s.retried_admitted = again.status == 200
                        continue
                await asyncio.sleep(pause)

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return samples


def per_minute(samples: Sequence[Sample]) -> list[tuple[int, int]]:
    """(end second, tokens admitted in the minute of buckets ending then), for every whole
    second of the run from its first minute's end (or its last second, if shorter)."""
    admitted = [(math.floor(s.sent), s.tokens) for s in samples if s.status == 200]
    if not admitted:
        return []
    first = min(b for b, _ in admitted)
    last = max(math.floor(s.sent) for s in samples)
    out = []
    for e in range(min(first + WINDOW_S - 1, last), last + 1):
        out.append((e - first, sum(t for b, t in admitted if e - WINDOW_S < b <= e)))
    return out


async def probe(url: str, max_tokens: int) -> tuple[int | None, bool]:
    """Once quiet: a request refused with Retry-After R, sent again after R s: admitted?"""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        for i in range(10_000, 10_050):
            s = await send(http, url, chat_body(i, max_tokens))
            if s.status == 429 and s.retry_after is not None:
                await asyncio.sleep(s.retry_after)
                again = await send(http, url, chat_body(i, max_tokens))
                return s.retry_after, again.status == 200
    return None, False


@dataclass
class Result:
    seconds: float
    tpm: int
    requests: int
    admitted: int
    refused: int
    other: int
    admitted_tokens: int
    minutes: list[tuple[int, int]]
    retried: int
    retried_admitted: int
    probe_retry_after: int | None
    probe_admitted: bool

    @property
    def worst(self) -> int:
        return max((t for _, t in self.minutes), default=0)


def render(r: Result) -> str:
    lines = [
        f"two replicas, one Redis, tenant_tokens_per_minute = {r.tpm}, {r.seconds:g} s of load",
        f"{'minute ending at s':>20} {'admitted tokens':>16} {'of limit':>9}",
    ]
    shown = r.minutes if len(r.minutes) <= 12 else r.minutes[:: max(1, len(r.minutes) // 10)] + r.minutes[-1:]
    for end, tokens in shown:
        lines.append(f"{end:>20} {tokens:>16} {tokens / r.tpm:>8.1%}")
    lines += [
        f"largest rolling minute: {r.worst} tokens ({r.worst / r.tpm:.2%} of the limit)",
        f"requests: {r.requests}, admitted {r.admitted} ({r.admitted_tokens} tokens), "
        f"refused (429) {r.refused}, other {r.other}",
        f"retried after Retry-After under load: {r.retried_admitted}/{r.retried} admitted",
        f"quiet probe: refused with Retry-After {r.probe_retry_after} s, "
        f"sent again then: {'admitted' if r.probe_admitted else 'REFUSED'}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    dep = Deployment(args.redis, args.tpm).start()
    try:
        samples = asyncio.run(
            hammer(dep.urls, args.seconds, args.concurrency, args.max_tokens, args.pause, retry_every=10)
        )
        ra, ok = asyncio.run(probe(dep.urls[0], args.max_tokens))
    finally:
        dep.stop()
    res = Result(
        args.seconds,
        args.tpm,
        len(samples),
        sum(s.status == 200 for s in samples),
        sum(s.status == 429 for s in samples),
        sum(s.status not in (200, 429) for s in samples),
        sum(s.tokens for s in samples),
        per_minute(samples),
        sum(s.retried_admitted is not None for s in samples),
        sum(bool(s.retried_admitted) for s in samples),
        ra,
        ok,
    )
    print(render(res), flush=True)
    if args.json:
        args.json.write_bytes(orjson.dumps(asdict(res), option=orjson.OPT_INDENT_2))
    return 0 if res.worst <= args.tpm * 1.05 and ok and res.other == 0 else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=70.0, help="length of the load (default 70)")
    p.add_argument("--tpm", type=int, default=20_000, help="the tenant's tokens per minute (default 20000)")
    p.add_argument("--concurrency", type=int, default=8, help="clients (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each chat (default 16)")
    p.add_argument("--pause", type=float, default=0.05, help="a client's pause after a 429 (default 0.05)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the Redis both replicas share")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench limits", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
