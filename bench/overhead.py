"""``prefixgate bench overhead``: what a router adds, client -> node vs client -> router -> node.

One simulated node with a zero-cost engine (``--profile instant``) serves every target, so
what remains is software: HTTP, parsing, rendering, hashing, routing, the extra hop. Targets:
``direct`` (the node's own OpenAI-compatible endpoint); prefixgate started as the peers are, with
the same worker flag and nothing else: ``prefixgate-http`` (``--worker-urls http://NODE``, the
node's OpenAI-compatible endpoint, as every peer reaches it) and ``prefixgate-grpc``
(``--worker-urls grpc://NODE``, the node's SMG engine protocol: token ids in and out, the
gateway rendering, tokenizing with the tokenizer it fetches from the engine, and detokenizing);
``prefixgate`` (the node over prefixgate's own protocol, ``--monolithic NODE``); and every
installed peer router (HTTP to the node), smg also over ``grpc://`` (``smg-grpc``). For each
cell (concurrent clients x prompt size x streaming or not) a closed loop of ``clients`` httpx
clients sends unique chat prompts (8 output tokens) for ``--seconds`` after a short warm-up,
and reports latency p50/p99 (whole response), TTFT p50/p99 (first SSE event with a choice),
req/s, errors, and the router's CPU time per request (utime + stime of its process group,
/proc) — the figure that transfers best to other machines. "Added" is the target's figure
minus ``direct``'s in the same cell.

Targets checked, against smg (the reference Rust gateway) in the same run, over HTTP workers
(``prefixgate-http`` against ``smg``) and over ``grpc://`` (``prefixgate-grpc`` against
``smg-grpc``): added p50 at 1 client (2 KB, JSON) at most 1.5 times smg's; streaming TTFT added
at 1 client (2 KB) at most 1.5 times smg's; CPU per request at 1 client (2 KB, JSON) at most
``TARGET_CPU_MS``; with ``--workers N``, req/s at 32 clients (2 KB, JSON) at least smg's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from prefixgate.backends.cli import whole_number
from prefixgate.bench import launch, stages
from prefixgate.bench.report import percentile, write_json
from prefixgate.bench.textgen import segment_text
from prefixgate.gateway.config import Settings
from prefixgate.gateway.ops import processes

CLIENTS = (1, 32, 256)
SIZES = (2_048, 262_144)
QUICK_CLIENTS = (1, 32)
QUICK_SIZES = (2_048,)
OUTPUT_TOKENS = 8
TURN_BYTES = 512  # an earlier turn of a conversation (`--history`)
# CPU per request at one client (2 KB, JSON) a gateway in front of the worker may cost, by how it
# reaches the worker; added latency and streaming TTFT may be at most ``TARGET_RATIO`` of smg's
TARGET_CPU_MS = {"http": 0.8, "grpc": 1.5}
TARGET_RATIO = 1.5
HTTP, GRPC, OWN = "prefixgate-http", "prefixgate-grpc", "prefixgate"
# the targets of the gateway --baseline-src and --baseline-python start
BASELINE, BASELINE_GRPC = "baseline-http", "baseline-grpc"
WORKERS, WORKERS_GRPC = "prefixgate-http-workers", "prefixgate-grpc-workers"  # --workers N's targets
FLOORS = {"floor": "app", "essentials": "essentials"}  # --floor's targets: bench.floor's factories


@dataclass(frozen=True, slots=True)
class Cell:
    clients: int
    prompt_bytes: int
    stream: bool
    output_tokens: int = OUTPUT_TOKENS  # each chat's max_tokens

    @property
    def name(self) -> str:
        size = f"{self.prompt_bytes // 1024} KB" if self.prompt_bytes >= 1024 else f"{self.prompt_bytes} B"
        return f"{'SSE' if self.stream else 'JSON'} {size} c={self.clients}"


@dataclass(slots=True)
class Sample:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Prompts:
    """Unique prompts of a given size: a unique tag first (no prefix is ever shared), then text.

    Before it, ``head``: the same messages in every request. ``system_bytes``: a system prompt of
    that size, as an application's fixed instructions; ``history_turns``: that many earlier turns
    (user and assistant by turns, ``TURN_BYTES`` each), as an agent's conversation so far. Their
    prefix is then shared by every request."""

    def __init__(self, system_bytes: int = 0, history_turns: int = 0) -> None:
        self._base: dict[int, str] = {}
        self.counter = 0
        self.head: list[dict[str, str]] = []
        if system_bytes > 0:
            self.head.append(
                {"role": "system", "content": segment_text(3, system_bytes // 4, "system", line_words=16)}
            )
        for turn in range(max(0, history_turns)):
            text = segment_text(100 + turn, TURN_BYTES // 4, "history", line_words=16)
            self.head.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})

    def make(self, size: int) -> str:
        if size not in self._base:
            self._base[size] = segment_text(7, max(1, size // 4), "overhead", line_words=16)
        self.counter += 1
        tag = f"[request {self.counter:09d}] "
        return tag + self._base[size][: max(0, size - len(tag))]


def body(
    prompt: str,
    stream: bool,
    model: str = launch.MODEL,
    head: Sequence[Mapping[str, str]] = (),
    max_tokens: int = OUTPUT_TOKENS,
) -> bytes:
    """A chat request: ``head`` (``Prompts.head``), then ``prompt`` as the user's message."""
    b: dict[str, Any] = {
        "model": model,
        "messages": [*head, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return orjson.dumps(b)


async def one(client: httpx.AsyncClient, payload: bytes, stream: bool, out: Sample) -> None:
    t0 = time.perf_counter()
    ttft = 0.0
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.error(f"HTTP {resp.status_code}")
                return
            if stream:
                done = False
                async for line in resp.aiter_lines():
                    if line.startswith("data: [DONE]"):
                        done = True
                    elif not ttft and line.startswith("data:") and orjson.loads(line[5:]).get("choices"):
                        ttft = time.perf_counter() - t0
                if not done:
                    out.error("stream without [DONE]")
                    return
            else:
                await resp.aread()
    except (httpx.HTTPError, orjson.JSONDecodeError) as e:
        out.error(type(e).__name__)
        return
    dt = time.perf_counter() - t0
    out.latencies.append(dt)
    out.ttfts.append(ttft or dt)


async def closed_loop(
    url: str,
    headers: Mapping[str, str],
    cell: Cell,
    seconds: float,
    max_requests: int,
    prompts: Prompts,
    timeout: float,
) -> Sample:
    """``cell.clients`` clients back to back for ``seconds`` (or ``max_requests``).

    Each client has its own keep-alive connection (its own ``httpx.AsyncClient``): one shared
    pool of hundreds of connections costs the client more CPU than the servers being measured.
    """
    out = Sample()
    budget = [max_requests]
    clients = [
        httpx.AsyncClient(
            base_url=url,
            headers=dict(headers),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=httpx.Timeout(timeout, connect=10.0),
            verify=False,  # plain HTTP on loopback: skip loading CA certificates 256 times
        )
        for _ in range(cell.clients)
    ]
    t0 = time.perf_counter()
    end = t0 + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < end and budget[0] > 0:
            budget[0] -= 1
            prompt = prompts.make(cell.prompt_bytes)
            chat = body(prompt, cell.stream, head=prompts.head, max_tokens=cell.output_tokens)
            await one(client, chat, cell.stream, out)

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in clients)), seconds + timeout + 5)
        out.wall_s = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return out


