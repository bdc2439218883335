"""Graceful shutdown: SIGTERM stops accepting and lets in-flight streams finish."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.cluster import Cluster

MODEL = "prefixgate-sim"


@pytest.fixture(scope="module")
def steady() -> Iterator[Cluster]:
    """1 prefill + 1 decode node at real time for the module's first two drills; the SIGTERM
    drill, last of them, ends its gateway."""
    c = Cluster.create(1, 1, ["--time-scale", "1.0"])
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _running(address: str) -> int:
    import grpc

    from prefixgate.v1 import node_pb2, node_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        st = node_pb2_grpc.NodeStub(ch).Stats(node_pb2.StatsRequest(), timeout=5)
    return int(st.running_requests + st.queued_requests)


def test_client_disconnect_cancels_the_work_on_the_nodes(steady: Cluster) -> None:
    c = steady
    body = {
        "model": MODEL,
        "max_tokens": 800,
        "stream": True,
        "messages": [{"role": "user", "content": "a very long answer please " * 40}],
    }
    for stream in (True, False):
        with httpx.Client(timeout=30) as http:
            if stream:
                with http.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break  # first chunk seen: hang up mid-stream
            else:
                try:
                    http.post(c.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)
                except httpx.ReadTimeout:
                    pass  # the client gave up while the node was generating
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and _running(c.decode[0].address) > 0:
            time.sleep(0.05)
        assert _running(c.decode[0].address) == 0, f"decode still running after hang-up (stream={stream})"


# After the other drill on the module's cluster: it ends the gateway.
def test_sigterm_finishes_inflight_streams_and_refuses_new_work(steady: Cluster) -> None:
    c = steady
    if c.gateway is None or not c.gateway.alive():  # a re-run of this drill: the cluster anew
        c.stop()
        c.start()
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "max_tokens": 150,
            "stream": True,
            "seed": 3,
            "messages": [{"role": "user", "content": "tell a long story " * 50}],
        }
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(10)
    assert c.gateway is not None
    c.gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = False
    try:
        httpx.get(c.url + "/healthz", timeout=2)
    except httpx.HTTPError:
        refused = True
    t.join(30)
    assert refused, "a draining gateway must not accept new connections"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert any('"finish_reason":"length"' in ln or '"finish_reason":"stop"' in ln for ln in lines)
    assert c.gateway.proc.wait(15) == 0


def test_client_gone_before_the_first_token_cancels_the_prefill() -> None:
    """A streaming client that hangs up while its prompt is still being prefilled: the prefill
    stops too (it would otherwise run to the end and hand its pages to a decode nobody reads)."""
    c = Cluster.create(1, 1, ["--time-scale", "50"])
    c.start()
    try:
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "a long document to read " * 1400}],  # ~8.7k tokens
        }
        with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http:
            try:
                with http.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
                    r.read()
            except httpx.ReadTimeout:
                pass  # hung up during the prefill (seconds at this time scale)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and _running(c.prefill[0].address) > 0:
            time.sleep(0.05)
        assert _running(c.prefill[0].address) == 0, "prefill still running after the client hung up"
        assert _running(c.decode[0].address) == 0
    finally:
        c.stop()
