"""Prefixes routed to a node and still being computed there: what the index cannot show yet.

The index learns a node's blocks when its prefill is done (the gateway's own record and the
node's KV events). A request that arrives while an earlier one with the same prefix is still
queued or computing sees no hit anywhere, and the policy sends it wherever the load is lightest:
its prefix is computed twice. Routers that keep their own tree (sglang-router, smg) insert the
request's prefix at routing time instead ("optimistic insert").

``InflightPrefixes`` is that insert, kept beside the index rather than in it (the index holds
what nodes report, shared by every gateway replica): each routed chain is held for its node
until the request's prefill is done (then for a short grace, while the index write and the
node's event land) or fails, and in any case no longer than ``ttl_s``. ``hits`` gives, per node,
the leading run of a prompt's blocks that routed chains cover; ``merge_hits`` combines it with
the index's answer. A node serves its queue in order, so a request sent behind one computing its
prefix finds that prefix cached when its own turn comes.

Chains are kept whole, filed by node and first block: holding and letting go of one costs the
same whatever its length (a 128K-token prompt is 2,000 blocks, each counted in and out one by
one before, on the event loop), and a lookup compares the prompt with the chains of its first
block only. Block hashes are chained, so two chains agree up to a point and differ from there on.

Pure: no I/O, the caller passes the clock. The live gateway and the trace simulator both use it.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from prefixgate.gateway.routing.base import Policy

DEFAULT_TTL_S = 30.0  # a safety net: entries are normally dropped when their request is served
DEFAULT_GRACE_S = 1.0  # after a prefill: until the index write and the node's event have landed
DEFAULT_MAX_ENTRIES = 4096


@dataclass(slots=True)
class _Entry:
    node: str
    hashes: tuple[int, ...]
    expires: float
    live: bool = True


@dataclass(slots=True)
class InflightStats:
    added: int = 0
    done: int = 0
    expired: int = 0
    dropped: int = 0  # evicted because the table was full
    lookups: int = 0
    extended: int = 0  # lookups where a routed chain reaches further than the index on some node


@dataclass(slots=True)
class InflightPrefixes:
    """Chains routed to nodes and not yet (or only just) in the index."""

    ttl_s: float = DEFAULT_TTL_S
    grace_s: float = DEFAULT_GRACE_S
    max_entries: int = DEFAULT_MAX_ENTRIES
    stats: InflightStats = field(default_factory=InflightStats)
    _entries: dict[int, _Entry] = field(default_factory=dict)
    _order: list[tuple[float, int]] = field(default_factory=list)  # heap of (expiry, ticket)
    # node -> first block -> ticket -> chain: the chains a prompt starting with that block may share
    _held: dict[str, dict[int, dict[int, tuple[int, ...]]]] = field(default_factory=dict)
    _next: int = 1

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, node: str, hashes: Sequence[int], now: float) -> int:
        """Hold ``hashes`` (a chain from the root) for ``node``; returns a ticket (0: nothing held)."""
        if not hashes or self.ttl_s <= 0:
            return 0
        self.expire(now)
        while len(self._entries) >= max(1, self.max_entries) and self._order:
            _, old = heapq.heappop(self._order)
            if self._drop(old):
                self.stats.dropped += 1
        ticket = self._next
        self._next += 1
        entry = _Entry(node, tuple(hashes), now + self.ttl_s)
        self._entries[ticket] = entry
        heapq.heappush(self._order, (entry.expires, ticket))
        self._held.setdefault(node, {}).setdefault(entry.hashes[0], {})[ticket] = entry.hashes
        self.stats.added += 1
        return ticket

    def done(self, ticket: int, now: float, *, served: bool) -> None:
        """The request's prefill is over: keep its chain ``grace_s`` more if it was served (the
        index is about to show it), else drop it now."""
        entry = self._entries.get(ticket)
        if entry is None:
            return
        self.stats.done += 1
        if served and self.grace_s > 0:
            entry.expires = min(entry.expires, now + self.grace_s)
            heapq.heappush(self._order, (entry.expires, ticket))
        else:
            self._drop(ticket)

    def expire(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            _, ticket = heapq.heappop(order)
            entry = self._entries.get(ticket)
            if entry is not None and entry.expires <= now and self._drop(ticket):
                self.stats.expired += 1

    def hits(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per node holding routed chains, the leading run of ``hashes`` they cover (0s left out).

        Block hashes are chained (each covers its whole prefix), so a chain covers the first
        ``k`` blocks exactly when its block ``k - 1`` is the prompt's: a binary search per chain
        that starts with the prompt's first block; a node covers the longest of its chains' runs.
        """
        self.expire(now)
        out: dict[str, int] = {}
        if not hashes:
            return out
        first = hashes[0]
        for node, roots in self._held.items():
            chains = roots.get(first)
            if not chains:
                continue
            best = max(_shared(chain, hashes) for chain in chains.values())
            if best:
                out[node] = best
        return out

    def forget(self, node: str, hashes: Collection[int] | None = None) -> int:
        """Drop ``node``'s chains holding any of ``hashes`` (None: all of them), as when its blocks
        are evicted on purpose; returns the chains dropped."""
        gone = [
            t
            for t, e in self._entries.items()
            if e.node == node and (hashes is None or any(h in hashes for h in e.hashes))
        ]
        for t in gone:
            self._drop(t)
        return len(gone)

    def _drop(self, ticket: int) -> bool:
        entry = self._entries.pop(ticket, None)
        if entry is None:
            return False
        roots = self._held.get(entry.node)
        if roots is not None:
            root = entry.hashes[0]
            chains = roots.get(root)
            if chains is not None:
                chains.pop(ticket, None)
                if not chains:
                    del roots[root]
            if not roots:
                del self._held[entry.node]
        return True


def _shared(chain: Sequence[int], hashes: Sequence[int]) -> int:
    """How many leading blocks ``chain`` and ``hashes`` share (chained hashes: once they differ,
    they differ at every later block)."""
    n = min(len(chain), len(hashes))
    if n and chain[n - 1] == hashes[n - 1]:
        return n
    lo, hi = 0, n  # they share [:lo]; they do not share [:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] == hashes[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def follows_inflight(policy: Policy) -> bool:
    """Whether ``policy`` routes on in-flight prefixes too: only one with a load bound may (its
    ``follows_inflight`` attribute). Without one, a prefix every request shares keeps pulling
    every request onto the node that is computing it, which then always has one in flight."""
    return bool(getattr(policy, "follows_inflight", False))


def merge_hits(index: Mapping[str, int], inflight: Mapping[str, int]) -> dict[str, int]:
    """Per node, the longer of the two leading runs (both sets are prefix-closed, so the leading
    run of their union is the longer one)."""
    out = dict(index)
    for node, k in inflight.items():
        if k > out.get(node, 0):
            out[node] = k
    return out


def extension(index: Mapping[str, int], inflight: Mapping[str, int]) -> int:
    """Blocks by which routed chains reach past the index's longest hit (0: they add nothing)."""
    best = max(index.values(), default=0)
    return max(0, max(inflight.values(), default=0) - best)
