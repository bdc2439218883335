"""``prefixgate bench chaos``: steady mixed load on a 2-prefill + 4-decode cluster while nodes and
Redis fail on a seeded schedule; what failed, and what the gateway kept afterwards.

Per protocol (our own, then the nodes as ``grpc://`` workers), the cluster of the fault drills
(``bench.drill_cluster``) with the gateway on a Redis of its own (``--redis``):

- load: ``--concurrency`` clients back to back for ``--seconds``, each request drawn (seeded)
  from four kinds: a short chat, a streamed chat, a long document shared with other requests
  plus a question (the shared-prefix case), and a chat with ``n`` = 2. Every request has a
  timeout and the number sent is bounded. A request is ok when it is answered 200 with every
  choice finished and, streamed, without an error event and with its ``[DONE]``: a stream the
  client sees break is a failure even when it began well;
- schedule (``plan``, pure): faults spread over the first 80 % of the run, each a SIGKILL or a
  SIGTERM (the node's own bounded shutdown; either way the node is started again later) or a
  SIGSTOP (SIGCONT later);
  never every prefill or every decode node down at once; Redis killed and started again (empty)
  once in the middle. A node comes back on its port, so the gateway's address for it holds;
- after the load: every node routable again, a settle period, then the gateway's in-flight
  requests (``prefixgate_inflight_requests``; the nodes' in-flight work as ``/admin/nodes``
  counts it), open file descriptors and RSS (``/proc/PID``) against the figures taken after a
  warm-up, before the load.

Exit status 1 when a request failed, a scheduled event failed, or something leaked (in-flight
not 0, file descriptors or RSS more than ``--leak-tolerance`` above the start), so the run can
be a check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.bench.drill_cluster import Cluster, NodeProc, Outcome, one
from prefixgate.bench.launch import run_dir
from prefixgate.bench.redis_cluster import start_redis
from prefixgate.bench.report import percentile
from prefixgate.bench.textgen import segment_text
from prefixgate.gateway.ops.processes import Child
from prefixgate.gateway.ops.stack import free_port

MODEL = "prefixgate-sim"
PROTOCOLS = ("prefixgate", "smg")
KINDS = ("chat", "stream", "document", "n2")
DOCUMENTS = 3  # long documents the document requests share
DOCUMENT_TOKENS = 2000
#: What each fault does to its node: the signal first, then (after the node's down time) the repair.
FAULTS = {"kill": "start", "stop": "cont", "term": "start"}
METRICS = {
    "retried": "prefixgate_retries_total",
    "fallbacks": "prefixgate_fallbacks_total",
    "migrated": "prefixgate_migrations_total",
}


# -- schedule -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    at_s: float  # seconds after the load starts
    action: str  # kill | stop | term | start | cont | redis
    target: str  # a node id, or "redis"


def plan(seed: int, seconds: float, prefill: Sequence[str], decode: Sequence[str]) -> list[Event]:
    """The run's events, by time: about one fault per 8 s (at least 3) spread over 10-80 % of the
    run, each fault's kind and role taken in turn from seeded shuffles (every kind and both roles
    appear), a node chosen among those whose fault leaves another node of its role up all along;
    down 4-10 % of the run (0.5-8 s); one Redis restart at half time. Every fault is repaired
    before 85 % of the run."""
    rng = random.Random(seed)
    faults = max(3, round(seconds / 8))
    kinds = [k for _ in range(faults) for k in FAULTS][:faults]
    roles = (["prefill", "decode"] * faults)[:faults]
    rng.shuffle(kinds)
    rng.shuffle(roles)
    pools = {"prefill": list(prefill), "decode": list(decode)}
    down: list[tuple[str, str, float, float]] = []  # (role, node, from, to)
    events = [Event(round(seconds * 0.5, 3), "redis", "redis")]
    first, last, end = 0.1 * seconds, 0.8 * seconds, 0.85 * seconds
    slot = (last - first) / faults
    for i, kind in enumerate(kinds):
        start = first + (i + rng.uniform(0.0, 0.8)) * slot
        stop = min(start + min(8.0, max(0.5, rng.uniform(0.04, 0.1) * seconds)), end)
        for role in (roles[i], "decode" if roles[i] == "prefill" else "prefill"):
            overlapping = {n for r, n, a, b in down if r == role and a < stop and start < b}
            free = [n for n in pools[role] if n not in overlapping]
            if free and len(overlapping) + 1 < len(pools[role]):
                node = rng.choice(free)
                down.append((role, node, start, stop))
                events += [Event(round(start, 3), kind, node), Event(round(stop, 3), FAULTS[kind], node)]
                break
    return sorted(events, key=lambda e: e.at_s)


@dataclass(slots=True)
class Ran:
    event: Event
    began_s: float  # seconds after the load started
    took_s: float
    error: str = ""
    skipped: bool = False  # a fault with no other node of its role up, and its repair

    @property
    def late_s(self) -> float:
        """Began this long after its time (the node's event before it took that long)."""
        return max(0.0, self.began_s - self.event.at_s)


#: How long a fault waits for another node of its role to be routable before it is skipped.
SPARE_WAIT_S = 10.0


class Schedule:
    """Runs the events: one thread per node (and one for Redis), so a node slow to start delays
    its own events alone. A start takes as long as the node needs to print its ready line, which
    on a loaded machine can exceed the planned down time; so before a fault, the node's role must
    keep another node that the gateway routes to and that no fault holds, or the fault (and its
    repair) is skipped after ``SPARE_WAIT_S``: a role is never left without a node."""

    def __init__(
        self,
        events: list[Event],
        nodes: dict[str, NodeProc],
        redis: RestartableRedis,
        routable: Callable[[str], int],
    ) -> None:
        self.events, self.nodes, self.redis, self.routable = events, nodes, redis, routable
        self.ran: list[Ran] = []
        self.down: set[str] = set()  # nodes a fault holds
        self._gate = threading.Lock()  # one fault decides at a time: two never take the last spare
        self._abort = threading.Event()
        by_target: dict[str, list[Event]] = {}
        for ev in events:
            by_target.setdefault(ev.target, []).append(ev)
        self._threads = [
            threading.Thread(target=self._run, args=(evs,), name=f"chaos {t}", daemon=True)
            for t, evs in by_target.items()
        ]
        self.t0 = 0.0

    def start(self, t0: float) -> None:
        self.t0 = t0
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def abort(self) -> None:
        self._abort.set()

    def _spare(self, victim: str) -> bool:
        role = self.nodes[victim].role
        others = [n for n, p in self.nodes.items() if p.role == role and n != victim and n not in self.down]
        return bool(others) and self.routable(role) >= 2

    def _run(self, events: list[Event]) -> None:
        skip_repair = False
        for ev in events:
            if self._abort.wait(max(0.0, self.t0 + ev.at_s - time.monotonic())):
                return
            began = time.monotonic()
            error, skipped = "", False
            try:
                if ev.action in FAULTS:
                    with self._gate:
                        deadline = began + SPARE_WAIT_S
                        while not self._spare(ev.target) and time.monotonic() < deadline:
                            if self._abort.wait(0.2):
                                return
                        skipped = skip_repair = not self._spare(ev.target)
                        if not skipped:
                            self.down.add(ev.target)
                            self._do(ev)
                elif skip_repair:
                    skipped, skip_repair = True, False
                else:
                    self._do(ev)
                    self.down.discard(ev.target)
            except Exception as e:  # recorded, the run goes on: the report says which event failed
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            now = time.monotonic()
            self.ran.append(Ran(ev, round(began - self.t0, 3), round(now - began, 3), error, skipped))

    def _do(self, ev: Event) -> None:
        if ev.action == "redis":
            self.redis.restart()
            return
        node = self.nodes[ev.target]
        if ev.action == "kill":
            node.kill()
        elif ev.action == "stop":
            node.signal(signal.SIGSTOP)
        elif ev.action == "cont":
            node.signal(signal.SIGCONT)
        elif ev.action == "term":
            node.stop()
        elif ev.action == "start":
            node.start()
        else:
            raise ValueError(f"unknown action {ev.action!r}")

    def around(self, start: float, end: float) -> str:
        """The events that began while a request ran from ``start`` to ``end`` (monotonic), else the
        last one before it, as ``+12.3s kill decode-2``."""
        a, b = start - self.t0, end - self.t0
        ran = sorted((r for r in self.ran if not r.skipped), key=lambda r: r.began_s)
        during = [r for r in ran if a <= r.began_s <= b]
        before = [r for r in ran if r.began_s < a][-1:]
        named = ", ".join(f"+{r.began_s:.1f}s {r.event.action} {r.event.target}" for r in during or before)
        return ("during: " if during else "before: ") + named if named else "no event"


class RestartableRedis:
    """A Redis of the run's own on a fixed port: killed and started again (empty) by the schedule."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: Child = start_redis(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        self.proc.stop(signal.SIGKILL)
        self.proc = start_redis(self.port)

    def stop(self) -> None:
        self.proc.stop(signal.SIGKILL)


# -- load -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    kind: str
    n: int
    stream: bool
    out: Outcome

    @property
    def ok(self) -> bool:
        o = self.out
        whole = o.status == 200 and not o.error and len(o.finished) == self.n
        return whole and (o.done_marker or not self.stream)


def request(kind: str, i: int, rng: random.Random) -> tuple[dict[str, Any], bool, int]:
    """The body of request ``i`` of ``kind``, whether it streams, its ``n``. No seed: SGLang's
    protocol carries none, so a sampled request with one is refused in front of ``grpc://``."""
    question = segment_text(10_000 + i, rng.randint(20, 200), "chaos")
    if kind == "document":
        doc = rng.randrange(DOCUMENTS)
        text = f"Document {doc}:\n{segment_text(doc, DOCUMENT_TOKENS, 'chaos-doc')}\n\nQuestion: {question}"
        messages = [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": text},
        ]
    else:
        messages = [{"role": "user", "content": f"request {i}: {question}"}]
    stream = kind == "stream" or (kind == "document" and rng.random() < 0.5)
    n = 2 if kind == "n2" else 1
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 32 if stream else 12}
    if n > 1:
        body["n"] = n
    return body, stream, n


