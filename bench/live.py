"""Live replay: send a workload to a running OpenAI-compatible server over real HTTP.

``prefixgate bench replay --mode live --url URL`` drives a gateway (or any OpenAI-compatible
endpoint: a node's ``--http-port``, a peer router) with the requests of a workload
(``Workload.openai_body``), streaming, with ``stream_options.include_usage``:

- arrivals keep the workload's (already time-compressed) arrival times, at most ``--clients``
  requests in flight (a request whose turn comes while every client is busy waits, and its
  lateness is reported); ``--closed-loop`` instead keeps ``--clients`` requests in flight
  back to back;
- dispatching stops after ``--duration`` seconds (or when the workload ends); requests still
  in flight get ``--request-timeout`` seconds to finish;
- TTFT is the time from sending to the first SSE event that carries a choice; hit rate is
  ``usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens`` over successful requests;
- output is capped at ``--max-output-tokens`` (default 32): this measures routing, prefill
  and time to first token, not decode throughput, and keeps the client's CPU out of the way.

The report has the simulator's shape, ``{"policies": {LABEL: {...}}, "bound": {...}}``, the
figures of ``bench.report.PolicySummary`` plus ``errors``, ``req_per_s``, ``latency_*`` and
``late_p99_s``; ``imbalance`` is max/mean of requests per node when the server names the node
(``x-prefixgate-prefill-node``/``-decode-node``/``x-prefixgate-node`` headers), else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from prefixgate.bench.report import Outcome, percentile, summarize
from prefixgate.bench.simulator import global_lru_bound
from prefixgate.bench.workloads import Request, Workload

DEFAULT_MODEL = "prefixgate-sim"
NODE_HEADERS = ("x-prefixgate-prefill-node", "x-prefixgate-decode-node", "x-prefixgate-node")


@dataclass(frozen=True, slots=True)
class LiveOptions:
    url: str
    model: str = DEFAULT_MODEL
    clients: int = 64  # requests in flight at most
    duration_s: float = 60.0  # stop dispatching after this long
    closed_loop: bool = False
    max_output_tokens: int | None = 32
    request_timeout_s: float = 120.0
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: bool = True
    keepalive: bool = True
    label: str = "live"


@dataclass(slots=True)
class Sent:
    """What happened to one request."""

    index: int
    status: int = 0  # HTTP status; 0 = no response
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    node: str = ""
    route: str = ""
    late_s: float = 0.0  # dispatched this long after its arrival time (all clients busy)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass(slots=True)
class LiveRun:
    label: str
    records: list[Sent]
    wall_s: float
    due: int  # requests whose arrival fell inside the window (arrival mode) or that were sent
    sent_requests: list[Request] = field(default_factory=list)


def base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/``, ``http://h:p/v1`` -> ``http://h:p``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_payload(workload: Workload, req: Request, opts: LiveOptions) -> tuple[str, bytes]:
    path, body = workload.openai_body(req, opts.model, stream=opts.stream)
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    cap = opts.max_output_tokens
    if cap:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        body[key] = max(1, min(int(body.get(key) or cap), cap))
    return path, orjson.dumps(body)


def _usage(rec: Sent, usage: Any) -> None:
    if isinstance(usage, Mapping):
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0


def _node_of(headers: httpx.Headers) -> tuple[str, str]:
    route = headers.get("x-prefixgate-route", "")
    for h in NODE_HEADERS:
        v = headers.get(h)
        if v:
            return v, route
    return "", route


async def send(client: httpx.AsyncClient, path: str, payload: bytes, rec: Sent, stream: bool) -> None:
    """POST one request and fill ``rec``; never raises (errors are recorded)."""
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", path, content=payload, headers={"content-type": "application/json"}
        ) as resp:
            rec.status = resp.status_code
            rec.node, rec.route = _node_of(resp.headers)
            if resp.status_code != 200:
                text = (await resp.aread())[:200].decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text}"
                return
            if not stream:
                obj = orjson.loads(await resp.aread())
                rec.ttft_s = time.perf_counter() - t0
                _usage(rec, obj.get("usage"))
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = orjson.loads(data)
                if "error" in obj and not obj.get("choices"):
                    rec.error = "stream error: " + str(obj["error"])[:200]
                    return
                if not rec.ttft_s and obj.get("choices"):
                    rec.ttft_s = time.perf_counter() - t0
                if obj.get("usage"):
                    _usage(rec, obj["usage"])
            if not rec.ttft_s:
                rec.error = "stream ended without a token"
    except (httpx.HTTPError, orjson.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {str(e)[:160]}"
    except asyncio.CancelledError:
        rec.error = "cancelled: still running at the end of the replay"
        raise
    finally:
        rec.latency_s = time.perf_counter() - t0


def make_client(opts: LiveOptions) -> httpx.AsyncClient:
    headers = dict(opts.headers)
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    keep = opts.clients if opts.keepalive else 0
    return httpx.AsyncClient(
        base_url=base_url(opts.url),
        headers=headers,
        timeout=httpx.Timeout(opts.request_timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=opts.clients, max_keepalive_connections=keep),
    )


async def replay(workload: Workload, opts: LiveOptions) -> LiveRun:
    """Send the workload's requests to ``opts.url``; bounded in time and concurrency."""
    reqs = workload.requests
    records: list[Sent] = []
    sent: list[Request] = []
    tasks: set[asyncio.Task[None]] = set()
    async with make_client(opts) as client:

        async def one(req: Request, rec: Sent) -> None:
            path, payload = request_payload(workload, req, opts)
            await send(client, path, payload, rec, opts.stream)

        t0 = time.perf_counter()
        end = t0 + opts.duration_s
        if opts.closed_loop:
            pending = iter(reqs)

            async def worker() -> None:
                for req in pending:
                    if time.perf_counter() >= end:
                        return
                    rec = Sent(req.index)
                    records.append(rec)
                    sent.append(req)
                    await one(req, rec)

            workers = [asyncio.create_task(worker()) for _ in range(max(1, opts.clients))]
            await _drain(workers, opts.duration_s + opts.request_timeout_s)
        else:
            sem = asyncio.Semaphore(max(1, opts.clients))
            first = reqs[0].arrival_s if reqs else 0.0

            async def run(req: Request, rec: Sent) -> None:
                try:
                    await one(req, rec)
                finally:
                    sem.release()

            for req in reqs:
                due = t0 + (req.arrival_s - first)
                if due >= end:
                    break
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await sem.acquire()
                rec = Sent(req.index, late_s=max(0.0, time.perf_counter() - due))
                records.append(rec)
                sent.append(req)
                task = asyncio.create_task(run(req, rec))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await _drain(list(tasks), opts.request_timeout_s)
        wall = time.perf_counter() - t0
    for rec in records:
        if not rec.latency_s and not rec.error:
            rec.error = "cancelled: not started before the end of the replay"
    return LiveRun(opts.label, records, wall, len(records), sent)


