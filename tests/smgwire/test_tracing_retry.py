"""A retried request's trace: the failed attempt is a child span of the request's, with the node
and stage that failed and an error status, and the request's ``prefixgate.attempts`` counts it.
A prefill worker registered with a bootstrap port where nothing listens fails its hand-offs (as
in ``test_gateway_over_grpc``); the gateway retries around it."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import httpx

from tests.e2e.test_tracing import _Collector, collector  # noqa: F401 - the collector fixture
from tests.smgwire.conftest import StartNode
from tests.smgwire.test_gateway_over_grpc import body, gateway


async def test_a_failed_attempt_is_a_span_of_the_request(nodes: StartNode, collector: str) -> None:  # noqa: F811
    broken = await nodes("prefill", bootstrap_port=None)
    good = await nodes("prefill")
    dec = await nodes("decode")
    flags = ["--prefill", f"grpc://{broken.address}", "1", "--prefill", f"grpc://{good.address}"]
    flags += ["--decode", f"grpc://{dec.address}"]
    # the batch processor's default 5 s delay, shortened so the test does not wait it out
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    traces = [secrets.token_hex(16) for _ in range(4)]
    async with gateway(*flags, env=env) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for trace_id in traces:
                headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
                r = await http.post("/v1/completions", json=body(), headers=headers)
                assert r.status_code == 200, r.text
    # the gateway has stopped: what it held was exported at its shutdown
    deadline = time.monotonic() + 10
    attempts: list[Any] = []
    while time.monotonic() < deadline and not attempts:
        attempts = [s for _, s in _Collector.spans if s.name == "prefixgate.attempt"]
        await asyncio.sleep(0.1)
    assert attempts, [s.name for _, s in _Collector.spans]
    span = attempts[0]
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["prefixgate.node"].string_value == f"grpc://{broken.address}"
    assert attrs["prefixgate.stage"].string_value and span.status.code == 2  # STATUS_CODE_ERROR
    root = next(
        s for _, s in _Collector.spans if s.name == "prefixgate.request" and s.trace_id == span.trace_id
    )
    assert span.parent_span_id == root.span_id and span.trace_id.hex() in traces
    root_attrs = {a.key: a.value for a in root.attributes}
    assert root_attrs["prefixgate.attempts"].int_value >= 2
    assert root_attrs["prefixgate.prefill_node"].string_value == f"grpc://{good.address}"
