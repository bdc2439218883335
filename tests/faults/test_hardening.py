"""Hostile and unlucky clients against a real gateway process: stalled sockets, oversized headers,
HTTP/1.0, a shutdown with streams still open. Settings go through ``PREFIXGATE_*`` variables."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.faults.cluster import Cluster, Outcome, Tally, drive
from tests.faults.drills import REPORT

MODEL = "prefixgate-sim"
FAST_TIMEOUTS = {
    "PREFIXGATE_HEADER_TIMEOUT_S": "1",
    "PREFIXGATE_BODY_TIMEOUT_S": "1",
    "PREFIXGATE_KEEPALIVE_TIMEOUT_S": "1",
}


def body(i: int, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "seed": i,
        "messages": [{"role": "user", "content": f"request {i}: tell me about the sea " * 20}],
        **extra,
    }


def tally(name: str, results: list[Outcome], note: str) -> Tally:
    t = Tally(name, sent=len(results), note=note)
    t.succeeded = sum(1 for r in results if r.status == 200 and not r.error and r.finish)
    t.rejected_429 = sum(1 for r in results if r.status == 429)
    t.stream_errors = sum(1 for r in results if r.status == 200 and r.error)
    t.failed = sum(1 for r in results if r.status not in (200, 429))
    REPORT.append(t)
    return t


def closed_by_server(sock: socket.socket) -> bool:
    """True if the server closed (or answered and closed) this socket; False if it is still open."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster.create(1, 1, ["--time-scale", "0.2"], gateway_env=dict(FAST_TIMEOUTS))
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_stalled_sockets_are_closed_while_real_requests_are_served(cluster: Cluster) -> None:
    addr = ("127.0.0.1", cluster.port)
    stalled: list[socket.socket] = []
    for _ in range(50):  # connect and say nothing
        stalled.append(socket.create_connection(addr))
    for _ in range(50):  # half a request line and headers
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        stalled.append(s)
    for _ in range(50):  # headers, then a third of the body
        s = socket.create_connection(addr)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 30\r\n\r\n{"model":'
        )
        stalled.append(s)
    idle = socket.create_connection(addr)  # one request answered, then an idle keep-alive
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert idle.recv(4096).startswith(b"HTTP/1.1 200")
    stalled.append(idle)
    t0 = time.monotonic()
    try:
        results = asyncio.run(drive(cluster.url, [body(i) for i in range(40)], 8))
        open_left = stalled
        while open_left and time.monotonic() - t0 < 8:
            open_left = [s for s in open_left if not closed_by_server(s)]
            time.sleep(0.1)
        closed_after = time.monotonic() - t0
        t = tally(
            "slow and idle clients (151 stalled sockets)",
            results,
            f"{len(stalled) - len(open_left)}/{len(stalled)} stalled sockets closed in {closed_after:.1f}s",
        )
        assert t.succeeded == 40 and t.failed == 0, [r.error for r in results if r.error][:3]
        assert not open_left, f"{len(open_left)} stalled sockets still open after {closed_after:.1f}s"
    finally:
        for s in stalled:
            s.close()


def test_silent_sockets_do_not_starve_requests_under_a_low_open_file_limit() -> None:
    c = Cluster.create(1, 1, ["--time-scale", "0.2"], gateway_open_files=256)
    c.start()
    silent: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.settimeout(2)
            with contextlib.suppress(OSError):
                s.connect(("127.0.0.1", c.port))
            silent.append(s)
        ok, latencies = 0, []
        with httpx.Client(base_url=c.url, timeout=5) as http:
            for i in range(20):
                t0 = time.perf_counter()
                try:
                    r = http.post("/v1/chat/completions", json=body(i), headers={"connection": "close"})
                    ok += r.status_code == 200
                except httpx.HTTPError:
                    pass
                latencies.append(time.perf_counter() - t0)
        REPORT.append(
            Tally(
                "300 silent sockets, 256 open files",
                sent=20,
                succeeded=ok,
                failed=20 - ok,
                note=f"max latency {max(latencies) * 1000:.0f} ms",
            )
        )
        assert ok == 20, f"{ok}/20 requests served next to 300 silent sockets"
    finally:
        for s in silent:
            s.close()
        c.stop()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _send_huge_header(port: int, total: int) -> tuple[int, bytes]:
    """Send a request whose one header is ``total`` bytes; (bytes sent before the gateway stopped
    us, what it answered)."""
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        chunk = b"a" * 65536
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Huge: ")
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass
        with contextlib.suppress(OSError):
            answer = s.recv(4096)
    return sent, answer