def cell_json(target: str, cell: Cell, s: Sample, cpu_s: float | None, node_cpu_s: float) -> dict[str, Any]:
    lat = sorted(s.latencies)
    ttft = sorted(s.ttfts)
    n = len(lat)
    out: dict[str, Any] = {
        "target": target,
        "clients": cell.clients,
        "prompt_bytes": cell.prompt_bytes,
        "stream": cell.stream,
        "ok": n,
        "errors": s.errors,
        "error_kinds": s.error_kinds,
        "wall_s": round(s.wall_s, 3),
        "req_per_s": round(n / s.wall_s, 1) if s.wall_s > 0 else 0.0,
        "p50_ms": round(percentile(lat, 50) * 1e3, 3),
        "p99_ms": round(percentile(lat, 99) * 1e3, 3),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 3),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 3),
        "node_cpu_ms_per_req": round(node_cpu_s * 1e3 / max(1, n + s.errors), 4),
    }
    out["cpu_ms_per_req"] = round(cpu_s * 1e3 / max(1, n + s.errors), 4) if cpu_s is not None else None
    return out


_CELL_KEYS = ("clients", "prompt_bytes")


def medians(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target, cell): the median of each figure over the rounds, errors summed."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["clients"], r["prompt_bytes"], r["stream"]), []).append(r)
    out = []
    for group in groups.values():
        row = dict(group[0])
        for k, v in row.items():
            if k in ("errors", "ok"):
                row[k] = sum(g[k] for g in group)
            elif (
                isinstance(v, float | int)
                and not isinstance(v, bool)
                and k not in ("clients", "prompt_bytes")
            ):
                vals = [g[k] for g in group if g.get(k) is not None]
                row[k] = round(statistics.median(vals), 4) if vals else None
        row["rounds"] = len(group)
        rates = [g["req_per_s"] for g in group]
        row["req_per_s_range"] = [min(rates), max(rates)]
        row.pop("round", None)
        out.append(row)
    return out


