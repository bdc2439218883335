"""Per-tenant pin quotas: which blocks each tenant holds pinned on which node, and until when.

Pinned blocks cannot be evicted, so a tenant pinning without limit takes the KV pools from
everyone else. Before a tenant's pin reaches a node, ``PinLedger.reserve`` checks what the tenant
would then hold against its limits (blocks on one node, blocks on all nodes together) and records
it; a pin that did not happen is given back (``PinGrant.cancel``), and an expired pin gives its
blocks back by itself. A block counts once per node however often it is re-pinned; re-pinning
what the tenant already holds only extends it.

Pure bookkeeping, no I/O: the caller passes the clock (``now``, monotonic seconds) and each
node's KV capacity. The gateway's clock and the node's differ by the network delay only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prefixgate.openai.exceptions import InvalidRequest, QuotaExceeded


def first_expiry(until: Iterable[float], now: float) -> float | None:
    """Seconds until the first of these pins expires and gives blocks back (None: none held).
    Only offered when the pin could fit once they have: retrying a pin too big for the quota
    itself never helps."""
    first = min(until, default=None)
    return None if first is None else max(1.0, first - now)


@dataclass(frozen=True, slots=True)
class PinLimits:
    blocks_per_node: int = 512
    node_share: float = 0.25  # of a node's KV pool, when its capacity is known
    blocks: int = 1024  # on all nodes together
    max_seconds: float = 3600.0

    def node_limit(self, capacity: int) -> int:
        """Blocks a tenant may hold pinned on a node of ``capacity`` blocks (0: unknown)."""
        if capacity <= 0:
            return self.blocks_per_node
        return min(self.blocks_per_node, int(self.node_share * capacity))


def too_long(seconds: float, lim: PinLimits) -> InvalidRequest:
    return InvalidRequest(
        f"'pin_seconds' is {seconds:g}; a tenant may pin for at most {lim.max_seconds:g} s (pin_max_seconds)",
        param="pin_seconds",
        code="pin_too_long",
    )


def node_quota_exceeded(
    node_id: str,
    wanted: int,
    after: int,
    limit: int,
    capacity: int,
    lim: PinLimits,
    retry_after: float | None,
) -> QuotaExceeded:
    return QuotaExceeded(
        f"pinning {wanted} blocks on {node_id} would hold {after} pinned there; a tenant "
        f"may hold {limit} on one node (pin_quota_blocks_per_node={lim.blocks_per_node}, "
        f"pin_quota_node_share={lim.node_share:g} of {capacity or 'unknown'} blocks)",
        param="pin_seconds",
        code="pin_quota_exceeded",
        retry_after=retry_after,
    )


def total_quota_exceeded(total: int, lim: PinLimits, retry_after: float | None) -> QuotaExceeded:
    return QuotaExceeded(
        f"this pin would hold {total} blocks pinned over all nodes; a tenant may hold "
        f"{lim.blocks} (pin_quota_blocks)",
        param="pin_seconds",
        code="pin_quota_exceeded",
        retry_after=retry_after,
    )


@dataclass(slots=True)
class PinGrant:
    """A reservation: what each node's entries were before it, to give back a pin that failed."""

    ledger: PinLedger
    tenant: str
    until: float = 0.0
    before: dict[str, dict[int, float | None]] = field(default_factory=dict)

    def cancel(self, node_id: str) -> None:
        """The pin on ``node_id`` did not happen: restore the tenant's entries there."""
        previous = self.before.pop(node_id, None)
        if previous is not None:
            self.ledger.restore(self.tenant, node_id, previous, self.until)

    def cancel_all(self) -> None:
        for node_id in list(self.before):
            self.cancel(node_id)


class PinLedger:
    def __init__(self, limits: PinLimits | None = None) -> None:
        self.limits = limits or PinLimits()
        self._held: dict[str, dict[str, dict[int, float]]] = {}  # tenant -> node -> hash -> until

    def held(self, tenant: str, now: float) -> dict[str, int]:
        """Blocks ``tenant`` holds pinned now, per node (expired pins dropped)."""
        nodes = self._held.get(tenant)
        if not nodes:
            return {}
        for node_id in list(nodes):
            entries = nodes[node_id]
            for h in [h for h, until in entries.items() if until <= now]:
                del entries[h]
            if not entries:
                del nodes[node_id]
        if not nodes:
            del self._held[tenant]
            return {}
        return {node_id: len(entries) for node_id, entries in nodes.items()}

    def tenants(self) -> list[str]:
        return list(self._held)

    def entries(self, tenant: str, now: float) -> dict[str, dict[int, float]]:
        """Node -> block hash -> until, of what ``tenant`` holds pinned now (a copy)."""
        self.held(tenant, now)
        return {node: dict(e) for node, e in self._held.get(tenant, {}).items()}

    def reserve(
        self,
        tenant: str,
        capacities: Mapping[str, int],
        hashes: Sequence[int],
        seconds: float,
        now: float,
    ) -> PinGrant:
        """Record ``hashes`` pinned for ``seconds`` on every node of ``capacities`` (node id ->
        KV capacity in blocks, 0 if unknown), or raise without recording anything.

        Raises InvalidRequest past the longest pin, QuotaExceeded past a block limit; both name
        the setting.
        """
        lim = self.limits
        if seconds > lim.max_seconds:
            raise too_long(seconds, lim)
        grant = PinGrant(self, tenant)
        if seconds <= 0 or not hashes:
            return grant
        wanted = set(hashes)
        held = self.held(tenant, now)
        nodes = self._held.get(tenant, {})
        total = sum(held.values())
        for node_id, capacity in capacities.items():
            entries = nodes.get(node_id, {})
            after = len(entries) + sum(1 for h in wanted if h not in entries)
            limit = lim.node_limit(capacity)
            if after > limit:
                raise node_quota_exceeded(
                    node_id,
                    len(wanted),
                    after,
                    limit,
                    capacity,
                    lim,
                    first_expiry(entries.values(), now) if len(wanted) <= limit else None,
                )
            total += after - len(entries)
        if total > lim.blocks:
            raise total_quota_exceeded(
                total,
                lim,
                first_expiry((u for e in nodes.values() for u in e.values()), now)
                if len(wanted) * len(capacities) <= lim.blocks
                else None,
            )
        until = grant.until = now + seconds
        for node_id in capacities:
            entries = self._held.setdefault(tenant, {}).setdefault(node_id, {})
            grant.before[node_id] = {h: entries.get(h) for h in wanted}
            for h in wanted:
                entries[h] = max(entries.get(h, 0.0), until)
        return grant

    def restore(
        self, tenant: str, node_id: str, previous: Mapping[int, float | None], granted: float
    ) -> None:
        entries = self._held.get(tenant, {}).get(node_id)
        if entries is None:
            return
        for h, until in previous.items():
            if entries.get(h) != granted:
                continue  # extended since by another pin of the tenant: that one holds it now
            if until is None:
                del entries[h]
            else:
                entries[h] = until
        if not entries:
            del self._held[tenant][node_id]
            if not self._held[tenant]:
                del self._held[tenant]
