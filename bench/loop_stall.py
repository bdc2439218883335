"""Does a long cold prompt hold up everything else on the gateway?

One client sends cold chats of about ``--tokens`` tokens back to back through a gateway in front
of one ``grpc://`` worker (the SMG engine protocol: the gateway renders the chat template and
tokenizes with the engine's tokenizer, the shipped one here), while ``GET /healthz`` is polled
every 10 ms. ``/healthz`` does no work of its own, so its latency is how long the event loop
was busy with something else. Each chat's text is new (random words), so neither the segment
cache nor the index helps. Measured quiet (no chats) and loaded, for this checkout and, with
``--baseline-src``, another one, interleaved in rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.bench import launch
from prefixgate.bench.overhead import SHIPPED_TOKENIZER
from prefixgate.bench.report import percentile, write_json
from prefixgate.gateway.ops import processes

POLL_S = 0.010
WORDS = ("alpha", "delta", "prefill", "decode", "gateway", "token", "cache", "section", "window", "page")


@dataclass
class Run:
    healthz_ms: list[float] = field(default_factory=list)
    chats: int = 0
    chat_s: list[float] = field(default_factory=list)
    errors: int = 0


def _word(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}{rng.randrange(100_000)}"


@functools.cache
def tokens_a_word() -> float:
    """The shipped tokenizer's tokens per word of ``chat_text`` (from a sample)."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    rng = random.Random(0)
    return len(hf.encode(" ".join(_word(rng) for _ in range(2000))).ids) / 2000


def chat_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the shipped tokenizer."""
    return " ".join(_word(rng) for _ in range(int(tokens / tokens_a_word())))


async def poll(client: httpx.AsyncClient, url: str, until: float, out: Run) -> None:
    while time.monotonic() < until:
        t = time.perf_counter()
        r = await client.get(url + "/healthz")
        out.healthz_ms.append((time.perf_counter() - t) * 1000)
        if r.status_code != 200:
            out.errors += 1
        await asyncio.sleep(POLL_S)


def chat_bodies(count: int, tokens: int, seed: int) -> list[bytes]:
    """``count`` chat bodies, made before the measurement: making one takes tens of
    milliseconds of this process's event loop, which the poller shares."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        body = {
            "model": launch.MODEL,
            "messages": [{"role": "user", "content": chat_text(rng, tokens)}],
            "max_tokens": 1,
        }
        out.append(orjson.dumps(body))
    return out


async def chats(client: httpx.AsyncClient, url: str, until: float, bodies: list[bytes], out: Run) -> None:
    for body in bodies:  # each once: a body sent again would be warm
        if time.monotonic() >= until:
            return
        t = time.perf_counter()
        r = await client.post(
            url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        if r.status_code == 200:
            out.chats += 1
            out.chat_s.append(time.perf_counter() - t)
        else:
            out.errors += 1


async def measure(url: str, seconds: float, bodies: list[bytes]) -> Run:
    """``/healthz`` polled for ``seconds``, while ``bodies`` (if any) are sent one at a time."""
    out = Run()
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=30) as poller, httpx.AsyncClient(timeout=120) as sender:
        jobs = [poll(poller, url, until, out)]
        if bodies:
            jobs.append(chats(sender, url, until, bodies, out))
        await asyncio.gather(*jobs)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=124_000, help="tokens a chat (default 124000)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds a measurement (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--baseline-src", default="", help="another checkout's source to measure beside this one")
    p.add_argument("--json", default="", help="write the figures to this file")


def run(args: argparse.Namespace) -> int:
    console = Console()
    logs = launch.run_dir("loopstall")
    # the node's own pace is not what is measured: it answers a 124K-token prefill quickly
    node_opts = launch.NodeOptions(time_scale=0.01, max_queue=64, max_concurrency=4, http=False)
    node = launch.start_nodes(1, node_opts, logs)[0]
    targets: dict[str, processes.Child] = {}
    try:
        worker = [f"grpc://{node.address}"]
        targets["this checkout"] = launch.start_gateway(logs, monolithic=worker, env=SHIPPED_TOKENIZER)
        if args.baseline_src:
            env = {**SHIPPED_TOKENIZER, "PYTHONPATH": args.baseline_src}
            targets["baseline"] = launch.start_gateway(logs, monolithic=worker, name="baseline", env=env)
        runs: dict[tuple[str, bool], list[Run]] = {}
        for rnd in range(args.rounds):
            for name, child in targets.items():
                for loaded in (False, True):
                    # more than one chat can be sent in the time (each takes 0.2 s or more)
                    count = int(args.seconds / 0.1) if loaded else 0
                    bodies = chat_bodies(count, args.tokens, seed=rnd * 7 + len(runs) + 1)
                    r = asyncio.run(measure(child.url, args.seconds, bodies))
                    runs.setdefault((name, loaded), []).append(r)
    finally:
        for child in targets.values():
            child.stop()
        node.stop()
    title = f"/healthz every 10 ms while one client sends cold ~{args.tokens // 1000}K-token chats"
    table = Table(title=title)
    for col in ("gateway", "load", "healthz p50 ms", "p99 ms", "max ms", "chats", "chat p50 s", "errors"):
        table.add_column(col, justify="left" if col == "gateway" else "right")
    rows: list[dict[str, Any]] = []
    for (name, loaded), rs in runs.items():
        lat = [x for r in rs for x in r.healthz_ms]
        chat_s = [x for r in rs for x in r.chat_s]
        row = {
            "gateway": name,
            "loaded": loaded,
            "healthz_p50_ms": round(statistics.median(lat), 2),
            "healthz_p99_ms": round(percentile(sorted(lat), 99), 2),
            "healthz_max_ms": round(max(lat), 2),
            "chats": sum(r.chats for r in rs),
            "chat_p50_s": round(statistics.median(chat_s), 3) if chat_s else None,
            "errors": sum(r.errors for r in rs),
        }
        rows.append(row)
        table.add_row(
            name,
            "back to back" if loaded else "none",
            f"{row['healthz_p50_ms']:.2f}",
            f"{row['healthz_p99_ms']:.2f}",
            f"{row['healthz_max_ms']:.1f}",
            str(row["chats"]),
            "-" if row["chat_p50_s"] is None else f"{row['chat_p50_s']:.3f}",
            str(row["errors"]),
        )
    console.print(table)
    console.print(f"logs in {logs}")
    if args.json:
        write_json(args.json, {"rows": rows, "tokens": args.tokens, "seconds": args.seconds}, console)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench loopstall", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
