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

A node's chains are looked up by block, not one by one: every request with the same system
prompt or the same conversation so far shares its first blocks, so at hundreds of requests a
second a node holds hundreds of chains starting with the same block, and comparing the prompt
with each of them took a fifth of the gateway's time. Instead each node counts the blocks its
chains hold (a block hash names its whole prefix, so the blocks held form a prefix-closed set):
the leading run a prompt shares with any chain is the last of its blocks in that set, a binary
search of dictionary lookups whatever the number of chains.

Counting costs in proportion to a chain's blocks, so it is kept in C and bounded. A chain's first
``counted_blocks`` (4K tokens at 64 a block: a system prompt, a short chat) are counted in when
it is held and counted out, into a second counter, when it is let go of (``Counter.update``, one
call each); a block is held while it went in more often than out. The counters go with a node's
last chain (the common case), and are counted anew from the live chains once as many blocks were
counted out since the last time as the live chains hold, so they never hold much more than
those, at one block counted again for each counted out. The rest of a longer chain is not
counted (a long prompt's 2,000 blocks counted in and out cost more than all the rest of holding
it): such chains are filed by their last counted block and, when a prompt shares all those,
compared with it one by one, as every chain was before (identical chains once, with a count).
Long prompts arrive far less often than short ones, so there are fewer of them to compare.

Pure: no I/O, the caller passes the clock. The live gateway and the trace simulator both use it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from prefixgate.cachetier.index import leading_run
from prefixgate.gateway.routing.base import Policy

DEFAULT_TTL_S = 30.0  # a safety net: entries are normally dropped when their request is served
DEFAULT_GRACE_S = 1.0  # after a prefill: until the index write and the node's event have landed
DEFAULT_MAX_ENTRIES = 4096
DEFAULT_COUNTED_BLOCKS = 64  # a chain's first blocks counted; past them, longer chains compared whole


@dataclass(slots=True)
class _Entry:
    node: str
    hashes: tuple[int, ...]
    expires: float
    live: bool = True


@dataclass(slots=True)
class _Longer:
    """A chain longer than the counted blocks, and how many routed requests hold it."""

    chain: tuple[int, ...]
    holders: int = 0


@dataclass(slots=True)
class _NodeBlocks:
    """A node's held chains: their first blocks counted in and out, the longer ones by anchor."""

    into: Counter[int] = field(default_factory=Counter)
    out: Counter[int] = field(default_factory=Counter)
    tickets: set[int] = field(default_factory=set)
    live: int = 0  # blocks the live chains have counted in
    dropped: int = 0  # blocks counted out since the counters were last made anew
    # a longer chain's last counted block -> its last block (the whole chain's name) -> it
    longer: dict[int, dict[int, _Longer]] = field(default_factory=dict)

    def holds(self, block: int) -> bool:
        return self.into.get(block, 0) > self.out.get(block, 0)


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
    counted_blocks: int = DEFAULT_COUNTED_BLOCKS
    stats: InflightStats = field(default_factory=InflightStats)
    _entries: dict[int, _Entry] = field(default_factory=dict)
    _order: list[tuple[float, int]] = field(default_factory=list)  # heap of (expiry, ticket)
    _held: dict[str, _NodeBlocks] = field(default_factory=dict)
    _next: int = 1

    def __post_init__(self) -> None:
        self.counted_blocks = max(1, self.counted_blocks)  # a chain's first block is always counted

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
        held = self._held.get(node)
        if held is None:
            held = self._held[node] = _NodeBlocks()
        chain, counted = entry.hashes, self.counted_blocks
        held.into.update(chain[:counted])  # one C call, however many blocks
        held.live += min(len(chain), counted)
        held.tickets.add(ticket)
        if len(chain) > counted:
            held.longer.setdefault(chain[counted - 1], {}).setdefault(chain[-1], _Longer(chain)).holders += 1
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

        Block hashes are chained (each covers its whole prefix), so a node's chains cover the
        first ``k`` blocks exactly when block ``k - 1`` is among the blocks they hold: a binary
        search over the prompt's counted blocks; past them, a binary search per longer chain
        that shares all of them.
        """
        self.expire(now)
        out: dict[str, int] = {}
        if not hashes:
            return out
        counted = self.counted_blocks
        n = min(len(hashes), counted)
        counted_part = hashes[:n]
        for node, held in self._held.items():
            best = leading_run(held.holds, counted_part)  # the index's own binary search
            if not best:
                continue
            if best == counted and len(hashes) > counted and held.longer:
                longer = held.longer.get(hashes[counted - 1])
                if longer:
                    best = max(_shared(c.chain, hashes) for c in longer.values())
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
        held = self._held.get(entry.node)
        if held is None:
            return True
        held.tickets.discard(ticket)
        if not held.tickets:  # the node's last chain: its counters go with it
            del self._held[entry.node]
            return True
        chain, counted = entry.hashes, self.counted_blocks
        held.out.update(chain[:counted])  # one C call, however many blocks
        size = min(len(chain), counted)
        held.live -= size
        held.dropped += size
        if held.dropped > held.live + counted:  # as many counted out as the live chains hold
            self._recount(held)
        longer = held.longer.get(chain[counted - 1]) if len(chain) > counted else None
        if longer is not None and chain[-1] in longer:
            same = longer[chain[-1]]
            same.holders -= 1
            if same.holders <= 0:
                del longer[chain[-1]]
                if not longer:
                    del held.longer[chain[counted - 1]]
        return True

    def _recount(self, held: _NodeBlocks) -> None:
        """Count a node's blocks anew from its live chains, the counted-out side emptied."""
        counted = self.counted_blocks
        held.into.clear()
        held.out.clear()
        held.dropped = 0
        for ticket in held.tickets:
            held.into.update(self._entries[ticket].hashes[:counted])


def _shared(chain: Sequence[int], hashes: Sequence[int]) -> int:
    """How many leading blocks ``chain`` and ``hashes`` share (chained hashes: once they differ,
    they differ at every later block, so the positions where they agree are a leading run)."""
    n = min(len(chain), len(hashes))
    if n and chain[n - 1] == hashes[n - 1]:  # the same chain (a repeated prompt): one comparison
        return n
    return leading_run(lambda i: chain[i] == hashes[i], range(n))


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