async def load(
    url: str, seconds: float, concurrency: int, seed: int, timeout: float, max_requests: int
) -> list[Record]:
    """``concurrency`` clients back to back until ``seconds`` have passed or ``max_requests`` were
    sent; a request not done within ``timeout`` s counts as failed."""
    rng = random.Random(seed)
    records: list[Record] = []
    deadline = time.monotonic() + seconds
    sent = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as http:

        async def client() -> None:
            nonlocal sent
            while time.monotonic() < deadline and sent < max_requests:
                i = sent
                sent += 1
                kind = rng.choice(KINDS)
                body, stream, n = request(kind, i, rng)
                started = time.monotonic()
                try:
                    out = await asyncio.wait_for(one(http, body, stream), timeout)
                except TimeoutError:
                    out = Outcome(0, error=f"client timeout after {timeout:g} s", started_at=started)
                    out.ended_at = time.monotonic()
                records.append(Record(kind, n, stream, out))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


# -- the gateway's figures -------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Every sample of the gateway's /metrics summed by name (labels dropped)."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":  # a labelled counter not yet counted has no sample
            out.setdefault(fam.name + "_total", 0.0)
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def routable(url: str) -> Callable[[str], int]:
    """How many nodes of a role the gateway routes to (0 while it does not answer)."""

    def count(role: str) -> int:
        try:
            return int(httpx.get(url + "/readyz", timeout=2, trust_env=False).json()[role])
        except (httpx.HTTPError, ValueError, KeyError):
            return 0

    return count


