"""Tenant accounting: tokens served per tenant and model, and what they are worth.

Counted from what the engines report: a request's prompt tokens, the part its prefill node served
from KV cache (``cached_tokens``), the rest computed, and the output tokens. Recording is a few
additions in this process (no I/O on the request path); a background task adds the buffer to the
shared store every ``usage_flush_s`` (Redis ``HINCRBY`` per tenant and model in one script, so
the figures of every replica sum), keeping it when the store is away and retrying. The buffer
holds at most ``MAX_PENDING`` tenant/model pairs; beyond, figures are dropped and counted.

Value, at the prices of the gateway that answers (currency units per million tokens):
computed prompt tokens at ``price_input_miss``, cached ones at ``price_input_hit``, output tokens
at ``price_output``. The defaults are the reference deployment's revenue model: input 8 per
million, a cache hit a quarter of that (2); that model prices input only, so output is 0 until
set. Prometheus gets the same figures per replica (``prefixgate_tenant_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from prefixgate.cachetier.tasks import stop_task
from prefixgate.gateway import tally
from prefixgate.gateway.records import record
from prefixgate.gateway.state.store import StateStore, UsageCounts, UsageKey

log = structlog.get_logger("prefixgate.usage")

MAX_PENDING = 10_000
MAX_TENANT_LABELS = 1_000  # Prometheus series per tenant; beyond, "_other"
OTHER = "_other"
MAX_SERIES = 4 * MAX_TENANT_LABELS  # (tenant, model) pairs whose metric children are remembered


@record
class Value:
    """What tokens are worth at the prices, by part (rounded to 6 places, as reported)."""

    input_miss: float
    input_hit: float
    output: float
    total: float

    def parts(self) -> dict[str, float]:
        """The parts the total is the sum of, by name (the metrics' ``part`` label)."""
        return {"input_miss": self.input_miss, "input_hit": self.input_hit, "output": self.output}


@dataclass(frozen=True, slots=True)
class Prices:
    input_miss: float = 8.0
    input_hit: float = 2.0
    output: float = 0.0
    currency: str = "CNY"

    def _amounts(self, computed: int, cached: int, output: int) -> tuple[float, float, float]:
        """What the tokens are worth by part, unrounded."""
        return (computed * self.input_miss / 1e6, cached * self.input_hit / 1e6, output * self.output / 1e6)

    def value(self, c: UsageCounts) -> Value:
        miss, hit, out = self._amounts(c.computed_tokens, c.cached_tokens, c.output_tokens)
        return Value(round(miss, 6), round(hit, 6), round(out, 6), round(miss + hit + out, 6))

    def parts(self, computed: int, cached: int, output: int) -> tuple[float, float, float]:
        """``value``'s three parts, without its total: what a request adds to the value
        counters. A part worth 0 is 0 without a ``round`` (a float's rounding to 6 places was
        half of what counting a request's usage cost)."""
        miss, hit, out = self._amounts(computed, cached, output)
        return (round(miss, 6) if miss else 0.0, round(hit, 6) if hit else 0.0, round(out, 6) if out else 0.0)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One tenant's figures for one model, valued."""

    tenant: str
    model: str
    counts: UsageCounts
    value: Value


@dataclass(frozen=True, slots=True)
class UsageReport:
    """Every replica's figures, per tenant and model (sorted), valued, and their totals."""

    tenant: str | None  # the one tenant asked for; None: every tenant
    prices: Prices
    rows: tuple[UsageRow, ...]
    totals: UsageCounts
    value: Value


class UsageLedger:
    def __init__(
        self,
        state: StateStore,
        prices: Prices,
        registry: CollectorRegistry,
        flush_s: float = 1.0,
    ) -> None:
        self.state = state
        self.prices = prices
        self.flush_s = flush_s
        self._pending: dict[UsageKey, UsageCounts] = {}
        self.dropped = 0
        self.flush_failures = 0
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        self._labels: set[str] = set()
        self._series: dict[UsageKey, tuple[Any, ...]] = {}  # ``_series_of``
        labels = ["tenant", "model"]

        def per_pair(name: str, doc: str, *more: str) -> Any:
            return tally.counter(f"prefixgate_tenant_{name}", doc, [*labels, *more], registry)

        self.m_requests = per_pair("requests", "Requests per tenant and model")
        self.m_prompt = per_pair("prompt_tokens", "Prompt tokens per tenant and model")
        self.m_cached = per_pair(
            "cached_tokens",
            "Prompt tokens served from KV cache (as the engines reported) per tenant and model",
        )
        self.m_computed = per_pair(
            "computed_tokens", "Prompt tokens the engines computed per tenant and model"
        )
        self.m_output = per_pair("output_tokens", "Output tokens per tenant and model")
        self.m_value = per_pair(
            "value",
            f"Value of the tokens served at the configured prices, in {prices.currency} "
            "(part: input_miss, input_hit, output)",
            "part",
        )

    def _label(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return OTHER

    def record(
        self, tenant: str, model: str, prompt: int, cached: int, output: int, requests: int = 1
    ) -> None:
        """Count one request's tokens (no I/O)."""
        # clamped as ``max(0, ...)`` and ``min(cached, prompt)`` would, without their calls
        prompt = prompt if prompt > 0 else 0
        if cached > prompt:
            cached = prompt
        elif cached < 0:
            cached = 0
        output = output if output > 0 else 0
        counts = UsageCounts(requests, prompt, cached, output)
        key = (tenant, model)
        held = self._pending.get(key)
        if held is None:
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
            else:
                self._pending[key] = counts
        else:
            held.add(counts)
        series = self._series.get((tenant, model))
        if series is None:
            series = self._series_of(tenant, model)
        m_requests, m_prompt, m_cached, m_computed, m_output, m_miss, m_hit, m_out = series
        m_requests.inc(requests)
        m_prompt.inc(prompt)
        m_cached.inc(cached)
        m_computed.inc(prompt - cached)
        m_output.inc(output)
        miss, hit, out = self.prices.parts(prompt - cached, cached, output)
        if miss:
            m_miss.inc(miss)
        if hit:
            m_hit.inc(hit)
        if out:
            m_out.inc(out)

    def _series_of(self, tenant: str, model: str) -> tuple[Any, ...]:
        """The metric children a (tenant, model) pair's requests count into, made once: ``labels``
        takes a lock and builds a key on every call. Bounded as the labels are (``_label``):
        tenants past ``MAX_TENANT_LABELS`` share the ``_other`` series and are not remembered."""
        t = self._label(tenant)
        series = (
            self.m_requests.labels(t, model),
            self.m_prompt.labels(t, model),
            self.m_cached.labels(t, model),
            self.m_computed.labels(t, model),
            self.m_output.labels(t, model),
            *(self.m_value.labels(t, model, part) for part in ("input_miss", "input_hit", "output")),
        )
        if t == tenant and len(self._series) < MAX_SERIES:
            self._series[(tenant, model)] = series
        return series

    async def flush(self) -> None:
        """Add what this replica counted to the shared figures; kept for the next try on failure."""
        async with self._flushing:
            batch, self._pending = self._pending, {}
            if not batch:
                return
            try:
                await self.state.usage_add(batch)
            except Exception as e:
                self.flush_failures += 1
                if not self._failing:  # said once per outage
                    self._failing = True
                    log.warning("usage_flush_failed", pairs=len(batch), error=repr(e)[:200])
                for key, counts in batch.items():  # merged back under the same bound
                    held = self._pending.get(key)
                    if held is not None:
                        held.add(counts)
                    elif len(self._pending) < MAX_PENDING:
                        self._pending[key] = counts
                    else:
                        self.dropped += 1
                raise
            if self._failing:
                self._failing = False
                log.info("usage_flush_recovered", pairs=len(batch))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            with contextlib.suppress(Exception):
                await self.flush()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="usage-flush")

    async def close(self, timeout: float = 2.0) -> None:
        task, self._task = self._task, None
        await stop_task(task)  # cancelled until it ends: one cancellation can be lost in a Redis call
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout)

    async def report(self, tenant: str | None = None) -> UsageReport:
        """Every replica's figures (this one's flushed first), per tenant and model, valued."""
        with contextlib.suppress(Exception):
            await self.flush()
        figures = await self.state.usage(tenant)
        rows = []
        totals = UsageCounts()
        for (t, model), c in sorted(figures.items()):
            totals.add(c)
            rows.append(UsageRow(t, model, c, self.prices.value(c)))
        return UsageReport(tenant, self.prices, tuple(rows), totals, self.prices.value(totals))