def spread_line(rows: Sequence[dict[str, Any]]) -> str | None:
    """How far the node alone (``direct``) moved from round to round, per cell: the machine's
    noise, against which the targets' medians are read (None: one round, or no ``direct``)."""
    parts = []
    for r in rows:
        low, high = r.get("req_per_s_range") or (None, None)
        if r["target"] == "direct" and r.get("rounds", 1) > 1 and low is not None and high:
            cell = Cell(r["clients"], r["prompt_bytes"], r["stream"]).name
            parts.append(f"{cell} {low:.0f}-{high:.0f} (±{50 * (high - low) / high:.0f} %)")
    return "the node alone (direct), req/s across rounds: " + "; ".join(parts) if parts else None


def add_deltas(rows: list[dict[str, Any]]) -> None:
    """``added_*_ms``: a target's figure minus ``direct``'s in the same cell (and round)."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("round"), r["clients"], r["prompt_bytes"], r["stream"])

    base = {key(r): r for r in rows if r["target"] == "direct"}
    for r in rows:
        b = base.get(key(r))
        for k in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
            r[f"added_{k}"] = round(r[k] - b[k], 3) if b is not None and r["target"] != "direct" else None


def _find(rows: Sequence[dict[str, Any]], target: str, clients: int, size: int, stream: bool) -> Any:
    for r in rows:
        if (r["target"], r["clients"], r["prompt_bytes"], r["stream"]) == (target, clients, size, stream):
            return r
    return None


def verdicts(
    rows: Sequence[dict[str, Any]], reference: str = "smg", ours: str = HTTP, cpu_ms: float | None = None
) -> dict[str, Any]:
    """``ours``'s targets against ``reference`` in the same run; None where a cell was not run.

    ``*_met``: the added p50 at one client and the streaming TTFT added at one client at most
    ``TARGET_RATIO`` times the reference's; req/s at 32 clients at least the reference's; CPU per
    request at one client (JSON) at most ``cpu_ms``."""
    small = min((r["prompt_bytes"] for r in rows), default=2048)

    def cell(target: str, clients: int, stream: bool, key: str) -> Any:
        r = _find(rows, target, clients, small, stream)
        return r.get(key) if r else None

    out: dict[str, Any] = {"target": ours, "reference": reference}
    for name, clients, stream, key, ratio in (
        ("added_p50_ms_1_client", 1, False, "added_p50_ms", TARGET_RATIO),
        ("stream_added_ttft_p50_ms_1_client", 1, True, "added_ttft_p50_ms", TARGET_RATIO),
        ("req_s_32_clients", 32, False, "req_per_s", None),
    ):
        mine, theirs = cell(ours, clients, stream, key), cell(reference, clients, stream, key)
        out[name] = mine
        out[f"{reference}_{name}"] = theirs
        met = None
        if mine is not None and theirs is not None:
            met = mine <= ratio * theirs if ratio is not None else mine >= theirs
        out[f"{name}_met"] = met
    cpu = cell(ours, 1, False, "cpu_ms_per_req")
    out["cpu_ms_per_req_1_client"] = cpu
    out[f"{reference}_cpu_ms_per_req_1_client"] = cell(reference, 1, False, "cpu_ms_per_req")
    out["cpu_target_ms"] = cpu_ms
    out["cpu_ms_per_req_1_client_met"] = None if cpu is None or cpu_ms is None else cpu <= cpu_ms
    every = [r["cpu_ms_per_req"] for r in rows if r["target"] == ours and r["prompt_bytes"] == small]
    out["cpu_ms_per_req_small_prompts"] = round(max(every), 4) if every else None
    return out


#: The verdicts a run reports: (name, our target, the reference, the CPU target's key). The floor
#: and the essentials (``--floor``) are judged by the ``http://`` targets: whether the libraries
#: under the gateway, alone or with the least a gateway request does, could meet them at all.
COMPARISONS = (
    ("http", HTTP, "smg", "http"),
    ("grpc", GRPC, "smg-grpc", "grpc"),
    ("http_workers", WORKERS, "smg", "http"),
    ("grpc_workers", WORKERS_GRPC, "smg-grpc", "grpc"),
    ("floor", "floor", "smg", "http"),
    ("essentials", "essentials", "smg", "http"),
)


def verdict_line(v: dict[str, Any], labels: Mapping[str, str]) -> str:
    """One line of a comparison's figures and whether each target is met."""

    def f(name: str, unit: str = " ms") -> str:
        mine, theirs, met = v.get(name), v.get(f"{v['reference']}_{name}"), v.get(f"{name}_met")
        mark = "" if met is None else (" (met)" if met else " (missed)")
        return f"{mine}{unit} against {theirs}{unit}{mark}"

    cpu = v["cpu_ms_per_req_1_client"]
    cpu_met = v["cpu_ms_per_req_1_client_met"]
    cpu_mark = "" if cpu_met is None else (" (met)" if cpu_met else " (missed)")
    return (
        f"{labels.get(v['target'], v['target'])} vs {labels.get(v['reference'], v['reference'])}: "
        f"added p50 at 1 client {f('added_p50_ms_1_client')}; "
        f"streaming TTFT added {f('stream_added_ttft_p50_ms_1_client')}; "
        f"req/s at 32 clients {f('req_s_32_clients', '')}; "
        f"CPU/request at 1 client {cpu} ms (target <= {v['cpu_target_ms']}){cpu_mark}"
    )


