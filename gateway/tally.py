"""Counters and histograms kept as plain numbers in this process and rendered when scraped.

Every request adds to a dozen series: its outcome, its TTFT and the TTFT's segments, the node's
prefill, its tokens, its tenant's usage. prometheus_client's metrics take a lock for every
addition and walk a histogram's buckets in Python; here a counter's addition is one ``+=`` and
a histogram's observation one ``bisect`` and two, and the families are built only when
``/metrics`` is read (``collect``). The exposition is the same, but for the ``_created`` series
(when a series was first written), which these leave out, as the gateway workers' summed files
already do.

Under gateway workers (their supervisor sets ``MULTIPROC_ENV``) every worker's figures must reach
the files a scrape sums, which only prometheus_client's own metrics write: ``counter`` and
``histogram`` return those there (the same name, labels and buckets), and these ``Tally`` ones in
a single process. Both take
``labels(*values)`` and have ``inc`` / ``observe``, so the request path does not tell them apart.

Written from one thread (the event loop's); a scrape reads on the same thread.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Set by the gateway workers' supervisor: where the workers' metric files are summed from.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class CounterSeries:
    """One labelled series of a ``TallyCounter``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class HistogramSeries:
    """One labelled series of a ``TallyHistogram``: a count per bucket (the last one +Inf's),
    not cumulative, and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # the first bound at or above the amount: Prometheus' ``le``
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


S = TypeVar("S", CounterSeries, HistogramSeries)


class _Tally(Collector, Generic[S]):
    """A family's series by label values, each made on first use (``_new``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        s = self._series.get(values)
        if s is None:
            if len(values) != len(self.labelnames):
                raise ValueError(
                    f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}"
                )
            s = self._series[values] = self._new()
        return s

    def _new(self) -> S:
        raise NotImplementedError

    def _family(self) -> Metric:
        """The family, no samples yet."""
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        """The family without samples: the registry refuses a second metric of the same name."""
        yield self._family()


class TallyCounter(_Tally[CounterSeries]):
    """A counter family as plain numbers, by label values."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames)

    def _new(self) -> CounterSeries:
        return CounterSeries()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        for values, s in list(self._series.items()):
            family.add_metric(values, s.value)
        yield family


class TallyHistogram(_Tally[HistogramSeries]):
    """A histogram family as plain numbers, by label values; ``buckets`` the upper bounds,
    ascending, without +Inf (always there)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(b) for b in buckets if b != float("inf")]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must ascend")
        self.bounds = tuple(bounds)
        self._les = [*(floatToGoString(b) for b in bounds), "+Inf"]  # type: ignore[no-untyped-call]

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        for values, s in list(self._series.items()):
            running = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._les, s.counts, strict=True):
                running += count
                buckets.append((le, float(running)))
            family.add_metric(values, buckets, s.sum)
        yield family


def _shared(shared: bool | None) -> bool:
    return bool(os.environ.get(MULTIPROC_ENV)) if shared is None else shared


def counter(
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    registry: CollectorRegistry,
    *,
    shared: bool | None = None,
) -> Any:
    """A counter on ``registry``: prometheus_client's when ``shared`` (gateway workers' files;
    None: when this process is a gateway worker), else a ``TallyCounter``."""
    if _shared(shared):
        return Counter(name, documentation, labelnames, registry=registry)
    tally = TallyCounter(name, documentation, labelnames)
    registry.register(tally)
    return tally


def histogram(
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    buckets: Sequence[float],
    registry: CollectorRegistry,
    *,
    shared: bool | None = None,
) -> Any:
    """A histogram on ``registry``: prometheus_client's when ``shared`` (as ``counter``), else a
    ``TallyHistogram``."""
    if _shared(shared):
        return Histogram(name, documentation, labelnames, buckets=buckets, registry=registry)
    tally = TallyHistogram(name, documentation, labelnames, buckets)
    registry.register(tally)
    return tally
