"""Does a long cold prompt hold up everything else on the gateway?

One client sends cold chats of about ``--tokens`` tokens back to back through a gateway in front
of one ``grpc://`` worker (the SMG engine protocol: the gateway renders the chat template and
tokenizes with the engine's tokenizer, which it fetches from the engine), while ``GET /healthz`` is polled
every 10 ms. ``/healthz`` does no work of its own, so its latency is how long the event loop
was busy with something else. Each chat's text is new (random words), so neither the segment
cache nor the index helps. Measured quiet (no chats) and loaded, for this checkout and, with
``--baseline-src``, another one, interleaved in rounds.

``--clients N`` adds N clients streaming cold ~1K-token chats (``--think`` seconds apart) through
the same gateway in both phases: their time to the first token, quiet and beside the long chats,
is what every other user of a gateway sees while one long document passes. ``--workers N`` also
measures this checkout with N gateway workers (the long chats' connection is one worker's; the
other clients' connections go to whichever worker accepts them). ``--variant LABEL:VAR=VALUE``
measures this checkout once more with those settings in its environment (for instance
``threads:PREFIXGATE_TOKENIZER_PROCESSES=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.bench import launch
from prefixgate.bench.report import percentile, write_json
from prefixgate.gateway.ops import processes

POLL_S = 0.010
WORDS = ("alpha", "delta", "prefill", "decode", "gateway", "token", "cache", "section", "window", "page")


SMALL_TOKENS = 1_000


@dataclass
class Run:
    healthz_ms: list[float] = field(default_factory=list)
    chats: int = 0
    chat_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)  # the small chats' first token
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


async def small_chats(url: str, until: float, seed: int, think: float, out: Run) -> None:
    """Streamed cold ~1K-token chats back to back (``think`` s apart) on a connection of their
    own: the time to the first content chunk of each."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60) as client:
        while time.monotonic() < until:
            body = {
                "model": launch.MODEL,
                "messages": [{"role": "user", "content": chat_text(rng, SMALL_TOKENS)}],
                "max_tokens": 4,
                "stream": True,
            }
            t = time.perf_counter()
            first = None
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content"' in line:
                        first = time.perf_counter() - t
                ok = r.status_code == 200
            if ok and first is not None:
                out.ttft_ms.append(first * 1000)
            else:
                out.errors += 1
            await asyncio.sleep(think)


async def _polled(url: str, seconds: float) -> Run:
    out = Run()
    async with httpx.AsyncClient(timeout=30) as poller:
        await poll(poller, url, time.monotonic() + seconds, out)
    return out


async def _sent(url: str, seconds: float, bodies: list[bytes]) -> Run:
    out = Run()
    async with httpx.AsyncClient(timeout=120) as sender:
        await chats(sender, url, time.monotonic() + seconds, bodies, out)
    return out


async def _small(url: str, seconds: float, clients: int, think: float, seed: int) -> Run:
    out = Run()
    until = time.monotonic() + seconds
    await asyncio.gather(*(small_chats(url, until, seed * 1000 + i, think, out) for i in range(clients)))
    return out


def _in_process(job: str, *args: Any) -> Run:
    """One part of a measurement, in a process of its own (``measure``)."""
    jobs: dict[str, Callable[..., Coroutine[Any, Any, Run]]] = {
        "poll": _polled,
        "chats": _sent,
        "small": _small,
    }
    return asyncio.run(jobs[job](*args))


def measure(
    url: str, seconds: float, bodies: list[bytes], clients: int = 0, think: float = 0.1, seed: int = 0
) -> Run:
    """``/healthz`` polled for ``seconds``, while ``bodies`` (if any) are sent one at a time and
    ``clients`` small chats' clients send theirs. Each of the three runs in a process of its
    own: on one event loop, the small chats' clients (making and reading their requests) and the
    sender delay the poller's own reads, which would count as the gateway's latency."""
    parts: list[tuple[str, tuple[Any, ...]]] = [("poll", (url, seconds))]
    if bodies:
        parts.append(("chats", (url, seconds, bodies)))
    if clients:
        parts.append(("small", (url, seconds, clients, think, seed)))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(parts), mp_context=context) as pool:
        # every process started and warm (imports done) before any part begins
        list(pool.map(_warm, range(len(parts))))
        futures = [pool.submit(_in_process, job, *args) for job, args in parts]
        results = [f.result() for f in futures]
    out = Run()
    for r in results:
        out.healthz_ms += r.healthz_ms
        out.chats += r.chats
        out.chat_s += r.chat_s
        out.ttft_ms += r.ttft_ms
        out.errors += r.errors
    return out