def render(
    rows: Sequence[dict[str, Any]],
    labels: Mapping[str, str],
    nodes: int = 1,
    output_tokens: int = OUTPUT_TOKENS,
) -> Table:
    pool = "1 node" if nodes == 1 else f"{nodes} nodes"
    title = f"router overhead ({pool}, instant engine, {output_tokens} output tokens), ms"
    t = Table(title=title, title_justify="left")
    cols = [
        "cell",
        "target",
        "p50",
        "p99",
        "+p50",
        "+p99",
        "TTFT p50",
        "+TTFT p50",
        "req/s",
        "CPU/req",
        "errors",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c in ("cell", "target") else "right")

    def f(v: Any, sign: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v:+.2f}" if sign else f"{v:.2f}"

    last = None
    for r in rows:
        cell = Cell(r["clients"], r["prompt_bytes"], r["stream"]).name
        t.add_row(
            cell if cell != last else "",
            labels.get(r["target"], r["target"]),
            f(r["p50_ms"]),
            f(r["p99_ms"]),
            f(r.get("added_p50_ms"), True),
            f(r.get("added_p99_ms"), True),
            f(r["ttft_p50_ms"]) if r["stream"] else "-",
            f(r.get("added_ttft_p50_ms"), True) if r["stream"] else "-",
            f"{r['req_per_s']:.0f}",
            f(r.get("cpu_ms_per_req")),
            str(r["errors"]),
        )
        last = cell
    return t


