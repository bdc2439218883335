"""Prometheus metrics. One registry per gateway so several can live in one process (tests).

Request-path figures are observed as they happen; node state (breaker, queue depths, KV pool)
is read from the node pool at scrape time by ``NodeCollector``, and the index occupancy is
refreshed by ``Metrics.refresh_index`` just before a scrape renders (the index may be remote).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prefixgate.cachetier.index import IndexStats
from prefixgate.gateway import tally
from prefixgate.gateway.tally import MULTIPROC_ENV

# 1 ms .. 60 s, roughly x2 steps with extra resolution where TTFT targets sit.
LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    8.0,
    13.0,
    20.0,
    30.0,
    45.0,
    60.0,
)


# The series the admin cache view's counts are summed from under gateway workers (``hit_counts``):
# a request observes the node's prefill once, so its count is the node's requests.
_HIT_FIELDS = {
    "prefixgate_prompt_tokens_total": "prompt",
    "prefixgate_cached_tokens_total": "cached",
    "prefixgate_predicted_cached_tokens_total": "predicted",
    "prefixgate_prefill_seconds_count": "requests",
}

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(slots=True)
class HitCounts:
    """Per-node prompt tokens routed, and how many were cached (reported by the node, predicted
    by the index). The admin cache view reads these; Prometheus gets the same as counters."""

    prompt: int = 0
    cached: int = 0
    predicted: int = 0
    requests: int = 0

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    def ratio(self, part: int) -> float:
        return part / self.prompt if self.prompt else 0.0


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One node's state at scrape time (from its last Stats and the gateway's own view)."""

    node: str
    role: str
    breaker: str
    routable: bool
    draining: bool
    queued_requests: int
    queued_tokens: int
    running_requests: int
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int


_NODE_GAUGES = (
    ("breaker", "prefixgate_node_breaker_state", "Circuit breaker per node: 0 closed, 1 half-open, 2 open"),
    ("routable", "prefixgate_node_routable", "1 while the node takes new work"),
    ("draining", "prefixgate_node_draining", "1 while an operator drains the node"),
    ("queued_requests", "prefixgate_node_queued_requests", "Requests queued on the node"),
    ("queued_tokens", "prefixgate_node_queued_tokens", "Prefill tokens queued on the node"),
    ("running_requests", "prefixgate_node_running_requests", "Requests running on the node"),
    ("capacity_blocks", "prefixgate_node_kv_capacity_blocks", "KV pool size of the node in blocks"),
    ("used_blocks", "prefixgate_node_kv_used_blocks", "KV blocks held by the node"),
    ("pinned_blocks", "prefixgate_node_kv_pinned_blocks", "KV blocks pinned on the node"),
)


def _gauge_value(sample: NodeSample, key: str) -> float:
    if key == "breaker":
        return BREAKER_STATES.get(sample.breaker, 2)
    return float(getattr(sample, key))


class NodeCollector(Collector):
    """Gauges per node read at scrape time, so nodes added or removed at runtime show at once."""

    def __init__(self, source: Callable[[], Iterable[NodeSample]]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        samples = list(self.source())
        for key, name, doc in _NODE_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["node", "role"])
            for sample in samples:
                fam.add_metric([sample.node, sample.role], _gauge_value(sample, key))
            yield fam


