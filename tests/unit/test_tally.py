"""``gateway.tally``: the request path's counters and histograms as plain numbers render, when
scraped, exactly what prometheus_client's own metrics render for the same observations (but
for the ``_created`` series, which they leave out)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from prefixgate.gateway import tally
from prefixgate.gateway.metrics import LATENCY_BUCKETS, Metrics

# on a bound (an observation equal to ``le`` counts in it), between, below every bound, above
# every bound (+Inf only), zero and a negative one
AMOUNTS = (0.001, 0.0015, 0.0, -0.5, 0.002, 59.9, 60.0, 61.0, 1e9, 0.3, 0.3, 2.5)


def _lines(registry: CollectorRegistry) -> list[str]:
    return [
        line
        for line in generate_latest(registry).decode().splitlines()
        if "_created" not in line  # when a series was first written: prometheus_client's alone
    ]


def test_a_histogram_renders_as_prometheus_clients_does() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ["route"], buckets=LATENCY_BUCKETS, registry=theirs)
    t = tally.histogram("x_seconds", "doc", ["route"], LATENCY_BUCKETS, ours, shared=False)
    assert isinstance(t, tally.TallyHistogram)
    for i, amount in enumerate(AMOUNTS):
        route = ("a", "b")[i % 2]
        h.labels(route).observe(amount)
        t.labels(route).observe(amount)
    assert _lines(ours) == _lines(theirs)
    assert 'x_seconds_bucket{le="0.001",route="a"} 2.0' in _lines(ours)  # 0.001 and 0.0 (and -0.5: b)


def test_a_counter_renders_as_prometheus_clients_does() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    c = Counter("x_tokens", "doc", ["node", "tenant"], registry=theirs)
    t = tally.counter("x_tokens", "doc", ["node", "tenant"], ours, shared=False)
    for node, tenant, amount in (("n1", "t", 5), ("n2", "t", 0), ("n1", "t", 2.5), ("n1", "u", 1)):
        c.labels(node, tenant).inc(amount)
        t.labels(node, tenant).inc(amount)
    assert _lines(ours) == _lines(theirs)
    assert 'x_tokens_total{node="n1",tenant="t"} 7.5' in _lines(ours)


def test_bad_use_is_refused_as_prometheus_client_refuses_it() -> None:
    r = CollectorRegistry()
    t = tally.counter("x", "doc", ["node"], r, shared=False)
    with pytest.raises(ValueError, match="1 label values expected, got 2"):
        t.labels("a", "b")
    with pytest.raises(ValueError, match="non-negative"):
        t.labels("a").inc(-1)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        tally.counter("x", "doc", ["node"], r, shared=False)
    with pytest.raises(ValueError, match="ascend"):
        tally.histogram("y", "doc", [], (1.0, 0.5), r, shared=False)


def test_under_gateway_workers_they_are_prometheus_clients_own() -> None:
    r = CollectorRegistry()
    assert isinstance(tally.counter("x", "doc", [], r, shared=True), Counter)
    assert isinstance(tally.histogram("y", "doc", [], (1.0,), r, shared=True), Histogram)


def test_a_request_observed_is_in_the_scrape() -> None:
    m = Metrics()
    m.observe_request(
        "disaggregated",
        "ok",
        ttft=0.5,  # binary fractions: the first-token segment left is exact
        queue_s=0.125,
        prefill_s=0.25,
        transfer_s=0.0625,
        node="p1",
        transfer_node="p1",
    )
    m.observe_hit("p1", prompt=1000, cached=640, predicted=512)
    text = m.render().decode()
    for line in (
        'prefixgate_requests_total{outcome="ok",route="disaggregated"} 1.0',
        'prefixgate_ttft_seconds_bucket{le="0.5",route="disaggregated"} 1.0',
        'prefixgate_ttft_seconds_bucket{le="0.3",route="disaggregated"} 0.0',
        'prefixgate_ttft_segment_seconds_sum{segment="first_token"} 0.0625',
        'prefixgate_kv_transfer_seconds_count{node="p1"} 1.0',
        'prefixgate_computed_tokens_total{node="p1"} 360.0',
        'prefixgate_cache_hit_ratio{source="reported"} 0.64',
    ):
        assert line in text.splitlines(), line


def test_requests_of_other_routes_outcomes_and_nodes_are_counted_apart() -> None:
    """The series a finished request adds to are looked up once for its route, outcome, node and
    transfer node: each combination keeps its own."""
    m = Metrics()
    seen = [
        ("disaggregated", "ok", "p1", "p1"),
        ("disaggregated", "ok", "p2", "p2"),
        ("monolithic", "ok", "d1", None),
        ("monolithic", "failed", "d1", None),
        ("disaggregated", "ok", "p1", "p1"),
    ]
    for route, outcome, node, transfer in seen:
        m.observe_request(
            route,
            outcome,
            ttft=1.0,
            queue_s=0.0,
            prefill_s=0.5,
            transfer_s=0.25,
            node=node,
            transfer_node=transfer,
        )
        m.observe_hit(node, prompt=100, cached=40, predicted=30)
    lines = m.render().decode().splitlines()
    for line in (
        'prefixgate_requests_total{outcome="ok",route="disaggregated"} 3.0',
        'prefixgate_requests_total{outcome="ok",route="monolithic"} 1.0',
        'prefixgate_requests_total{outcome="failed",route="monolithic"} 1.0',
        'prefixgate_kv_transfer_seconds_count{node="p1"} 2.0',
        'prefixgate_kv_transfer_seconds_count{node="p2"} 1.0',
        'prefixgate_prefill_seconds_count{node="d1"} 2.0',
        'prefixgate_ttft_segment_seconds_count{segment="queue"} 5.0',
        'prefixgate_computed_tokens_total{node="p1"} 120.0',
        'prefixgate_prompt_tokens_total{node="d1"} 200.0',
    ):
        assert line in lines, line
    assert not [x for x in lines if x.startswith("prefixgate_kv_transfer_seconds_count") and "d1" in x]
    per_node, totals = m.hit_counts()
    assert per_node["p1"].requests == 2 and per_node["d1"].cached == 80
    assert (totals.requests, totals.prompt, totals.cached, totals.predicted) == (5, 500, 200, 150)