def baseline_gateway(args: argparse.Namespace) -> tuple[str, dict[str, str]] | None:
    """The interpreter and environment of the baseline gateway: ``--baseline-python`` (else this
    one) running ``--baseline-src`` (else what that interpreter has installed); None: no baseline."""
    if not (args.baseline_src or args.baseline_python):
        return None
    env = {"PYTHONPATH": args.baseline_src} if args.baseline_src else {}
    return args.baseline_python or sys.executable, env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peers",
        default=",".join(launch.PEERS),
        help="comma-separated peers to measure too: smg,sglang,vllm,litellm (default all installed; '' none)",
    )
    p.add_argument(
        "--peers-venv", default=str(launch.default_peers_dir()), help="directory of the peer venvs"
    )
    p.add_argument(
        "--clients", type=int, nargs="+", default=None, help=f"concurrent clients (default {CLIENTS})"
    )
    p.add_argument("--sizes", type=int, nargs="+", default=None, help=f"prompt bytes (default {SIZES})")
    p.add_argument("--modes", nargs="+", choices=("json", "stream"), default=["json", "stream"])
    add_head_arguments(p)
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 2)")
    p.add_argument("--max-requests", type=int, default=20_000, help="requests per cell at most")
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 and 32 clients, 2 KB, 0.4 s a cell, no peers"
    )
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every cell this many times, the targets in turn each time; the table gives medians",
    )
    p.add_argument(
        "--baseline-src",
        help="also measure a gateway run from this source tree (PYTHONPATH, e.g. an exported older "
        "commit) in the same run, interleaved with the current one",
    )
    p.add_argument(
        "--baseline-python",
        metavar="PYTHON",
        help="also measure a gateway run by this interpreter (a venv's python with prefixgate installed,"
        " e.g. a build with or without PGO), from --baseline-src when given; interleaved likewise",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="also measure prefixgate with --workers N (over HTTP and grpc://) beside its default",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="N",
        help="instant nodes behind every router (default 1): what a request costs as the pool grows; "
        "'direct' is the first node alone",
    )
    p.add_argument(
        "--output-tokens",
        type=whole_number("--output-tokens"),
        default=OUTPUT_TOKENS,
        metavar="N",
        help=f"each chat's max_tokens (default {OUTPUT_TOKENS}); with --stream-interval 1 a streamed chat"
        " is N chunks, so the CPU a request, less that of a short run, says what a streamed token costs",
    )
    add_stream_interval_argument(p)
    p.add_argument(
        "--page-size",
        type=_page_size,
        default=launch.NodeOptions().block_size,
        metavar="TOKENS",
        help="the nodes' KV page (default 64). SGLang's own default is 1: each stored token is a "
        "block of its own in the KV events a grpc:// gateway reads. At 1 the nodes' 300,000 "
        "blocks fill after some 375 unique 2 KB chats, and their removals come too",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure the floor (uvicorn and aiohttp relaying the chat to the node, nothing else) "
        "and the essentials (the relay plus the least a gateway request does, written lean): "
        "what the libraries under prefixgate cost on this machine",
    )
    p.add_argument(
        "--profile-out",
        help="sample prefixgate's measured cells with py-spy and write, into this directory, the raw "
        "stacks and the CPU by stage of the request path (bench.stages) per cell",
    )


