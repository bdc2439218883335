"""``StateStore`` in this process: the embedded default (one gateway, nothing shared).

Documents and pins keep the in-process bookkeeping they always had (``DocumentStore``,
``PinLedger``); membership changes are already applied by the one gateway that made them, and
usage is summed here. Nothing outlives the process, so nothing needs a TTL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefixgate.gateway.scheduling.token_limits import Check, Outcome, WindowSet
from prefixgate.gateway.state.documents import DocumentLimits, DocumentStore
from prefixgate.gateway.state.quotas import PinLedger, PinLimits
from prefixgate.gateway.state.store import (
    DocumentUsage,
    Member,
    PinHold,
    PinRow,
    UsageCounts,
    UsageKey,
)

MAX_MEMBERS = 4096
MAX_USAGE_KEYS = 100_000  # tenant/model pairs: far beyond any configured key list


class MemoryState:
    backend = "memory"

    def __init__(self) -> None:
        self.documents = DocumentStore()
        self._pins = PinLedger()
        self._members: dict[str, Member] = {}
        self._switches: tuple[dict[str, bool], float] | None = None
        self._usage: dict[UsageKey, UsageCounts] = {}
        self.dropped_usage = 0
        self._windows = WindowSet()

    async def doc_put(self, tenant: str, doc_id: str, text: str, cost: int, limits: DocumentLimits) -> None:
        self.documents.limits = limits
        self.documents.put(tenant, text, doc_id)

    async def doc_get(self, tenant: str, doc_ids: Sequence[str]) -> list[str | None]:
        found = [self.documents.find(tenant, d) for d in doc_ids]
        return [d.text if d is not None else None for d in found]

    async def doc_delete(self, tenant: str, doc_id: str) -> bool:
        return self.documents.delete(tenant, doc_id)

    async def doc_usage(self, tenant: str) -> DocumentUsage:
        u = self.documents.usage(tenant)
        return DocumentUsage(u.documents, u.bytes)

    async def pin_reserve(
        self,
        tenant: str,
        capacities: Mapping[str, int],
        hashes: Sequence[int],
        seconds: float,
        now: float,
        limits: PinLimits,
    ) -> PinHold:
        self._pins.limits = limits
        grant = self._pins.reserve(tenant, capacities, hashes, seconds, now)
        return PinHold(tenant, grant.until, grant.before)

    async def pin_cancel(self, hold: PinHold, node_id: str) -> None:
        previous = hold.before.pop(node_id, None)
        if previous is not None:
            self._pins.restore(hold.tenant, node_id, previous, hold.until)

    async def pins(self, tenant: str | None, now: float) -> list[PinRow]:
        rows: list[PinRow] = []
        for t in [tenant] if tenant is not None else self._pins.tenants():
            for node, entries in sorted(self._pins.entries(t, now).items()):
                if entries:
                    ends = entries.values()
                    rows.append(PinRow(t, node, len(entries), max(ends), min(ends)))
        return rows

    async def member_put(self, member: Member) -> None:
        if member.address not in self._members and len(self._members) >= MAX_MEMBERS:
            return
        self._members[member.address] = member

    async def members(self) -> list[Member]:
        return list(self._members.values())

    async def switches_put(self, values: Mapping[str, bool], at: float) -> None:
        self._switches = (dict(values), at)

    async def switches_get(self) -> tuple[dict[str, bool], float] | None:
        return None if self._switches is None else (dict(self._switches[0]), self._switches[1])

    async def usage_add(self, batch: Mapping[UsageKey, UsageCounts]) -> None:
        for key, counts in batch.items():
            held = self._usage.get(key)
            if held is None:
                if len(self._usage) >= MAX_USAGE_KEYS:
                    self.dropped_usage += 1
                    continue
                held = self._usage[key] = UsageCounts()
            held.add(counts)

    async def usage(self, tenant: str | None) -> dict[UsageKey, UsageCounts]:
        return {
            k: UsageCounts(*v.values()) for k, v in self._usage.items() if tenant is None or k[0] == tenant
        }

    async def limit_reserve(self, tenant: str, checks: Sequence[Check], now_ms: int) -> Outcome:
        own = [Check(_counter(tenant, c.counter), c.limit, c.cost) for c in checks]
        return self._windows.reserve(own, now_ms)

    async def limit_settle(
        self, tenant: str, deltas: Sequence[tuple[str, int]], bucket: int, now_ms: int
    ) -> None:
        self._windows.settle([(_counter(tenant, c), d) for c, d in deltas], bucket, now_ms)

    async def limit_used(self, tenant: str, counters: Sequence[str], now_ms: int) -> list[int]:
        return [self._windows.used(_counter(tenant, c), now_ms) for c in counters]

    async def close(self) -> None:
        return None


def _counter(tenant: str, counter: str) -> str:
    return f"{tenant}\x1f{counter}"
