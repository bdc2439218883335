"""The gateway-held queue: which waiting request starts next when a node can take one.

Requests that no node can start at once wait here, bounded in count, bytes and time, and leave
in this order:

1. **Priority band**: a lower ``priority`` first (vLLM's meaning). A band's oldest request that
   has waited ``promote_after_s`` goes before the higher bands' (starvation promotion).
2. **Fair share between tenants** within a band: deficit round robin over predicted prefill
   tokens (each tenant's turn adds ``quantum_tokens`` to its allowance; a request leaves when
   its tenant's allowance covers its cost), so a tenant sending ten times as much cannot push
   another's requests back: each active tenant gets an equal share of prefill work. A tenant
   that had nothing waiting starts a turn at once, ahead of the others (as fair queueing does
   for sparse flows): one using less than its share waits for no one's turn to end, and one
   with requests always waiting never counts as new.
3. **Within a tenant**, by the time it should start (its *rank*): its arrival plus
   ``shortest_first`` times its predicted prefill seconds, deferred at most ``max_defer_s``
   (short requests go first; nothing is overtaken by requests that arrived more than
   ``max_defer_s`` after it), and never later than its deadline allows
   (deadline - predicted prefill) when it carries a TTFT target.

Pure: no I/O, no clock of its own (every call takes ``now``), so the live gateway and the trace
simulator queue alike. Removal is lazy: an entry taken out (a client gone, a request expired)
is marked and its counts given back at once; the heaps drop it when it reaches their top.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from prefixgate.gateway.scheduling.classes import Schedule


@dataclass(frozen=True, slots=True)
class QueueLimits:
    max_requests: int = 1024  # waiting at once (0: no queue: what cannot start is refused)
    max_bytes: int = 256 << 20  # the waiting requests' prompts together
    max_wait_s: float = 30.0  # a request waits this long at most, then is refused
    quantum_tokens: int = 8192  # a tenant's allowance per turn of the round robin
    shortest_first: float = 8.0  # rank = arrival + this x predicted prefill seconds ...
    max_defer_s: float = 4.0  # ... deferred at most this much
    promote_after_s: float = 10.0  # a lower band's request waiting this long goes first


DEFAULT_LIMITS = QueueLimits()


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request, as the scheduler sees it."""

    ticket: int
    tenant: str
    schedule: Schedule
    cost_tokens: int  # predicted uncached prefill tokens: what fair share counts
    predicted_s: float  # its prefill on a node of the pool, queue left out
    arrival_s: float
    size_bytes: int = 0
    rank: float = 0.0
    removed: bool = False

    @property
    def deadline_s(self) -> float:
        """The time its first token is due (inf: no target)."""
        slo = self.schedule.ttft_slo_s
        return self.arrival_s + slo if slo > 0 else math.inf


def rank_of(entry: Entry, limits: QueueLimits) -> float:
    """When ``entry`` should start: short first, bounded deferral, its deadline's slack."""
    defer = min(limits.shortest_first * max(0.0, entry.predicted_s), limits.max_defer_s)
    return min(entry.arrival_s + defer, entry.deadline_s - entry.predicted_s)


@dataclass(slots=True)
class _Tenant:
    heap: list[tuple[float, int, Entry]] = field(default_factory=list)
    count: int = 0
    tokens: int = 0
    deficit: int = 0

    def head(self) -> Entry | None:
        heap = self.heap
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


@dataclass(slots=True)
class _Band:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)  # tenants with requests, in turn order
    by_arrival: list[tuple[float, int, Entry]] = field(default_factory=list)
    count: int = 0
    tokens: int = 0

    def oldest(self) -> Entry | None:
        heap = self.by_arrival
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


@dataclass(frozen=True, slots=True)
class Depth:
    """What waits in one band for one tenant, for metrics and the admin API."""

    priority: int
    tenant: str
    requests: int
    tokens: int
    oldest_s: float  # how long its oldest request has waited