def add_stream_interval_argument(p: argparse.ArgumentParser) -> None:
    """``--stream-interval``: the tokens a streamed chunk from the instant nodes holds at most."""
    default = launch.NodeOptions().stream_interval
    p.add_argument(
        "--stream-interval",
        type=whole_number("a stream interval"),
        default=default,
        metavar="TOKENS",
        help=f"tokens a streamed chunk from the nodes holds at most (default {default}; 1: a chunk a"
        " token, as SGLang streams by default)",
    )


def add_head_arguments(p: argparse.ArgumentParser) -> None:
    """``--system-prompt`` and ``--history``: what every request starts with (``Prompts.head``)."""
    p.add_argument(
        "--system-prompt",
        type=int,
        default=0,
        metavar="BYTES",
        help="every request starts with the same system prompt of this many bytes (default: none, "
        "no prefix shared)",
    )
    p.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="TURNS",
        help=f"and with the same conversation of this many earlier turns ({TURN_BYTES} bytes each; "
        "default none), as an agent's",
    )


_page_size = whole_number("a page")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


@contextlib.contextmanager
def _profiled(
    out: str | None, target: str, cell: Cell, router: processes.Child | None, rnd: int = 0
) -> Iterator[stages.Sampler | None]:
    """A py-spy sampler on a prefixgate gateway during one measured cell (``--profile-out``)."""
    if not out or target not in (HTTP, GRPC, OWN, BASELINE, BASELINE_GRPC) or router is None:
        yield None
        return
    name = _slug(f"{target} {cell.name}") + (f"-r{rnd + 1}" if rnd else "")
    with stages.Sampler(router.pid, Path(out) / f"{name}.raw") as sampler:
        yield sampler


def _write_profile(sampler: stages.Sampler, out: Path, requests: int, console: Console) -> dict[str, Any]:
    rep = sampler.report(requests)
    write_json(str(sampler.out.with_suffix(".json")), rep, console)
    if rep.get("error"):
        console.print(f"[yellow]profile[/]: {rep['error']}")
    return rep


def render_stages(profiles: Mapping[str, Any]) -> Table:
    """CPU per request by stage, one column per profiled cell (the event loop thread's share)."""
    t = Table(title="prefixgate CPU per request by stage (py-spy samples x main-thread CPU), ms")
    names = [n for n, p in profiles.items() if p.get("stages")]
    t.add_column("stage")
    for n in names:
        t.add_column(n.removeprefix("prefixgate "), justify="right")
    order: list[str] = []
    for n in names:
        order += [s for s in profiles[n]["stages"] if s not in order]
    for s in order:
        t.add_row(s, *(f"{profiles[n]['stages'].get(s, {}).get('ms_per_req', 0.0):.3f}" for n in names))
    threads = sorted({k for n in names for k in profiles[n].get("cpu_ms_per_req_by_thread", {})})
    for th in threads:
        t.add_row(
            f"thread {th}",
            *(f"{profiles[n].get('cpu_ms_per_req_by_thread', {}).get(th, 0.0):.3f}" for n in names),
        )
    return t


