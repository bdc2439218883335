"""``python -m prefixgate.bench.zmq_flood``: a gateway's responsiveness and memory while an engine's
ZMQ KV event publisher floods it.

A real gateway (``prefixgate gateway``) fronts one simulated node whose KV events it takes from a
ZMQ publisher (``--kv-events``, the vLLM / SGLang wire: PUB ``[topic, seq, payload]`` + ROUTER
replay of the last 10,000 batches, SNDHWM 100,000 as SGLang's default). The publisher runs in its
own process and, once the gateway is subscribed and has indexed a warm-up, sends pre-encoded
batches (vLLM's tagged maps: a 4-block chain stored, the chain stored ``POOL / 2`` batches before
removed, so the worker's pool stays the same size) as fast as one Python thread can, for
``--seconds``. Meanwhile ``/healthz`` (answered on the gateway's event loop, as is every request)
is probed back to back, 10 ms apart; the gateway's RSS is read from /proc. Phases: ``idle`` (before),
``flood``, ``after`` (the ``--settle`` seconds after it). Then a last warm-up batch must be indexed
again (the subscriber follows the stream after the flood).

Targets: ``/healthz`` p99 during the flood < 50 ms; the RSS after the flood within 10 % of the
RSS before. ``--gateway-python PATH`` runs the gateway under another interpreter (another
checkout's venv: that checkout's gateway; run the bench from outside both checkouts, as
``python -m`` imports from the current directory first) for comparison; a ``/healthz`` slower
than ``--probe-timeout`` counts at that value.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import httpx
import msgspec
import zmq
from rich.console import Console
from rich.table import Table

from prefixgate.bench import launch
from prefixgate.bench.report import percentile, write_json
from prefixgate.gateway.ops import processes

TARGET_P99_MS = 50.0
TARGET_RSS_GROWTH = 0.10
POOL = 4096  # distinct batches cycled through by the flood
ENGINE_BLOCK = 16
REPLAY_BUFFER = 10_000  # what vLLM and SGLang keep for replays by default
SNDHWM = 100_000  # SGLang's default publisher high-water mark


# -- the publisher (its own process) ----------------------------------------------------------------


def _batch(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode({"ts": time.time(), "events": events, "data_parallel_rank": 0})


def _stored(i: int, base: int) -> dict[str, Any]:
    tokens = list(range(base + 4 * ENGINE_BLOCK * i, base + 4 * ENGINE_BLOCK * (i + 1)))
    return {
        "type": "BlockStored",
        "block_hashes": [4 * i + k for k in range(4)],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": ENGINE_BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }


def flood_batches(pairs: int) -> list[bytes]:
    """``POOL`` batches of ``pairs`` (stored chain, removed chain) events each."""
    out = []
    for i in range(POOL):
        events: list[dict[str, Any]] = []
        for p in range(pairs):
            j = i * pairs + p
            old = (j - POOL * pairs // 2) % (POOL * pairs)
            events.append(_stored(j, 1_000_000))
            events.append({"type": "BlockRemoved", "block_hashes": [4 * old + k for k in range(4)]})
        out.append(_batch(events))
    return out


def _publisher(conn: Connection, pairs: int) -> None:  # pragma: no cover - its own process
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, SNDHWM)
    pub.bind("tcp://127.0.0.1:*")
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    conn.send((pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT)))
    payloads = flood_batches(pairs)
    buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
    seq = 0
    warm = 0

    def serve_replay() -> None:
        while router.poll(0):
            ident, _, start = router.recv_multipart()
            s0 = int.from_bytes(start, "big")
            for s, buf in list(buffer):
                if s >= s0:
                    router.send_multipart([ident, b"", s.to_bytes(8, "big"), buf], copy=False)
            router.send_multipart([ident, b"", (2**64 - 1).to_bytes(8, "big"), b""])

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload], copy=False)
        buffer.append((seq, payload))
        seq += 1

    while True:
        serve_replay()
        if not conn.poll(0.01):
            continue
        cmd, arg = conn.recv()
        if cmd == "warm":  # chains of their own, never removed: indexed, then looked for
            for _ in range(int(arg)):
                send(_batch([_stored(10_000_000 + warm, 500_000_000)]))
                warm += 1
            conn.send(seq)
        elif cmd == "flood":
            n = 0
            deadline = time.monotonic() + float(arg)
            while True:
                if n % 512 == 0:
                    if time.monotonic() >= deadline:
                        break
                    serve_replay()
                send(payloads[n % POOL])
                n += 1
            conn.send(n)
        else:
            break
    pub.close(0)
    router.close(0)
    ctx.term()


# -- probing the gateway ---------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Phase:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    timeouts: int = 0
    rss_peak: int = 0
    rss_end: int = 0
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        return {
            "phase": self.name,
            "seconds": round(self.seconds, 2),
            "probes": len(lat),
            "timeouts": self.timeouts,
            "p50_ms": round(percentile(lat, 50), 2),
            "p99_ms": round(percentile(lat, 99), 2),
            "max_ms": round(lat[-1], 2) if lat else 0.0,
            "rss_peak_mib": round(self.rss_peak / 2**20, 1),
            "rss_end_mib": round(self.rss_end / 2**20, 1),
        }


def probe(
    client: httpx.Client, pid: int, phase: Phase, until: threading.Event | float, timeout: float
) -> None:
    """``/healthz`` back to back (10 ms apart) until ``until`` (an event set, or a monotonic time)."""
    t0 = time.monotonic()
    while not (until.is_set() if isinstance(until, threading.Event) else time.monotonic() >= until):
        start = time.perf_counter()
        try:
            client.get("/healthz", timeout=timeout).raise_for_status()
            phase.latencies_ms.append((time.perf_counter() - start) * 1000)
        except httpx.HTTPError:
            phase.timeouts += 1
            phase.latencies_ms.append(timeout * 1000)
        phase.rss_peak = max(phase.rss_peak, rss_bytes(pid))
        time.sleep(0.01)
        if time.monotonic() - t0 > 600:  # a hard stop, whatever ``until`` says
            break
    phase.seconds = time.monotonic() - t0
    phase.rss_end = rss_bytes(pid)


def metrics(client: httpx.Client) -> dict[str, float]:
    """The gateway's ``prefixgate_kv_events*`` and ``prefixgate_index_resyncs*`` samples (none
    when it does not answer in 10 s: a gateway held by a flood)."""
    out: dict[str, float] = {}
    try:
        text = client.get("/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        m = re.match(r"^(prefixgate_(?:kv_events|index_resyncs)\w*)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and not m.group(1).endswith("_created"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_metric(client: httpx.Client, name: str, at_least: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = metrics(client).get(name, 0.0)
        if value >= at_least:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{name} stayed at {value} (< {at_least}) for {timeout:.0f} s")


# -- the run --------------------------------------------------------------------------------------

STORED = 'prefixgate_kv_events_total{kind="stored"}'
SNAPSHOT = 'prefixgate_kv_events_total{kind="snapshot"}'


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    logs = launch.run_dir("zmq-flood")
    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    publisher = spawn.Process(target=_publisher, args=(child_conn, args.pairs), daemon=True)
    publisher.start()
    children: list[processes.Child] = []
    phases: list[Phase] = []
    report: dict[str, Any] = {}
    try:
        if not conn.poll(30):
            raise RuntimeError("the publisher did not start")
        endpoint, replay = conn.recv()
        nodes = launch.start_nodes(1, launch.NodeOptions(profile="instant", http=False), logs)
        children += nodes
        node = nodes[0].address
        env = {"PREFIXGATE_KV_EVENTS": f"{node}={endpoint}?replay={replay}&topic=kv"}
        gw = launch.start_gateway(logs, monolithic=[node], env=env, python=args.gateway_python)
        children.append(gw)
        with httpx.Client(base_url=gw.url) as client:
            wait_metric(client, SNAPSHOT, 1, 30)  # subscribed
            conn.send(("warm", args.warm))
            conn.recv()
            stored0 = wait_metric(client, STORED, args.warm, 30)
            idle = Phase("idle")
            probe(client, gw.pid, idle, time.monotonic() + args.idle, args.probe_timeout)
            phases.append(idle)
            rss_before = idle.rss_end
            flood = Phase("flood")
            done = threading.Event()
            sent: list[int] = []

            def flood_now() -> None:
                conn.send(("flood", args.seconds))
                if conn.poll(args.seconds + 120):
                    sent.append(conn.recv())
                done.set()

            t = threading.Thread(target=flood_now, daemon=True)
            t.start()
            probe(client, gw.pid, flood, done, args.probe_timeout)
            t.join(5)
            phases.append(flood)
            after = Phase("after")
            probe(client, gw.pid, after, time.monotonic() + args.settle, args.probe_timeout)
            phases.append(after)
            rss_after = after.rss_end
            before_warm = metrics(client).get(STORED, 0.0)
            conn.send(("warm", 10))
            conn.recv()
            try:  # the stream is followed again
                wait_metric(client, STORED, before_warm + 10, 30)
                follows = True
            except TimeoutError:
                follows = False
            deadline = time.monotonic() + 120
            while not (final := metrics(client)) and time.monotonic() < deadline:
                time.sleep(1)
        batches = sent[0] if sent else 0
        report = {
            "seconds": args.seconds,
            "events_per_batch": 2 * args.pairs,
            "batches_sent": batches,
            "events_sent": batches * 2 * args.pairs,
            "events_per_s": round(batches * 2 * args.pairs / max(flood.seconds, 1e-9)),
            "stored_during_warmup": stored0,
            "rss_before_mib": round(rss_before / 2**20, 1),
            "rss_after_mib": round(rss_after / 2**20, 1),
            "rss_growth": round(rss_after / rss_before - 1, 4) if rss_before else 0.0,
            "follows_after": follows,
            "phases": [p.row() for p in phases],
            "gateway_metrics": final,
            "gateway_python": args.gateway_python,
        }
    finally:
        with contextlib.suppress(Exception):
            conn.send(("stop", 0))
        publisher.join(5)
        if publisher.is_alive():
            publisher.kill()
        processes.stop_all(children, grace=3.0)
    render(report, console)
    if args.json_out:
        write_json(args.json_out, report, console)
    return 0 if report.get("follows_after") else 1


def render(rep: dict[str, Any], console: Console) -> None:
    t = Table(
        title=f"/healthz during a ZMQ KV event flood ({rep['events_sent']:,} events in {rep['seconds']:g} s, "
        f"{rep['events_per_s']:,}/s, {rep['events_per_batch']} a batch)"
    )
    for col in (
        "phase",
        "s",
        "probes",
        "timeouts",
        "p50 ms",
        "p99 ms",
        "max ms",
        "RSS peak MiB",
        "RSS end MiB",
    ):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for p in rep["phases"]:
        t.add_row(
            p["phase"],
            f"{p['seconds']:.1f}",
            str(p["probes"]),
            str(p["timeouts"]),
            f"{p['p50_ms']:.1f}",
            f"{p['p99_ms']:.1f}",
            f"{p['max_ms']:.1f}",
            f"{p['rss_peak_mib']:.1f}",
            f"{p['rss_end_mib']:.1f}",
        )
    console.print(t)
    g = rep["gateway_metrics"]
    kinds = {k.split('"')[1]: int(v) for k, v in g.items() if k.startswith("prefixgate_kv_events_total{")}
    dropped = {k.split('"')[1]: int(v) for k, v in g.items() if k.startswith("prefixgate_kv_events_dropped")}
    resyncs = {
        k.split('"')[1]: int(v) for k, v in g.items() if k.startswith("prefixgate_index_resyncs_total")
    }
    console.print(f"gateway applied {kinds}; dropped {dropped or '-'}; resyncs {resyncs or '-'}")
    flood = next(p for p in rep["phases"] if p["phase"] == "flood")
    checks = [
        (
            f"/healthz p99 during the flood < {TARGET_P99_MS:g} ms ({flood['p99_ms']:.1f})",
            flood["p99_ms"] < 50,
        ),
        (
            f"RSS after within {TARGET_RSS_GROWTH:.0%} of before "
            f"({rep['rss_before_mib']:.1f} -> {rep['rss_after_mib']:.1f} MiB, {rep['rss_growth']:+.1%})",
            abs(rep["rss_growth"]) <= TARGET_RSS_GROWTH,
        ),
        ("indexes again after the flood", rep["follows_after"]),
    ]
    for name, ok in checks:
        console.print(f"{'PASS' if ok else 'MISS'}  {name}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0, help="flood duration (default 10)")
    p.add_argument("--pairs", type=int, default=1, help="(stored, removed) event pairs a batch (default 1)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds probed before the flood")
    p.add_argument("--settle", type=float, default=5.0, help="seconds probed after the flood")
    p.add_argument("--warm", type=int, default=100, help="batches indexed before the flood")
    p.add_argument(
        "--probe-timeout", type=float, default=5.0, help="a /healthz slower than this counts as it"
    )
    p.add_argument(
        "--gateway-python",
        default=sys.executable,
        help="the interpreter the gateway runs under (default this one; another checkout's venv runs "
        "that checkout's gateway)",
    )
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench zmq-flood", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
