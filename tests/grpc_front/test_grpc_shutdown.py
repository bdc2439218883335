"""The gRPC front end's connection limits and shutdown, against a real gateway process with real
gRPC clients: the HTTP front end's sequence (stop accepting, grace, cut with ``shutting_down``,
exit status 4) and bounds (docs/settings.md, gRPC server limits)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.gateway.shutdown import CUT_MESSAGE
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.admin.conftest import MODEL
from tests.faults.cluster import Cluster
from tests.helpers import free_port

# each channel its own connection: gRPC shares connections between a process's channels otherwise
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _long(max_tokens: int = 8000) -> gateway_pb2.CompletionRequest:
    return gateway_pb2.CompletionRequest(model=MODEL, prompt="tell a long story " * 40, max_tokens=max_tokens)


@dataclass
class StreamResult:
    first: threading.Event = field(default_factory=threading.Event)
    chunks: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""
    trailers: dict[str, str] = field(default_factory=dict)


def _generate(stub: gateway_pb2_grpc.GatewayStub, rid: str, out: StreamResult) -> None:
    call = stub.Generate(_long(), metadata=(("x-request-id", rid),), timeout=60)
    try:
        for _ in call:
            out.chunks += 1
            out.first.set()
    except grpc.RpcError:
        pass
    out.code, out.details = call.code(), call.details() or ""
    out.trailers = {k: v for k, v in call.trailing_metadata() or () if isinstance(v, str)}


def _http_stream(url: str, out: StreamResult) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 8000,
        "stream": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    headers = {"x-request-id": "http-cut-1"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.chunks += 1
                out.first.set()
                out.details = line


def _grpc_gateway(env: dict[str, str]) -> tuple[Cluster, str]:
    grpc_port = free_port()
    # nodes 40x slower than real: a stream of 8,000 tokens outlasts any grace
    c = Cluster.create(
        1, 1, ["--time-scale", "40"], gateway_args=["--grpc-port", str(grpc_port)], gateway_env=env
    )
    c.start()
    return c, f"127.0.0.1:{grpc_port}"


def _request_lines(c: Cluster) -> dict[str, dict[str, object]]:
    assert c.gateway is not None
    out = {}
    for line in list(c.gateway.lines):
        if line.startswith("{") and (rec := orjson.loads(line)).get("event") == "request":
            out[str(rec["request_id"])] = rec
    return out


def test_sigterm_cuts_grpc_streams_open_past_the_grace_as_http_ones_and_exits_4() -> None:
    # a 1 s grace (default 10 s) keeps the test short; the sequence is the same
    c, address = _grpc_gateway({"PREFIXGATE_SHUTDOWN_GRACE_S": "1"})
    assert c.gateway is not None
    try:
        results = [StreamResult(), StreamResult()]
        http = StreamResult()
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            threads = [
                threading.Thread(target=_generate, args=(stub, f"grpc-cut-{i}", r))
                for i, r in enumerate(results)
            ]
            threads.append(threading.Thread(target=_http_stream, args=(c.url, http)))
            for t in threads:
                t.start()
            for r in [*results, http]:
                assert r.first.wait(30), "a stream did not start"
            c.gateway.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            time.sleep(0.3)
            # stopped accepting: a new connection is not served
            with grpc.insecure_channel(address, options=OWN_CONNECTION) as fresh:
                with pytest.raises(grpc.RpcError) as refused:
                    health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=1)
            assert refused.value.code() in (  # type: ignore[attr-defined]
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            code = c.gateway.proc.wait(20)
            stopped_after = time.monotonic() - t0
            for t in threads:
                t.join(30)
        for r in results:
            assert r.chunks >= 1
            assert r.code == grpc.StatusCode.UNAVAILABLE, (r.code, r.details)
            assert r.details == CUT_MESSAGE
            assert r.trailers.get("x-prefixgate-error-code") == "shutting_down"
            assert r.trailers.get("retry-after") == "1"
        assert '"code":"shutting_down"' in http.details  # the HTTP stream's last event
        assert code == 4, f"exit status {code}: work was cut, the exit must say so"
        assert 0.9 < stopped_after < 6
        time.sleep(0.2)
        output = "\n".join(c.gateway.lines)
        assert "Traceback" not in output, output[-3000:]
        grace = next(orjson.loads(ln) for ln in c.gateway.lines if "shutdown_grace_ended" in ln)
        assert (grace["cut_requests"], grace["cut_grpc"], grace["cut_http"]) == (3, 2, 1)
        # counted alike: the request line (and prefixgate_requests_total) of a cut call or stream
        lines = _request_lines(c)
        outcomes = {rid: lines[rid]["outcome"] for rid in ("grpc-cut-0", "grpc-cut-1", "http-cut-1")}
        assert set(outcomes.values()) == {"incomplete"}
        assert any('"stage":"grpc"' in ln for ln in c.gateway.lines)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[Cluster, str]]:
    # bounds small enough for a test to reach: 2 connections, 1 call per connection
    env = {"PREFIXGATE_MAX_CONNECTIONS": "2", "PREFIXGATE_GRPC_MAX_CONCURRENT_STREAMS": "1"}
    c, address = _grpc_gateway(env)
    try:
        yield c, address
    finally:
        c.stop()


def _health(channel: grpc.Channel, timeout: float = 3, wait: bool = False) -> None:
    health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=wait
    )


def test_calls_beyond_the_streams_of_a_connection_wait_for_one_to_end(limited: tuple[Cluster, str]) -> None:
    _, address = limited
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = stub.Generate(_long(), timeout=60)
        next(first)
        second = stub.Generate(_long(), timeout=60)
        started = threading.Event()

        def wait_first_chunk() -> None:
            next(second)
            started.set()

        waiter = threading.Thread(target=wait_first_chunk)
        waiter.start()
        try:
            assert not started.wait(1.5), "a second call ran beside the first on one connection"
            first.cancel()
            assert started.wait(10), "the queued call did not start when the first ended"
        finally:
            second.cancel()
            waiter.join(10)


def test_connections_beyond_max_connections_are_refused_until_one_closes(
    limited: tuple[Cluster, str],
) -> None:
    _, address = limited
    a = grpc.insecure_channel(address, options=OWN_CONNECTION)
    b = grpc.insecure_channel(address, options=OWN_CONNECTION)
    try:
        calls = []
        for ch in (a, b):  # each connection busy with a stream: not idle, so kept open
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(_long(), timeout=60)
            next(call)
            calls.append(call)
        with grpc.insecure_channel(address, options=OWN_CONNECTION) as third:
            with pytest.raises(grpc.RpcError) as refused:
                _health(third)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            calls[0].cancel()
            a.close()
            _health(third, timeout=15, wait=True)  # admitted once a connection closed
        calls[1].cancel()
    finally:
        a.close()
        b.close()