def _loop_run(main: Coroutine[Any, Any, Sample]) -> Sample:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(130, Console().width))
    clients = args.clients or (QUICK_CLIENTS if args.quick else CLIENTS)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    seconds = args.seconds or (0.4 if args.quick else 2.0)
    warmup = min(0.5, seconds / 2)
    peer_names = [] if args.quick and args.peers == ",".join(launch.PEERS) else args.peers.split(",")
    skipped: dict[str, str] = {}
    peers: list[str] = []
    for name in (x.strip() for x in peer_names):
        if name:
            reason = launch.peer_missing(name, Path(args.peers_venv))
            if reason:
                skipped[name] = reason
                console.print(f"[yellow]skipped[/] {name}: {reason}")
            else:
                peers.append(name)
    cells = [
        Cell(c, s, m == "stream", args.output_tokens) for m in args.modes for s in sizes for c in clients
    ]
    logs = launch.run_dir("overhead")
    node_opts = launch.NodeOptions(
        profile="instant",
        capacity_blocks=300_000,
        max_queue=4096,
        max_decode_streams=4096,
        block_size=args.page_size,
        stream_interval=args.stream_interval,
    )
    labels = {
        "direct": "direct (node)",
        HTTP: "prefixgate (http://)",
        GRPC: "prefixgate (grpc://)",
        OWN: "prefixgate (own protocol)",
        "smg": "smg (http://)",
        "smg-grpc": "smg (grpc://)",
        "sglang": "sglang-router",
        "vllm": "vllm-router",
        "litellm": "LiteLLM",
        WORKERS: f"prefixgate (http://) --workers {args.workers}",
        WORKERS_GRPC: f"prefixgate (grpc://) --workers {args.workers}",
        BASELINE: "prefixgate baseline (http://)",
        BASELINE_GRPC: "prefixgate baseline (grpc://)",
        "floor": "floor (uvicorn + aiohttp relay)",
        "essentials": "essentials (relay + lean gateway work)",
    }
    workers = [WORKERS, WORKERS_GRPC] if args.workers else []
    baseline_run = baseline_gateway(args)
    baseline = [BASELINE, BASELINE_GRPC] if baseline_run else []
    floors = list(FLOORS) if args.floor else []
    own_target = [OWN]
    block = Settings().block_size  # the gateway's, as every gateway here is started
    if args.page_size != block:
        # prefixgate's own protocol carries the gateway's block hashes, one a node page: a node
        # whose page is not the gateway's block refuses every request
        own_target = []
        skipped[OWN] = f"its own protocol needs the nodes' page to be the gateway's block ({block})"
        console.print(f"[yellow]skipped[/] {labels[OWN]}: {skipped[OWN]}")
    targets = ["direct", HTTP, GRPC, *baseline, *workers, *own_target, *floors, *peers]
    targets += ["smg-grpc"] if "smg" in peers else []
    console.print(
        f"overhead: {len(cells)} cells x {len(targets)} targets x {args.rounds} rounds, "
        f"{seconds:g} s a cell; logs in {logs}"
    )
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    failed: dict[str, str] = {}
    prompts = Prompts(args.system_prompt, args.history)
    nodes = launch.start_nodes(max(1, args.nodes), node_opts, logs)
    node = nodes[0]
    http_workers = [n.url for n in nodes]
    grpc_workers = [f"grpc://{n.address}" for n in nodes]
    own = [a for n in nodes for a in ("--monolithic", n.address)]
    baseline_python, baseline_env = baseline_run or (sys.executable, {})
    # prefixgate is started as the peers are: the worker flag, nothing else (its defaults)
    gateways: dict[str, tuple[list[str], dict[str, str]]] = {
        HTTP: (["--worker-urls", *http_workers], {}),
        GRPC: (["--worker-urls", *grpc_workers], {}),
        OWN: (own, {}),
        WORKERS: (["--worker-urls", *http_workers, "--workers", str(args.workers)], {}),
        WORKERS_GRPC: (["--worker-urls", *grpc_workers, "--workers", str(args.workers)], {}),
        BASELINE: (["--worker-urls", *http_workers], baseline_env),
        BASELINE_GRPC: (["--worker-urls", *grpc_workers], baseline_env),
    }
    routers: dict[str, processes.Child | None] = {"direct": None}
    try:
        for target in targets[1:]:
            try:
                if target in gateways:
                    flags, env = gateways[target]
                    python = baseline_python if target in baseline else sys.executable
                    routers[target] = launch.start_gateway(
                        logs, name=target, env=env, extra_args=flags, python=python
                    )
                elif target in FLOORS:
                    routers[target] = launch.start_floor(logs, target, FLOORS[target], node.url)
                elif target == "smg-grpc":
                    routers[target] = launch.start_peer("smg", Path(args.peers_venv), grpc_workers, logs)
                else:
                    routers[target] = launch.start_peer(target, Path(args.peers_venv), http_workers, logs)
            except (OSError, RuntimeError, TimeoutError) as e:
                failed[target] = str(e).splitlines()[0][:300]
                console.print(f"[red]failed[/] {target}: {failed[target]}")
        for rnd in range(args.rounds):
            # Interleaved: every target in turn for each cell, so a machine whose speed drifts
            # (other load) drifts for all of them alike; the order rotates with the round, so no
            # target always follows the same one (the node's KV events reach every gateway).
            order = list(routers.items())
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for cell in cells:
                for target, router in order:
                    url = router.url if router else node.url
                    headers = router.headers if router else {}
                    _loop_run(closed_loop(url, headers, cell, warmup, 1000, prompts, args.request_timeout))
                    cpu0 = launch.router_cpu_seconds(router) if router else None
                    ncpu0 = sum(launch.cpu_seconds(n.pid) for n in nodes)
                    with _profiled(args.profile_out, target, cell, router, rnd) as sampler:
                        sample = _loop_run(
                            closed_loop(
                                url, headers, cell, seconds, args.max_requests, prompts, args.request_timeout
                            )
                        )
                    if sampler is not None:
                        key = f"{target} {cell.name}" + (f" r{rnd + 1}" if args.rounds > 1 else "")
                        profiles[key] = _write_profile(
                            sampler, Path(args.profile_out), len(sample.latencies) + sample.errors, console
                        )
                    cpu = launch.router_cpu_seconds(router) - cpu0 if router and cpu0 is not None else None
                    ncpu = sum(launch.cpu_seconds(n.pid) for n in nodes) - ncpu0
                    rows.append(cell_json(target, cell, sample, cpu, ncpu))
                    rows[-1]["round"] = rnd + 1
                    console.print(
                        f"  {labels.get(target, target)} {cell.name}: p50 {rows[-1]['p50_ms']:.2f} ms, "
                        f"{rows[-1]['req_per_s']:.0f} req/s, errors {sample.errors}"
                    )
    finally:
        processes.stop_all([r for r in routers.values() if r is not None], grace=3.0)
        processes.stop_all(nodes, grace=3.0)
    add_deltas(rows)
    per_round = rows
    rows = medians(rows) if args.rounds > 1 else rows
    rows.sort(key=lambda r: (r["stream"], r["prompt_bytes"], r["clients"]))
    console.print(render(rows, labels, len(nodes), args.output_tokens))
    judged = {
        name: verdicts(rows, reference=ref, ours=ours, cpu_ms=TARGET_CPU_MS[cpu])
        for name, ours, ref, cpu in COMPARISONS
        if any(r["target"] == ours for r in rows)
    }
    for v in judged.values():
        console.print(verdict_line(v, labels))
    noise = spread_line(rows)
    if noise:
        console.print(noise)
    report = {
        "config": {
            "engine_profile": "instant",
            "output_tokens": args.output_tokens,
            "stream_interval": args.stream_interval,
            "clients": list(clients),
            "prompt_bytes": list(sizes),
            "system_prompt_bytes": args.system_prompt,
            "history_turns": args.history,
            "modes": list(args.modes),
            "seconds_per_cell": seconds,
            "warmup_s": warmup,
            "keepalive": True,
            "quick": bool(args.quick),
            "rounds": args.rounds,
            "baseline_src": args.baseline_src,
            "baseline_python": args.baseline_python,
            "workers": args.workers,
            "nodes": len(nodes),
            "page_size": args.page_size,
            "peers": {t: launch.PEER_VERSIONS[t] for t in peers},
        },
        "cells": rows,
        "targets": judged,
        **({"cells_by_round": per_round} if args.rounds > 1 else {}),
        "skipped": skipped,
        "failed": failed,
    }
    if profiles:
        report["profiles"] = profiles
        console.print(render_stages(profiles))
    if args.json_out:
        write_json(args.json_out, report, console)
    return 0 if rows else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench overhead", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
