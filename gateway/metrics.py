"""Prometheus metrics. One registry per gateway so several can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "prefixgate_ttft_seconds",
            "Time to first token, end to end",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_segment = Histogram(
            "prefixgate_ttft_segment_seconds",
            "TTFT segments: queue, prefill, transfer (KV to decode), first_token (after transfer)",
            ["segment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "prefixgate_prefill_seconds",
            "Prefill compute time on the node",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer = Histogram(
            "prefixgate_kv_transfer_seconds",
            "KV page transfer prefill -> decode",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "prefixgate_kv_transfer_bytes", "KV bytes sent prefill -> decode", registry=r
        )
        self.prompt_tokens = Counter("prefixgate_prompt_tokens", "Prompt tokens routed", ["node"], registry=r)
        self.cached_tokens = Counter(
            "prefixgate_cached_tokens",
            "Prompt tokens served from KV cache as reported by the node",
            ["node"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "prefixgate_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen node",
            ["node"],
            registry=r,
        )
        self.hit_ratio = Gauge(
            "prefixgate_cache_hit_ratio",
            "Cached / prompt tokens since start (reported by nodes, or predicted)",
            ["source"],
            registry=r,
        )
        self.requests = Counter(
            "prefixgate_requests", "Requests by route and outcome", ["route", "outcome"], registry=r
        )
        self.retries = Counter(
            "prefixgate_retries", "Attempts retried on another node", ["stage"], registry=r
        )
        self.fallbacks = Counter(
            "prefixgate_fallbacks", "Requests served monolithic as a fallback", ["reason"], registry=r
        )
        self.inflight = Gauge(
            "prefixgate_inflight_requests", "Requests in flight in this gateway", registry=r
        )
        self.index_lookup = Histogram(
            "prefixgate_index_lookup_seconds",
            "Index lookup latency",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.index_degraded = Gauge(
            "prefixgate_index_degraded", "1 while the shared index is unreachable", registry=r
        )
        self.events_applied = Counter(
            "prefixgate_kv_events", "Node KV events applied to the index", ["kind"], registry=r
        )
        self.resyncs = Counter(
            "prefixgate_index_resyncs", "Node block sets resynchronised", ["reason"], registry=r
        )
        self._prompt_total = 0
        self._cached_total = 0
        self._predicted_total = 0

    def observe_hit(self, node: str, prompt: int, cached: int, predicted: int) -> None:
        self.prompt_tokens.labels(node).inc(prompt)
        self.cached_tokens.labels(node).inc(cached)
        self.predicted_cached_tokens.labels(node).inc(predicted)
        self._prompt_total += prompt
        self._cached_total += cached
        self._predicted_total += predicted
        if self._prompt_total:
            self.hit_ratio.labels("reported").set(self._cached_total / self._prompt_total)
            self.hit_ratio.labels("predicted").set(self._predicted_total / self._prompt_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