def _warm(_: int) -> None:
    tokens_a_word()  # the small chats' text needs it: loaded before the measurement
    time.sleep(0.5)  # long enough for the pool to start every process before the work is handed out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=124_000, help="tokens a chat (default 124000)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds a measurement (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--baseline-src", default="", help="another checkout's source to measure beside this one")
    p.add_argument("--json", default="", help="write the figures to this file")
    p.add_argument(
        "--clients", type=int, default=0, help="clients streaming cold ~1K-token chats meanwhile (default 0)"
    )
    p.add_argument("--think", type=float, default=0.1, help="seconds between a client's chats (0.1)")
    p.add_argument("--workers", type=int, default=0, help="also measure this checkout with N gateway workers")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="also measure this checkout with these environment variables (settings), as LABEL",
    )


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """``LABEL:VAR=VALUE,VAR=VALUE`` -> the label and the environment it adds."""
    label, sep, assignments = spec.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
    if not (label and sep and env):
        raise ValueError(f"--variant {spec!r}: use LABEL:VAR=VALUE[,VAR=VALUE]")
    return label, env


def run(args: argparse.Namespace) -> int:
    console = Console()
    logs = launch.run_dir("loopstall")
    # the node's own pace is not what is measured: it answers a 124K-token prefill quickly
    node_opts = launch.NodeOptions(time_scale=0.01, max_queue=64, max_concurrency=4, http=False)
    node = launch.start_nodes(1, node_opts, logs)[0]
    targets: dict[str, processes.Child] = {}
    try:
        # the worker flag and nothing else: the gateway fetches the engine's tokenizer itself
        worker = ["--worker-urls", f"grpc://{node.address}"]
        targets["this checkout"] = launch.start_gateway(logs, extra_args=worker)
        if args.workers > 1:
            targets[f"this checkout, {args.workers} workers"] = launch.start_gateway(
                logs, name="workers", extra_args=[*worker, "--workers", str(args.workers)]
            )
        for i, spec in enumerate(args.variant):
            label, env = variant(spec)
            targets[label] = launch.start_gateway(logs, name=f"variant-{i}", env=env, extra_args=worker)
        if args.baseline_src:
            env = {"PYTHONPATH": args.baseline_src}
            targets["baseline"] = launch.start_gateway(logs, name="baseline", env=env, extra_args=worker)
        runs: dict[tuple[str, bool], list[Run]] = {}
        for rnd in range(args.rounds):
            for name, child in targets.items():
                for loaded in (False, True):
                    # more than one chat can be sent in the time (each takes 0.2 s or more)
                    count = int(args.seconds / 0.1) if loaded else 0
                    bodies = chat_bodies(count, args.tokens, seed=rnd * 7 + len(runs) + 1)
                    r = measure(child.url, args.seconds, bodies, args.clients, args.think, seed=rnd)
                    runs.setdefault((name, loaded), []).append(r)
    finally:
        for child in targets.values():
            child.stop()
        node.stop()
    title = f"/healthz every 10 ms while one client sends cold ~{args.tokens // 1000}K-token chats"
    table = Table(title=title)
    cols = ["gateway", "load", "healthz p50 ms", "p99 ms", "max ms", "chats", "chat p50 s"]
    if args.clients:
        cols += [f"{args.clients} clients' TTFT p50 ms", "p99 ms", "x quiet p99"]
    for col in (*cols, "errors"):
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
        cells = [
            name,
            "back to back" if loaded else "none",
            f"{row['healthz_p50_ms']:.2f}",
            f"{row['healthz_p99_ms']:.2f}",
            f"{row['healthz_max_ms']:.1f}",
            str(row["chats"]),
            "-" if row["chat_p50_s"] is None else f"{row['chat_p50_s']:.3f}",
        ]
        if args.clients:
            ttft = sorted(x for r in rs for x in r.ttft_ms)
            quiet = sorted(x for r in runs.get((name, False), []) for x in r.ttft_ms)
            row["small_ttft_p50_ms"] = round(statistics.median(ttft), 2) if ttft else None
            row["small_ttft_p99_ms"] = round(percentile(ttft, 99), 2) if ttft else None
            row["small_ttft_p99_vs_quiet"] = (
                round(percentile(ttft, 99) / percentile(quiet, 99), 2) if ttft and quiet else None
            )
            cells += [
                f"{row['small_ttft_p50_ms']}",
                f"{row['small_ttft_p99_ms']}",
                f"{row['small_ttft_p99_vs_quiet']}",
            ]
        rows.append(row)
        table.add_row(*cells, str(row["errors"]))
    console.print(table)
    console.print(f"logs in {logs}")
    if args.json:
        figures = {"rows": rows, "tokens": args.tokens, "seconds": args.seconds, "clients": args.clients}
        write_json(args.json, figures, console)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench loopstall", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
