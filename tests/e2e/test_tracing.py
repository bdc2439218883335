"""OpenTelemetry traces through the gateway, received by a real OTLP/HTTP endpoint on loopback
(the collector's protocol: protobuf ``ExportTraceServiceRequest`` POSTed to ``/v1/traces``).

A chat sent with a client's ``traceparent`` through a prefill and a decode node of ours gives
one trace: the gateway's request span a child of the client's, its stages (prefill, KV transfer,
first token) child spans, route, nodes and tokens as attributes; both nodes log the gateway's
span context as they received it; the request's log line carries the trace id. With no endpoint
configured nothing is set up, and the client's context reaches the nodes unchanged.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import Handler, free_port, serve_http, spawn


class _Collector(Handler):
    spans: ClassVar[list[Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name", "")
            for ss in rs.scope_spans:
                type(self).spans.extend((service, s) for s in ss.spans)
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.reply(200 if self.path == "/v1/traces" else 404, out, "application/x-protobuf")


@pytest.fixture
def collector() -> Iterator[str]:
    _Collector.spans = []
    with serve_http(_Collector) as url:
        yield url


def _node(role: str) -> tuple[Child, str]:
    proc = spawn(["node", "--role", role, "--port", "0", "--ready-line"])
    m = proc.wait_for(processes.NODE_READY, timeout=60)
    return proc, json.loads(m.group(0))["address"]


ROUTES = {"prefixgate": "disaggregated", "smg": "monolithic"}


def _stack(env: dict[str, str], protocol: str = "prefixgate") -> tuple[list[Child], str]:
    """Our protocol: a prefill and a decode node; the SMG protocol (``grpc://``): one node as a
    worker of the monolithic pool, the gateway tokenizing with the tokenizer it offers."""
    procs: list[Child] = []
    if protocol == "prefixgate":
        p, paddr = _node("prefill")
        procs.append(p)
        d, daddr = _node("decode")
        procs.append(d)
        flags = ["--prefill", paddr, "--decode", daddr]
    else:
        m, maddr = _node("monolithic")
        procs.append(m)
        flags = ["--worker-urls", f"grpc://{maddr}"]
    port = free_port()
    g = spawn(["gateway", "--port", str(port), *flags], env=env)
    procs.append(g)
    base = f"http://127.0.0.1:{port}"
    g.wait_until(processes.answers_http(base + "/readyz"), 60)
    return procs, base


def _chat(base: str, traceparent: str, route: str = "disaggregated") -> str:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="prefixgate-sim",
        messages=[{"role": "user", "content": "trace me " * 200}],  # a few blocks to prefill and hand over
        max_tokens=4,
        extra_headers={"traceparent": traceparent},
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["x-prefixgate-route"] == route
    return str(raw.headers["x-prefixgate-request-id"])


def _trace(trace_id: str, names: set[str], timeout: float = 15.0) -> list[Any]:
    """The spans received of one trace, once spans of all ``names`` are in (or time is up)."""
    deadline = time.monotonic() + timeout
    spans: list[Any] = []
    while time.monotonic() < deadline:
        spans = [s for _, s in _Collector.spans if s.trace_id.hex() == trace_id]
        if names <= {s.name for s in spans}:
            break
        time.sleep(0.1)
    return spans


def _lines(proc: Child, event: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [json.loads(x) for x in list(proc.lines) if f'"{event}"' in x and x.startswith("{")]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.parametrize("protocol", ["prefixgate", "smg"])
def test_a_request_is_one_trace_that_reaches_the_nodes(collector: str, protocol: str) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector,
        # the batch processor's default 5 s delay, shortened so the test does not wait it out
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    procs, base = _stack(env, protocol)
    nodes, gateway = procs[:-1], procs[-1]
    try:
        request_id = _chat(base, f"00-{trace_id}-{client_span}-01", ROUTES[protocol])
        split = {"prefixgate.prefill", "prefixgate.kv_transfer"} if protocol == "prefixgate" else set()
        spans = _trace(trace_id, {"prefixgate.request", "prefixgate.first_token", *split})
        by_name = {s.name: s for s in spans}
        root = by_name["prefixgate.request"]
        assert root.parent_span_id.hex() == client_span  # a child of the client's span
        attrs = {a.key: a.value for a in root.attributes}
        assert attrs["prefixgate.route"].string_value == ROUTES[protocol]
        assert attrs["prefixgate.request_id"].string_value == request_id
        assert attrs["prefixgate.prompt_tokens"].int_value > 0
        assert attrs["prefixgate.decode_node"].string_value
        stages = {n for n in by_name if n != "prefixgate.request"}
        assert "prefixgate.first_token" in stages, stages
        if protocol == "prefixgate":
            assert attrs["prefixgate.prefill_node"].string_value
            assert split <= stages, stages
        for name in stages:
            child = by_name[name]
            assert child.parent_span_id == root.span_id
            assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
            assert child.end_time_unix_nano <= root.end_time_unix_nano
        assert {svc for svc, s in _Collector.spans if s.trace_id.hex() == trace_id} == {"prefixgate"}

        # every node got the gateway's span as the parent of its work
        sent = f"00-{trace_id}-{root.span_id.hex()}-01"
        for node in nodes:
            got = _lines(node, "trace_context_received")
            assert got and got[-1]["traceparent"] == sent and got[-1]["trace_id"] == trace_id, got
        line = next(x for x in _lines(gateway, "request") if x.get("request_id") == request_id)
        assert line["trace_id"] == trace_id
    finally:
        processes.stop_all(reversed(procs))


def test_without_an_endpoint_the_clients_context_is_passed_on_unchanged() -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    procs, base = _stack({})
    try:
        traceparent = f"00-{trace_id}-{client_span}-01"
        request_id = _chat(base, traceparent)
        assert not _lines(procs[2], "tracing_on", timeout=0)
        for node in procs[:2]:
            got = _lines(node, "trace_context_received")
            assert got and got[-1]["traceparent"] == traceparent, got
        line = next(x for x in _lines(procs[2], "request") if x.get("request_id") == request_id)
        assert line["trace_id"] == trace_id
        # a malformed one is not passed on
        _chat(base, "00-not-a-trace-01")
        assert len(_lines(procs[0], "trace_context_received")) == 1
    finally:
        processes.stop_all(reversed(procs))


def test_a_call_to_the_grpc_front_end_is_traced_too(collector: str) -> None:
    import grpc

    from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    procs: list[Child] = []
    try:
        p, paddr = _node("prefill")
        d, daddr = _node("decode")
        procs += [p, d]
        port, grpc_port = free_port(), free_port()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # as above
        g = spawn(
            [
                "gateway",
                "--port",
                str(port),
                "--grpc-port",
                str(grpc_port),
                "--prefill",
                paddr,
                "--decode",
                daddr,
            ],
            env=env,
        )
        procs.append(g)
        g.wait_until(processes.answers_http(f"http://127.0.0.1:{port}/readyz"), 60)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            done = gateway_pb2_grpc.GatewayStub(channel).Complete(
                gateway_pb2.CompletionRequest(model="prefixgate-sim", prompt="trace me " * 200, max_tokens=3),
                metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),),
                timeout=30,
            )
        assert done.route == "disaggregated"
        spans = _trace(trace_id, {"prefixgate.request", "prefixgate.prefill", "prefixgate.first_token"})
        root = next(s for s in spans if s.name == "prefixgate.request")
        assert root.parent_span_id.hex() == client_span
        attrs = {a.key: a.value for a in root.attributes}
        assert attrs["rpc.method"].string_value == "Complete"
        assert attrs["prefixgate.route"].string_value == "disaggregated"
        assert {"prefixgate.prefill", "prefixgate.first_token"} <= {s.name for s in spans}
    finally:
        processes.stop_all(reversed(procs))