class HitRatioCollector(Collector):
    """``prefixgate_cache_hit_ratio``, cached / prompt tokens since start, computed when scraped
    from the counts (``Metrics.hit_counts``): under gateway workers every worker's, summed, where
    a gauge each worker set held whichever worker wrote last; and nothing to set per request."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "prefixgate_cache_hit_ratio",
            "Cached / prompt tokens since start (reported by nodes, or predicted)",
            labels=["source"],
        )
        _, t = self.metrics.hit_counts()
        if t.prompt:
            fam.add_metric(["reported"], t.ratio(t.cached))
            fam.add_metric(["predicted"], t.ratio(t.predicted))
        yield fam


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # what every request adds to: plain numbers rendered at scrape in a single process, the
        # workers' summed files under gateway workers (``tally``)
        self.ttft = tally.histogram(
            "prefixgate_ttft_seconds",
            "Time to first token, end to end",
            ["route"],
            LATENCY_BUCKETS,
            r,
        )
        self.ttft_segment = tally.histogram(
            "prefixgate_ttft_segment_seconds",
            "TTFT segments: queue, prefill, transfer (KV to decode), first_token (after transfer)",
            ["segment"],
            LATENCY_BUCKETS,
            r,
        )
        self.prefill = tally.histogram(
            "prefixgate_prefill_seconds",
            "Prefill compute time on the node",
            ["node"],
            LATENCY_BUCKETS,
            r,
        )
        self.transfer = tally.histogram(
            "prefixgate_kv_transfer_seconds",
            "KV page transfer prefill -> decode",
            ["node"],
            LATENCY_BUCKETS,
            r,
        )
        self.transfer_bytes = Counter(
            "prefixgate_kv_transfer_bytes", "KV bytes sent prefill -> decode", registry=r
        )
        self.prompt_tokens = tally.counter("prefixgate_prompt_tokens", "Prompt tokens routed", ["node"], r)
        self.cached_tokens = tally.counter(
            "prefixgate_cached_tokens",
            "Prompt tokens served from KV cache as reported by the node",
            ["node"],
            r,
        )
        self.predicted_cached_tokens = tally.counter(
            "prefixgate_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen node",
            ["node"],
            r,
        )
        self.computed_tokens = tally.counter(
            "prefixgate_computed_tokens",
            "Prompt tokens the node computed (not served from KV cache)",
            ["node"],
            r,
        )
        self.requests = tally.counter(
            "prefixgate_requests", "Requests by route and outcome", ["route", "outcome"], r
        )
        self.retries = Counter(
            "prefixgate_retries",
            "Attempts retried on another node, by the stage and kind of their failure",
            ["stage", "reason"],
            registry=r,
        )
        self.migrations = Counter(
            "prefixgate_migrations",
            "Generations continued on another node after their node failed mid-stream, by why",
            ["reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "prefixgate_fallbacks", "Requests served monolithic as a fallback", ["reason"], registry=r
        )
        self.inflight = Gauge(
            "prefixgate_inflight_requests",
            "Requests in flight in this gateway",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.index_lookup = Histogram(
            "prefixgate_index_lookup_seconds",
            "Index lookup latency",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.index_degraded = Gauge(
            "prefixgate_index_degraded",
            "1 while the shared index is unreachable",
            multiprocess_mode="livemax",
            registry=r,
        )
        self.index_faults = Gauge(
            "prefixgate_index_faults",
            "Shared-index fault counters since start: late_lookups, failed_writes, dropped_writes, "
            "degraded_periods, recoveries, data_losses, resynced_nodes, ...",
            ["kind"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.events_applied = Counter(
            "prefixgate_kv_events", "Node KV events applied to the index", ["kind"], registry=r
        )
        self.resyncs = Counter(
            "prefixgate_index_resyncs", "Node block sets resynchronised", ["reason"], registry=r
        )
        self.kv_events_dropped = Counter(
            "prefixgate_kv_events_dropped",
            "Engine KV events dropped before the index (ZMQ): malformed messages, batches or events, "
            "and batches shed while the subscriber was behind",
            ["what"],
            registry=r,
        )
        self.warm = Counter(
            "prefixgate_warm_requests",
            "Prefill-as-a-service / pin operations per node and outcome",
            ["node", "outcome"],
            registry=r,
        )
        self.evicted_blocks = Counter(
            "prefixgate_admin_evicted_blocks", "KV blocks evicted on operator request", ["node"], registry=r
        )
        self.index_blocks = Gauge(
            "prefixgate_index_blocks",
            "Blocks the index records per node (at the last scrape)",
            ["node"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.index_total_blocks = Gauge(
            "prefixgate_index_total_blocks",
            "Blocks the index records in all (at the last scrape)",
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.tokenizer_cache_bytes = Gauge(
            "prefixgate_tokenizer_cache_bytes",
            "Bytes held by a tokenizer's segment cache (bounded by tokenizer_segment_cache_bytes)",
            ["tokenizer"],
            multiprocess_mode="livesum",
            registry=r,
        )
        # The gateway-held queue (gateway.core.queueing).
        self.queue_depth = Gauge(
            "prefixgate_scheduler_queue_requests",
            "Requests waiting in the gateway's queue, by priority class and tenant",
            ["class", "tenant"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.queue_wait = Histogram(
            "prefixgate_scheduler_wait_seconds",
            "Time requests waited in the gateway's queue before a node could start them",
            ["class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_refused = Counter(
            "prefixgate_scheduler_refused",
            "Requests the scheduler refused, by why: full (a queue bound), shed (a sheddable "
            "request that would miss its TTFT target), expired (waited scheduler_max_wait_s)",
            ["reason", "class"],
            registry=r,
        )
        self.deadline_misses = Counter(
            "prefixgate_scheduler_deadline_misses",
            "Requests with a TTFT target whose first token came later than it",
            ["class"],
            registry=r,
        )
        self.per_node: dict[str, HitCounts] = {}
        self.totals = HitCounts()
        self.scrape_collectors: list[Collector] = []  # read at scrape time, not from files
        hit_ratio = HitRatioCollector(self)
        r.register(hit_ratio)
        self.scrape_collectors.append(hit_ratio)
        self._index_nodes: set[str] = set()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # A finished request's series, by (route, outcome, node, transfer node) and by node:
        # made once, as ``child`` makes one (``observe_request``, ``observe_hit``).
        self._finished: dict[tuple[str, str, str, str | None], tuple[Any, ...]] = {}
        self._hits: dict[str, tuple[Any, ...]] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the request path observes the same few series
        every time, and ``labels`` takes a lock and builds a key on each call. Only for series
        never removed (the per-request ones; ``index_blocks`` is not)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def observe_request(
        self,
        route: str,
        outcome: str,
        *,
        ttft: float,
        queue_s: float,
        prefill_s: float,
        transfer_s: float,
        node: str,
        transfer_node: str | None,
    ) -> None:
        """One finished request's outcome, TTFT and its segments, the node's prefill time (and
        the prefill node's transfer time on the split path)."""
        key = (route, outcome, node, transfer_node)
        series = self._finished.get(key) or self._finished_series(key)
        requests, ttft_h, queue_h, prefill_seg, transfer_seg, first_h, prefill_h, transfer_h = series
        requests.inc()
        ttft_h.observe(ttft)
        queue_h.observe(queue_s)
        prefill_seg.observe(prefill_s)
        transfer_seg.observe(transfer_s)
        first_h.observe(max(0.0, ttft - queue_s - prefill_s - transfer_s))
        prefill_h.observe(prefill_s)
        if transfer_h is not None:
            transfer_h.observe(transfer_s)

    def _finished_series(self, key: tuple[str, str, str, str | None]) -> tuple[Any, ...]:
        """The eight series ``observe_request`` adds to for ``key``, looked up once: its seven
        ``child`` lookups a request (and ``observe_hit``'s four) were half of what observing a
        finished request cost."""
        route, outcome, node, transfer_node = key
        child = self.child
        series = (
            child(self.requests, route, outcome),
            child(self.ttft, route),
            *(child(self.ttft_segment, part) for part in ("queue", "prefill", "transfer", "first_token")),
            child(self.prefill, node),
            child(self.transfer, transfer_node) if transfer_node is not None else None,
        )
        self._finished[key] = series
        return series

    def bind_nodes(self, source: Callable[[], Iterable[NodeSample]]) -> None:
        """Export per-node gauges read from ``source`` at every scrape."""
        collector = NodeCollector(source)
        self.registry.register(collector)
        self.scrape_collectors.append(collector)

    def observe_hit(self, node: str, prompt: int, cached: int, predicted: int) -> None:
        series = self._hits.get(node)
        if series is None:
            child = self.child
            series = self._hits[node] = (
                child(self.prompt_tokens, node),
                child(self.cached_tokens, node),
                child(self.predicted_cached_tokens, node),
                child(self.computed_tokens, node),
                self.per_node.setdefault(node, HitCounts()),
            )
        prompt_c, cached_c, predicted_c, computed_c, counts = series
        prompt_c.inc(prompt)
        cached_c.inc(cached)
        predicted_c.inc(predicted)
        computed_c.inc(prompt - cached if prompt > cached else 0)
        for c in (counts, self.totals):
            c.prompt += prompt
            c.cached += cached
            c.predicted += predicted
            c.requests += 1

    def hit_counts(self) -> tuple[dict[str, HitCounts], HitCounts]:
        """Per node and in all, the prompt tokens routed, cached and predicted, and the
        requests: this process's, or under gateway workers every worker's (summed from their
        metric files, as a scrape sums them), so the admin cache view is the gateway's whichever
        worker answers it."""
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return self.per_node, self.totals
        per: dict[str, HitCounts] = {}
        for family in multiprocess.MultiProcessCollector(None, path).collect():  # type: ignore[no-untyped-call]
            for sample in family.samples:
                field = _HIT_FIELDS.get(sample.name)
                node = sample.labels.get("node")
                if field and node:
                    counts = per.setdefault(node, HitCounts())
                    setattr(counts, field, getattr(counts, field) + int(sample.value))
        totals = HitCounts()
        for field in _HIT_FIELDS.values():
            setattr(totals, field, sum(getattr(c, field) for c in per.values()))
        return per, totals

    def refresh_index(self, stats: IndexStats) -> None:
        """Set the index occupancy gauges; nodes the index forgot disappear from the output."""
        self.index_total_blocks.set(stats.total_blocks)
        self.index_degraded.set(1 if stats.degraded else 0)
        for kind, count in stats.health.items():
            self.index_faults.labels(kind).set(count)
        for node in self._index_nodes - set(stats.nodes):
            self.index_blocks.labels(node).set(0)  # workers' files keep a series: zero it first
            self.index_blocks.remove(node)
        for node, occ in stats.nodes.items():
            self.index_blocks.labels(node).set(occ.blocks)
        self._index_nodes = set(stats.nodes)

    def refresh_tokenizers(self, cache_bytes: Mapping[str, int]) -> None:
        """Set the segment caches' sizes (tokenizer name -> bytes): what the gateway's memory
        grows by, up to its bound, as new text passes; read at scrape time."""
        for name, size in cache_bytes.items():
            self.tokenizer_cache_bytes.labels(name).set(size)

    def render(self) -> bytes:
        """The exposition; under gateway workers (``PROMETHEUS_MULTIPROC_DIR`` set by their
        supervisor) the request-path series are every worker's, summed, beside this worker's
        view of the nodes."""
        path = os.environ.get(MULTIPROC_ENV)
        if not path:
            return generate_latest(self.registry)
        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r, path)  # type: ignore[no-untyped-call]
        for collector in self.scrape_collectors:
            r.register(collector)
        return generate_latest(r)