async def _drain(tasks: Sequence[asyncio.Task[None]], timeout: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    for t in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await t


# -- figures --------------------------------------------------------------------------------------


def summary(run: LiveRun, node_work: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The figures of one run (``PolicySummary`` fields plus live ones).

    ``node_work``: per-node busy measure (e.g. computed prompt tokens read from the nodes);
    without it, requests per node as named by response headers.
    """
    ok = [r for r in run.records if r.ok]
    outcomes = [
        Outcome(r.index, r.node, r.route or "live", r.prompt_tokens, r.cached_tokens, 0.0, 0.0, 0.0, r.ttft_s)
        for r in ok
    ]
    per_node = Counter(r.node for r in ok if r.node)
    work = dict(node_work) if node_work else {k: float(v) for k, v in per_node.items()}
    nodes = sorted(set(work) | set(per_node))
    s = summarize(outcomes, nodes, work, run.wall_s)
    s.wall_s = run.wall_s
    out = s.as_json()
    for key in ("queue_mean_s", "queue_p99_s", "utilisation", "busy_s_per_node", "makespan_s"):
        out.pop(key, None)
    if node_work:
        out["work_per_node"] = {k: round(v, 3) for k, v in work.items()}
    if not per_node:  # the server does not say which node served a request
        out["requests_per_node"] = {}
    latency = sorted(r.latency_s for r in ok)
    late = sorted(r.late_s for r in run.records)
    errors = Counter(_error_kind(r) for r in run.records if not r.ok)
    out.update(
        {
            "sent": len(run.records),
            "ok": len(ok),
            "errors": len(run.records) - len(ok),
            "error_kinds": dict(errors.most_common(8)),
            "req_per_s": round(len(ok) / run.wall_s, 3) if run.wall_s > 0 else 0.0,
            "latency_p50_s": round(percentile(latency, 50), 6),
            "latency_p99_s": round(percentile(latency, 99), 6),
            "late_p99_s": round(percentile(late, 99), 6),
        }
    )
    return out


def _error_kind(r: Sent) -> str:
    if r.status and r.status != 200:
        return f"HTTP {r.status}"
    return r.error.split(":", 1)[0] or "error"


def bound(requests: Iterable[Request], capacity_blocks: int, block_size: int) -> dict[str, float]:
    """Hit rate of one global LRU cache of the same capacity over the requests actually sent."""
    b = global_lru_bound(list(requests), capacity_blocks, block_size)
    return {k: round(v, 6) for k, v in b.items()}


def render(
    title: str,
    results: Mapping[str, Mapping[str, Any]],
    extra: Sequence[str] = (),
    extra_labels: Sequence[str] = (),
) -> Table:
    """One row per target: hit rate, TTFT, throughput, errors (+ ``extra`` keys as columns)."""
    t = Table(title=title, title_justify="left")
    cols = ["target", "ok", "errors", "hit rate", "TTFT p50", "p95", "p99", "latency p50", "req/s"]
    cols += ["imbalance", "req/node", *(extra_labels or extra)]
    for c in cols:
        t.add_column(c, justify="left" if c in ("target", "req/node") else "right")
    for name, s in results.items():
        row = [
            name,
            str(s.get("ok", 0)),
            str(s.get("errors", 0)),
            f"{s.get('hit_rate', 0.0) * 100:.1f} %",
            f"{s.get('ttft_p50_s', 0.0):.3f}",
            f"{s.get('ttft_p95_s', 0.0):.3f}",
            f"{s.get('ttft_p99_s', 0.0):.3f}",
            f"{s.get('latency_p50_s', 0.0):.3f}",
            f"{s.get('req_per_s', 0.0):.1f}",
            f"{s.get('imbalance', 1.0):.2f}",
            "/".join(str(v) for v in (s.get("requests_per_node") or {}).values()) or "-",
        ]
        row += [str(s.get(k, "")) for k in extra]
        t.add_row(*row)
    return t


# -- ``prefixgate bench replay --mode live`` ---------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The live-only flags of ``bench replay`` (the workload flags are replay's own)."""
    g = p.add_argument_group("live mode (--mode live)")
    g.add_argument("--url", help="base URL of the server to drive, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--clients", type=int, default=64, help="requests in flight at most (default 64)")
    g.add_argument("--duration", type=float, default=60.0, help="stop sending after this many seconds")
    g.add_argument(
        "--closed-loop", action="store_true", help="ignore arrival times: keep --clients requests in flight"
    )
    g.add_argument(
        "--max-output-tokens", type=int, default=32, help="cap every request's max_tokens (0: no cap)"
    )
    g.add_argument("--model", default=DEFAULT_MODEL, help="model name to send")
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request at most")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = latency)")
    g.add_argument("--no-keepalive", action="store_true", help="a new connection for every request")
    g.add_argument("--label", default=None, help="row name in the table and JSON (default: the URL)")


def options_from_args(args: argparse.Namespace) -> LiveOptions:
    if not args.url:
        raise ValueError("--mode live needs --url (e.g. http://127.0.0.1:8000/v1)")
    return LiveOptions(
        url=args.url,
        model=args.model,
        clients=args.clients,
        duration_s=args.duration,
        closed_loop=args.closed_loop,
        max_output_tokens=args.max_output_tokens or None,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        stream=not args.no_stream,
        keepalive=not args.no_keepalive,
        label=args.label or base_url(args.url),
    )


def run_replay(workload: Workload, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Replay ``workload`` live against ``--url``; print the table; return the report."""
    opts = options_from_args(args)
    mode = "closed loop" if opts.closed_loop else "arrival times"
    console.print(
        f"[bold]{workload.description}[/]: live against {opts.url}, {mode}, "
        f"at most {opts.clients} in flight, {opts.duration_s:g} s, "
        f"output capped at {opts.max_output_tokens or 'no cap'} tokens"
    )
    run = asyncio.run(replay(workload, opts))
    result = summary(run)
    console.print(render(f"{workload.name}: live replay", {opts.label: result}, extra=("late_p99_s",)))
    capacity = max(1, args.capacity_tokens // workload.block_size)
    return {
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "requests_sent": len(run.records),
            "prompt_tokens_sent": sum(r.prompt_tokens for r in run.sent_requests),
            **workload.params,
        },
        "config": {
            "mode": "live",
            "url": opts.url,
            "clients": opts.clients,
            "duration_s": opts.duration_s,
            "closed_loop": opts.closed_loop,
            "max_output_tokens": opts.max_output_tokens,
            "stream": opts.stream,
            "keepalive": opts.keepalive,
            "capacity_tokens": args.capacity_tokens,
        },
        "policies": {opts.label: result},
        "bound": bound(run.sent_requests, capacity, workload.block_size),
    }