def node_inflight(url: str) -> int:
    nodes = httpx.get(url + "/admin/nodes", timeout=5, trust_env=False).json()["data"]
    return sum(int(n.get("local_requests", 0)) + int(n.get("active_streams", 0)) for n in nodes)


@dataclass(slots=True)
class Footprint:
    inflight: int
    node_inflight: int
    fds: int
    rss_kb: int
    #: the open files by what they are: TCP connections by the peer they go to (a node, redis, a
    #: client), listening sockets, pipes, ...; names what grew when the count did
    kinds: dict[str, int] = field(default_factory=dict)
    #: what the gateway's tokenizer segment caches hold (bounded by their setting): memory that
    #: grows as new text passes and is no leak
    cache_kb: int = 0


def _sockets() -> dict[str, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, TCP state) of every TCP socket in the kernel's
    tables, and -> (0, 0, "unix") of every Unix socket."""
    out: dict[str, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        for row in f.read().splitlines()[1:]:
            out[row.split()[6]] = (0, 0, "unix")
    return out


def open_files(pid: int, peers: dict[int, str]) -> dict[str, int]:
    """What ``pid``'s open files are, counted; ``peers`` names ports (a node, redis). A TCP socket
    the kernel has dropped from its tables (closed, or reset by its peer) while the process still
    holds it open counts as "socket in no table"."""
    socks = _sockets()
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sock = socks.get(target[8:-1])
            if sock is None:
                kinds["socket in no table"] += 1
            elif sock[2] == "unix":
                kinds["unix socket"] += 1
            elif sock[2] == "0A":
                kinds["tcp listening"] += 1
            else:
                kinds["tcp to " + peers.get(sock[1], "a client" if sock[0] in peers else "?")] += 1
        else:
            kinds[re.sub(r"\[\d+\]$", "", target.split(":")[0] if ":" in target else "file")] += 1
    return dict(sorted(kinds.items()))


class FileWatch:
    """Samples the gateway's open files during the load, noting when sockets in no table (held
    open after the kernel let go of them) appear, so the report can name the event before."""

    PERIOD_S = 1.0
    KIND = "socket in no table"

    def __init__(self, pid: int, peers: dict[int, str], t0: float) -> None:
        self.pid, self.peers, self.t0 = pid, peers, t0
        self.changes: list[tuple[float, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos file watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -1
        while not self._done.wait(self.PERIOD_S):
            with contextlib.suppress(OSError):
                now = open_files(self.pid, self.peers).get(self.KIND, 0)
                if last >= 0 and now > last:
                    self.changes.append(
                        (round(time.monotonic() - self.t0, 1), f"{self.KIND} {last} -> {now}")
                    )
                last = now

    def stop(self) -> list[tuple[float, str]]:
        self._done.set()
        self._thread.join(timeout=5)
        return self.changes


def footprint(cluster: Cluster, peers: dict[int, str]) -> Footprint:
    assert cluster.gateway is not None
    pid = cluster.gateway.pid
    kinds = open_files(pid, peers)
    metrics = scrape(cluster.url)
    return Footprint(
        int(metrics.get("prefixgate_inflight_requests", 0)),
        node_inflight(cluster.url),
        sum(kinds.values()),
        cluster.gateway_rss_kb(),
        kinds,
        cache_kb=int(metrics.get("prefixgate_tokenizer_cache_bytes", 0)) // 1024,
    )


def settle(cluster: Cluster, peers: dict[int, str], seconds: float) -> Footprint:
    """Up to ``seconds`` for the gateway to hold no request (then a moment for its connections to
    close); the footprint then."""
    deadline = time.monotonic() + seconds
    fp = footprint(cluster, peers)
    while (fp.inflight or fp.node_inflight) and time.monotonic() < deadline:
        time.sleep(0.2)
        fp = footprint(cluster, peers)
    time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return footprint(cluster, peers)


# -- one run ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    protocol: str
    seconds: float
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, float | None] = field(default_factory=dict)
    reasons: list[tuple[int, str]] = field(default_factory=list)
    first_failures: list[str] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # every one, for --json
    schedule: list[dict[str, Any]] = field(default_factory=list)
    start: Footprint | None = None
    end: Footprint | None = None
    leaks: list[str] = field(default_factory=list)
    schedule_errors: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds of each step
    file_changes: list[str] = field(default_factory=list)  # sockets in no table appearing, when

    def mark(self, phase: str, since: float) -> float:
        now = time.monotonic()
        self.phases[phase] = round(now - since, 1)
        return now

    @property
    def failed(self) -> int:
        return int(self.rows.get("all", {}).get("failed", 0))

    @property
    def passed(self) -> bool:
        return not self.failed and not self.leaks and not self.schedule_errors and bool(self.rows)


def reason(r: Record) -> str:
    """Why a request failed, short."""
    o = r.out
    if o.status not in (0, 200):
        what = f"HTTP {o.status}: {o.error}"
    elif o.error:
        what = ("stream error event: " if o.status == 200 else "") + o.error
    elif len(o.finished) < r.n:
        what = f"{len(o.finished)} of {r.n} choices finished"
    else:
        what = "stream ended without [DONE]"
    return what[:160]


def shape(text: str) -> str:
    """A reason with its numbers and addresses blanked, to count alike failures together."""
    return re.sub(r"\d+(\.\d+)?", "#", text)


def rows(records: list[Record]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in (*KINDS, "all"):
        rs = [r for r in records if kind in ("all", r.kind)]
        ttft = sorted(r.out.first_at - r.out.started_at for r in rs if r.ok and r.stream and r.out.first_at)
        out[kind] = {
            "requests": len(rs),
            "ok": sum(r.ok for r in rs),
            "failed": sum(not r.ok for r in rs),
            "fallback": sum(r.out.route == "fallback" for r in rs),
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        }
    return out


def run_protocol(protocol: str, args: argparse.Namespace, logs: Path) -> Result:
    res = Result(protocol, args.seconds)
    redis = RestartableRedis()
    cluster = Cluster.create(
        2,
        4,
        ["--time-scale", str(args.time_scale), "--capacity-blocks", "4096"],
        protocol=protocol,
        gateway_args=["--redis", redis.url],
        gateway_env={"PREFIXGATE_REDIS_PREFIX": f"prefixgate-chaos-{uuid.uuid4().hex[:8]}:"},
        stats_interval_s=None,  # the gateway's default health probe: the schedule runs at the defaults
        log_dir=logs / protocol,
    )
    (logs / protocol).mkdir(parents=True, exist_ok=True)
    schedule: Schedule | None = None
    t = time.monotonic()
    try:
        cluster.start()
        cluster.wait_routable("decode", len(cluster.decode), timeout=30)
        t = res.mark("start", t)
        # warm-up at the run's concurrency: the start figures include what the first requests build
        # (connections to every node, the Redis pool as wide as the load makes it)
        warm = args.concurrency * 2
        asyncio.run(load(cluster.url, 60.0, args.concurrency, args.seed + 1, args.request_timeout, warm))
        peers = {n.port: n.node_id for n in cluster.nodes} | {redis.port: "redis", cluster.port: "gateway"}
        peers |= {n.bootstrap_port: f"{n.node_id} bootstrap" for n in cluster.prefill if n.bootstrap_port}
        res.start = settle(cluster, peers, args.settle)
        t = res.mark("warm-up", t)
        before = scrape(cluster.url)
        events = plan(
            args.seed, args.seconds, [n.node_id for n in cluster.prefill], [n.node_id for n in cluster.decode]
        )
        schedule = Schedule(events, {n.node_id: n for n in cluster.nodes}, redis, routable(cluster.url))
        t0 = time.monotonic()
        schedule.start(t0)
        watch = FileWatch(cluster.gateway.pid if cluster.gateway else 0, peers, t0)
        records = asyncio.run(
            load(
                cluster.url,
                args.seconds,
                args.concurrency,
                args.seed,
                args.request_timeout,
                args.max_requests,
            )
        )
        t = res.mark("load", t0)
        if not schedule.join(timeout=120.0):
            schedule.abort()
        for n in cluster.nodes:  # every node back, whatever the schedule did (missing events fail the run)
            if n.proc is not None and n.proc.alive():
                n.signal(signal.SIGCONT)
            else:
                n.start()
        cluster.wait_routable("prefill", len(cluster.prefill), timeout=60)
        cluster.wait_routable("decode", len(cluster.decode), timeout=60)
        t = res.mark("recover", t)
        res.end = settle(cluster, peers, args.settle)
        res.file_changes = [  # during the load and after it, to the end figures
            f"+{at:.1f}s {what} ({schedule.around(t0 + at - FileWatch.PERIOD_S, t0 + at)})"
            for at, what in watch.stop()
        ]
        t = res.mark("settle", t)
        after = scrape(cluster.url)
        res.rows = rows(records)
        for key, name in METRICS.items():
            res.counters[key] = after[name] - before.get(name, 0.0) if name in after else None
        failed = [r for r in records if not r.ok]
        res.reasons = [(c, s) for s, c in Counter(shape(reason(r)) for r in failed).most_common()]
        for k, r in enumerate(sorted(failed, key=lambda r: r.out.started_at)):
            o = r.out
            nodes = "/".join(x for x in (o.prefill_node, o.decode_node) if x) or "-"
            res.failures.append(
                {
                    "kind": r.kind,
                    "started_s": round(o.started_at - t0, 3),
                    "ended_s": round(o.ended_at - t0, 3),
                    "status": o.status,
                    "request_id": o.request_id,
                    "route": o.route,
                    "nodes": nodes,
                    "reason": reason(r),
                    "events": schedule.around(o.started_at, o.ended_at),
                }
            )
            if k >= args.show_failures:
                continue
            res.first_failures.append(
                f"+{o.started_at - t0:.1f}s..+{o.ended_at - t0:.1f}s {r.kind:<8} {o.route or '-'} {nodes}: "
                f"{reason(r)} ({schedule.around(o.started_at, o.ended_at)})"
            )
        res.schedule = [
            {
                **asdict(r.event),
                "began_s": r.began_s,
                "late_s": r.late_s,
                "took_s": r.took_s,
                "error": r.error,
                "skipped": r.skipped,
            }
            for r in sorted(schedule.ran, key=lambda r: r.began_s)
        ]
        missing = len(events) - len(schedule.ran)
        res.schedule_errors = sum(1 for r in schedule.ran if r.error) + missing
        res.leaks = leaks(res.start, res.end, args.leak_tolerance)
    finally:
        if schedule is not None:
            schedule.abort()
        for n in cluster.nodes:  # a node left stopped would take its SIGTERM only when continued
            if n.proc is not None:
                n.signal(signal.SIGCONT)
        cluster.stop()
        redis.stop()
        res.mark("stop", t)
    return res


def leaks(start: Footprint, end: Footprint, tolerance: float) -> list[str]:
    out = []
    if end.inflight:
        out.append(f"{end.inflight} requests still in flight in the gateway")
    if end.node_inflight:
        out.append(f"{end.node_inflight} requests still in flight on nodes (as the gateway counts)")
    if end.fds > start.fds * (1 + tolerance):
        grew = ", ".join(
            f"{k} {start.kinds.get(k, 0)} -> {v}" for k, v in end.kinds.items() if v > start.kinds.get(k, 0)
        )
        out.append(f"open files {start.fds} -> {end.fds} ({grew})")
    cache_growth = max(0, end.cache_kb - start.cache_kb)  # bounded caches filling: no leak
    if end.rss_kb - cache_growth > start.rss_kb * (1 + tolerance):
        out.append(f"RSS {start.rss_kb} -> {end.rss_kb} kB ({cache_growth} kB of it tokenizer cache)")
    return out


# -- report ----------------------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _pct(a: int, b: int) -> str:
    return f"{(b - a) / a * 100:+.0f} %" if a else "n/a"


def render(res: Result, args: argparse.Namespace) -> str:
    label = "prefixgate protocol" if res.protocol == "prefixgate" else "grpc:// (SMG protocol)"
    lines = [
        f"chaos: {label}, {res.seconds:g} s, seed {args.seed}, concurrency {args.concurrency}, "
        "2 prefill + 4 decode, gateway on Redis",
        f"{'kind':<10}{'requests':>9}{'ok':>7}{'failed':>8}{'fallback':>9}{'TTFT p50':>10}{'TTFT p99':>10}",
    ]
    for kind, row in res.rows.items():
        lines.append(
            f"{kind:<10}{row['requests']:>9}{row['ok']:>7}{row['failed']:>8}{row['fallback']:>9}"
            f"{_s(row['ttft_p50_s']):>10}{_s(row['ttft_p99_s']):>10}"
        )
    counters = ", ".join(f"{k} {'n/a' if v is None else int(v)}" for k, v in res.counters.items())
    lines.append(f"gateway counters during the run: {counters}  (TTFT: streamed requests)")
    done = [r for r in res.schedule if not r["skipped"]]
    kinds = Counter(r["action"] for r in done)
    late = max((r["late_s"] for r in done), default=0.0)
    ran = ", ".join(f"{k} {c}" for k, c in sorted(kinds.items()))
    lines.append(
        f"schedule: {len(done)} events ran ({ran}), latest {late:.1f} s late, "
        f"{len(res.schedule) - len(done)} skipped (no spare node), {res.schedule_errors} failed or not run"
    )
    for r in res.schedule:
        if r["error"]:
            lines.append(f"  event +{r['at_s']:.1f}s {r['action']} {r['target']} failed: {r['error']}")
    if res.reasons:
        lines.append("failures by reason:")
        lines += [f"  {c:>5}  {s}" for c, s in res.reasons[:8]]
        lines.append("first failures (since the load began; kind, route, nodes: reason; events):")
        lines += [f"  {f}" for f in res.first_failures]
    if res.start and res.end:
        s, e = res.start, res.end
        lines.append(
            f"after settling: in flight {e.inflight} (nodes {e.node_inflight}); open files "
            f"{s.fds} -> {e.fds} ({_pct(s.fds, e.fds)}); RSS {s.rss_kb // 1024} -> "
            f"{e.rss_kb // 1024} MB ({_pct(s.rss_kb, e.rss_kb)}; tokenizer cache "
            f"{s.cache_kb // 1024} -> {e.cache_kb // 1024} MB)"
        )
    if res.file_changes:
        lines.append("open files held after the kernel dropped them, as they appeared:")
        lines += [f"  {c}" for c in res.file_changes[:8]]
    lines.append("wall: " + ", ".join(f"{k} {v:g} s" for k, v in res.phases.items()))
    lines.append("result: " + ("PASS" if res.passed else "FAIL " + "; ".join(_why(res))))
    return "\n".join(lines)


def _why(res: Result) -> list[str]:
    out = [f"{res.failed} requests failed"] if res.failed else []
    if res.schedule_errors:
        out.append(f"{res.schedule_errors} events failed")
    return out + res.leaks


# -- command ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=120.0, help="length of the load (default 120)")
    p.add_argument(
        "--protocol",
        choices=(*PROTOCOLS, "both"),
        default="both",
        help="node protocol (default both, one after the other)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the schedule and the load (default 1)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument(
        "--time-scale", type=float, default=5.0, help="the nodes' simulated time multiplier (default 5)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=30.0, help="seconds a request may take (default 30)"
    )
    p.add_argument("--max-requests", type=int, default=100_000, help="requests sent at most (default 100000)")
    p.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds for in-flight work to end before the figures (default 15)",
    )
    p.add_argument(
        "--leak-tolerance",
        type=float,
        default=0.10,
        help="growth of open files and RSS allowed (default 0.10)",
    )
    p.add_argument("--show-failures", type=int, default=5, help="failures listed one by one (default 5)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")


def run(args: argparse.Namespace) -> int:
    logs = run_dir("chaos")
    print(f"logs: {logs}", flush=True)
    protocols = PROTOCOLS if args.protocol == "both" else (args.protocol,)
    results = []
    for protocol in protocols:
        res = run_protocol(protocol, args, logs)
        results.append(res)
        print(render(res, args), flush=True)
        print(flush=True)
    if args.json:
        args.json.write_bytes(orjson.dumps([asdict(r) for r in results], option=orjson.OPT_INDENT_2))
    return 0 if all(r.passed for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench chaos", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