def test_oversized_headers_are_refused_before_they_are_buffered(cluster: Cluster) -> None:
    assert cluster.gateway is not None
    pid = cluster.gateway.proc.pid
    huge = 64 * 1024 * 1024
    rss_before = _rss_kb(pid)
    outcomes: list[tuple[int, bytes]] = []

    def attack() -> None:
        outcomes.append(_send_huge_header(cluster.port, huge))

    peak = rss_before
    sampling = True

    def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, _rss_kb(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    attackers = [threading.Thread(target=attack) for _ in range(4)]
    for a in attackers:
        a.start()
    results = asyncio.run(drive(cluster.url, [body(i) for i in range(30)], 6))
    for a in attackers:
        a.join(60)
    sampling = False
    sampler.join()
    rss_after = peak
    just_over = _send_huge_header(cluster.port, 40 * 1024)[1]
    with httpx.Client(base_url=cluster.url) as http:
        fine = http.get("/healthz", headers={"x-padding": "p" * 8000})
    grown_mb = (rss_after - rss_before) / 1024
    most_sent = max(sent for sent, _ in outcomes)
    t = tally(
        "oversized headers (4 x 64 MB next to 30 requests)",
        results,
        f"refused after <= {most_sent // 1024} KB; RSS {rss_before // 1024} MB, peak {rss_after // 1024} MB",
    )
    assert t.succeeded == 30 and t.failed == 0
    assert len(outcomes) == 4 and most_sent < huge // 4, outcomes
    assert grown_mb < 30, f"RSS grew by {grown_mb:.0f} MB"
    assert just_over.startswith(b"HTTP/1.1 431"), just_over[:200]
    assert b'"code":"headers_too_large"' in just_over
    assert fine.status_code == 200


def _raw_exchange(port: int, request: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def test_http10_clients_get_streams_without_chunked_encoding(cluster: Cluster) -> None:
    payload = orjson.dumps(body(1, max_tokens=6, stream=True))
    request = (
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(payload)
    ) + payload
    head, rest = _raw_exchange(cluster.port, request)
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200"), head
    assert b"transfer-encoding: chunked" not in lines, head
    assert b"connection: close" in lines
    events = [e for e in rest.split(b"\n\n") if e]
    assert events[0].startswith(b"data: {"), rest[:200]  # no chunk-size line before the first event
    assert events[-1] == b"data: [DONE]"


def _stream(url: str, i: int, first: threading.Semaphore, out: list[Outcome]) -> None:
    res = Outcome(0)
    try:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body(i, 8000, stream=True), timeout=30
        ) as r:
            res.status = r.status_code
            seen = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not seen:
                    seen = True
                    first.release()
                if line == "data: [DONE]":
                    res.done_marker = True
                    continue
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    res.error = obj["error"]["message"]
                for ch in obj.get("choices", []):
                    res.finish = ch.get("finish_reason") or res.finish
    except httpx.HTTPError as e:
        res.status, res.error = 0, f"transport: {e!r}"
    out.append(res)


def test_shutdown_with_open_streams_ends_them_with_an_error_event() -> None:
    # streams of 8,000 tokens on slow nodes: longer than any grace (the former fixed one was 10 s)
    c = Cluster.create(1, 1, ["--time-scale", "40"], gateway_env={"PREFIXGATE_SHUTDOWN_GRACE_S": "1"})
    c.start()
    assert c.gateway is not None
    try:
        results: list[Outcome] = []
        first = threading.Semaphore(0)
        clients = [threading.Thread(target=_stream, args=(c.url, i, first, results)) for i in range(12)]
        for client in clients:
            client.start()
        for _ in clients:
            assert first.acquire(timeout=30), "a stream did not start"
        c.gateway.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = c.gateway.proc.wait(20)
        stopped_after = time.monotonic() - t0
        for client in clients:
            client.join(30)
        t = tally(
            "shutdown with 12 open streams (grace 1 s)",
            results,
            f"gateway exit {code} after {stopped_after:.1f}s",
        )
        assert t.failed == 0, [r.error for r in results][:3]
        assert t.stream_errors == 12, [(r.status, r.error, r.done_marker) for r in results][:3]
        assert all("shut down" in r.error and not r.done_marker for r in results)
        assert code == 4, f"exit status {code}: work was cut, the exit must say so"
        assert stopped_after < 6
        time.sleep(0.2)
        output = "\n".join(c.gateway.lines)
        assert "Traceback" not in output, output[-3000:]
        assert "shutdown_grace_ended" in output
    finally:
        c.stop()


def test_pipelined_and_kept_alive_requests_still_work(cluster: Cluster) -> None:
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 2)
        data = b""
        while data.count(b'{"status":"ok"}') < 2 and (part := s.recv(65536)):
            data += part
        assert data.count(b"HTTP/1.1 200") == 2
        time.sleep(0.5)  # idle, within the keep-alive timeout: no header deadline runs meanwhile
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while not data.endswith(b'{"status":"ok"}') and (part := s.recv(65536)):
            data += part
        assert data.startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # then closed by the keep-alive timeout (1 s here)
        assert time.monotonic() - t0 < 3