class WaitQueue:
    def __init__(self, limits: QueueLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._bands: dict[int, _Band] = {}
        self._entries: dict[int, Entry] = {}
        self._by_tenant: dict[str, deque[Entry]] = {}  # in arrival order, removed ones left lazily
        self._tenant_count: dict[str, int] = {}
        self._by_arrival: list[tuple[float, int, Entry]] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    @property
    def bytes(self) -> int:
        return self._bytes

    def full(self, size_bytes: int) -> str:
        """Why a request of ``size_bytes`` cannot wait now ("": it can)."""
        lim = self.limits
        if len(self._entries) >= lim.max_requests:
            return f"{len(self._entries)} requests are waiting (scheduler_queue_requests={lim.max_requests})"
        if self._bytes + size_bytes > lim.max_bytes:
            return f"the waiting requests hold {self._bytes} bytes (scheduler_queue_bytes={lim.max_bytes})"
        return ""

    def displace(self, tenant: str, size_bytes: int, *, dry_run: bool = False) -> list[Entry]:
        """Make room for a request of ``tenant`` in a full queue at the expense of the tenant
        holding the most waiting requests, if that is another tenant holding more than this one
        would: its latest arrivals are taken out (and returned, to be refused). The bounds are
        shared, and one tenant's flood filling them must not refuse the others. Nothing is taken
        when that would not make room."""
        top = max(self._tenant_count, key=lambda t: self._tenant_count[t], default=None)
        mine = self._tenant_count.get(tenant, 0) + 1
        if top is None or top == tenant:
            return []
        lim = self.limits
        count, held, size = len(self._entries), self._tenant_count[top], self._bytes
        picked: list[Entry] = []
        for e in reversed(self._by_tenant[top]):
            if count < lim.max_requests and size + size_bytes <= lim.max_bytes:
                break
            if held <= mine:
                return []
            if e.removed:
                continue
            picked.append(e)
            count, held, size = count - 1, held - 1, size - e.size_bytes
        if count >= lim.max_requests or size + size_bytes > lim.max_bytes:
            return []
        if dry_run:
            return picked
        for e in picked:
            self.remove(e.ticket)
        return picked

    def push(self, entry: Entry) -> None:
        """Queue ``entry`` (the caller checked ``full``)."""
        entry.rank = rank_of(entry, self.limits)
        band = self._bands.setdefault(entry.schedule.priority, _Band())
        tenant = band.tenants.get(entry.tenant)
        if tenant is None:
            tenant = band.tenants[entry.tenant] = _Tenant()
        if tenant.count == 0:  # it had nothing waiting: its turn starts now (see the docstring)
            band.ring.appendleft(entry.tenant)
            tenant.deficit = max(1, self.limits.quantum_tokens)
        item = (entry.rank, entry.ticket, entry)
        heapq.heappush(tenant.heap, item)
        heapq.heappush(band.by_arrival, (entry.arrival_s, entry.ticket, entry))
        heapq.heappush(self._by_arrival, (entry.arrival_s, entry.ticket, entry))
        tenant.count += 1
        tenant.tokens += entry.cost_tokens
        band.count += 1
        band.tokens += entry.cost_tokens
        self._entries[entry.ticket] = entry
        self._bytes += entry.size_bytes
        self._by_tenant.setdefault(entry.tenant, deque()).append(entry)
        self._tenant_count[entry.tenant] = self._tenant_count.get(entry.tenant, 0) + 1

    def remove(self, ticket: int) -> Entry | None:
        """Take a waiting request out (its client left, it expired); None if it is not waiting."""
        entry = self._entries.pop(ticket, None)
        if entry is None:
            return None
        entry.removed = True
        self._bytes -= entry.size_bytes
        left = self._tenant_count[entry.tenant] - 1
        if left:
            self._tenant_count[entry.tenant] = left
        else:
            del self._tenant_count[entry.tenant]
            del self._by_tenant[entry.tenant]
        priority = entry.schedule.priority
        band = self._bands[priority]
        tenant = band.tenants[entry.tenant]
        tenant.count -= 1
        tenant.tokens -= entry.cost_tokens
        band.count -= 1
        band.tokens -= entry.cost_tokens
        if tenant.count == 0:
            del band.tenants[entry.tenant]
            band.ring.remove(entry.tenant)
        if band.count == 0:
            del self._bands[priority]
        return entry

    def expired(self, now: float) -> list[Entry]:
        """Take out and return the requests that have waited ``max_wait_s``."""
        out: list[Entry] = []
        heap, limit = self._by_arrival, self.limits.max_wait_s
        while heap and (heap[0][2].removed or now - heap[0][0] >= limit):
            entry = heapq.heappop(heap)[2]
            if not entry.removed:
                self.remove(entry.ticket)
                out.append(entry)
        return out

    def next_expiry(self) -> float:
        """When the oldest waiting request will have waited ``max_wait_s`` (inf: none waits)."""
        heap = self._by_arrival
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        return heap[0][0] + self.limits.max_wait_s if heap else math.inf

    def _band(self, now: float) -> _Band | None:
        """The band that goes next: the lowest priority value, unless a band's oldest request
        has waited ``promote_after_s`` (then the band with the oldest such request)."""
        if not self._bands:
            return None
        first = self._bands[min(self._bands)]
        if len(self._bands) == 1:
            return first
        starving: tuple[float, _Band] | None = None
        for band in self._bands.values():
            oldest = band.oldest()
            if oldest is not None and now - oldest.arrival_s >= self.limits.promote_after_s:
                if starving is None or oldest.arrival_s < starving[0]:
                    starving = (oldest.arrival_s, band)
        return starving[1] if starving is not None else first

    def pop(self, now: float) -> Entry | None:
        """The request that starts next, taken out (None: nothing waits)."""
        band = self._band(now)
        if band is None:
            return None
        quantum = max(1, self.limits.quantum_tokens)
        ring = band.ring
        while True:
            # One pass: the first tenant (in turn order) whose allowance covers its head goes.
            for _ in range(len(ring)):
                tenant = band.tenants[ring[0]]
                head = tenant.head()
                assert head is not None  # a tenant in the ring has requests
                if tenant.deficit >= head.cost_tokens:
                    tenant.deficit -= head.cost_tokens
                    self.remove(head.ticket)
                    if tenant.count == 0:
                        tenant.deficit = 0
                    return head
                tenant.deficit += quantum
                ring.rotate(-1)
            # Nobody could go: add the turns the nearest tenant still needs, to all at once.
            short = min(
                (h.cost_tokens - t.deficit for t in band.tenants.values() if (h := t.head()) is not None),
                default=0,
            )
            turns = max(0, math.ceil(short / quantum) - 1)
            for t in band.tenants.values():
                t.deficit += turns * quantum

    def oldest(self) -> Entry | None:
        """The oldest waiting request (for explain and metrics), not taken out."""
        heap = self._by_arrival
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def ahead_tokens(self, tenant: str, priority: int, cost_tokens: int) -> int:
        """Predicted prefill tokens served before a new request of ``tenant`` in band
        ``priority`` (of ``cost_tokens``) would start: the bands before it whole, its own
        tenant's waiting requests, and of every other tenant of its band as much as fair share
        gives them meanwhile (their share up to the same amount). An estimate that errs long:
        its own tenant's shorter requests all count."""
        ahead = sum(b.tokens for p, b in self._bands.items() if p < priority)
        band = self._bands.get(priority)
        if band is None:
            return ahead
        own = band.tenants.get(tenant)
        mine = own.tokens if own is not None else 0
        share = mine + cost_tokens
        ahead += mine
        ahead += sum(min(t.tokens, share) for name, t in band.tenants.items() if name != tenant)
        return ahead

    def depths(self, now: float) -> list[Depth]:
        """What waits, per band and tenant."""
        out: list[Depth] = []
        oldest: dict[tuple[int, str], float] = {}
        for e in self._entries.values():
            k = (e.schedule.priority, e.tenant)
            oldest[k] = min(oldest.get(k, math.inf), e.arrival_s)
        for priority, band in sorted(self._bands.items()):
            for name, t in band.tenants.items():
                since = oldest.get((priority, name), now)
                out.append(Depth(priority, name, t.count, t.tokens, max(0.0, now - since)))
        return out
