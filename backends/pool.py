"""A paged KV block pool keyed by chained block hashes. Pure: no I/O, no asyncio.

Semantics:

- Fixed capacity in blocks. A block is keyed by its chained hash, so a block names its whole
  prefix; the pool is **prefix-closed** (a block is held only while its parent is).
- A request ``acquire``s the longest held prefix of its chain (refcount +1 each), ``reserve``s
  room for the blocks it still has to compute, ``commit``s them once computed and finally
  ``release``s the whole chain. Referenced blocks are never evicted.
- Unreferenced blocks sit in an LRU list. Releasing a chain re-inserts it leaf first, root
  last, so a parent is always more recent than its children (the touch-in-reverse trick of
  ``cachetier.memory``): evicting least-recent-first takes leaves before parents. Eviction
  also skips any block that still has children and any pinned block, so closure always holds.
- Reservation fails with ``PoolExhausted`` without evicting anything when even evicting every
  evictable block would not make room: a failed request never changes the pool.
- Changes go to a ``PoolListener`` (the KV event log) as STORED fragments and REMOVED sets.
- ``counts()`` tells held blocks apart from *evictable* ones (unreferenced, unpinned, no pinned
  descendant: what the next reservation may take back), as SGLang's radix cache tells its
  evictable size apart; blocks in use are ``used + reserved - evictable``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class PoolExhausted(Exception):
    """Not enough evictable blocks to make room; nothing was changed."""


class PoolListener(Protocol):
    def stored(self, parent: int, hashes: Sequence[int]) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


@dataclass(slots=True)
class Block(Generic[T]):
    hash: int
    parent: int  # 0 = root
    payload: T
    refs: int = 0
    pin_until: float = 0.0
    children: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class PoolCounts:
    capacity: int
    used: int
    reserved: int
    referenced: int
    pinned: int
    evictable: int = 0  # held blocks a reservation may evict (cached, nobody needs them now)

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    @property
    def in_use(self) -> int:
        """Blocks nobody may take: referenced, pinned (and their ancestors) or reserved, i.e.
        ``capacity - (free + evictable)``, what SGLang reports as used."""
        return self.used + self.reserved - self.evictable


class BlockPool(Generic[T]):
    """Blocks with payloads of type ``T`` (KV pages), refcounts, pins and leaf-first LRU."""

    def __init__(
        self,
        capacity: int,
        listener: PoolListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.listener = listener
        self.clock = clock
        self.blocks: dict[int, Block[T]] = {}  # insertion order: parents before children
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks, least recent first
        self.reserved = 0
        self._pinned: dict[int, float] = {}
        self._referenced = 0

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def leading(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are held."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def payloads(self, hashes: Sequence[int]) -> list[T]:
        return [self.blocks[h].payload for h in hashes]

    def counts(self) -> PoolCounts:
        pinned = self.pinned_count()
        return PoolCounts(
            self.capacity, len(self.blocks), self.reserved, self._referenced, pinned, self.evictable_count()
        )

    def evictable_count(self) -> int:
        """Held blocks that are neither referenced nor pinned nor the ancestor of a pinned one.
        A referenced block's ancestors are referenced (chains are taken from the root), so only
        pins need a walk up; O(pinned blocks)."""
        blocks = self.blocks
        kept: set[int] = set()
        for h in self._pinned:
            while h and h not in kept:
                b = blocks.get(h)
                if b is None or b.refs > 0:
                    break  # referenced: already counted, and so are its ancestors
                kept.add(h)
                h = b.parent
        return len(blocks) - self._referenced - len(kept)

    def pinned_count(self) -> int:
        now = self.clock()
        expired = [h for h, until in self._pinned.items() if until <= now]
        for h in expired:
            del self._pinned[h]
        return len(self._pinned)

    def snapshot(self) -> list[tuple[int, int]]:
        """Every block as (hash, parent), parents before children."""
        return [(b.hash, b.parent) for b in self.blocks.values()]

    # -- a request's life: acquire, reserve, commit, release ---------------------------------

    def acquire(self, hashes: Sequence[int]) -> int:
        """Reference the longest held prefix of ``hashes``; returns its length in blocks."""
        n = self.leading(hashes)
        for h in hashes[:n]:
            self._ref(self.blocks[h])
        return n

    def reserve(self, n: int) -> None:
        """Make room for ``n`` blocks (evicting LRU leaves) or raise ``PoolExhausted``."""
        if n <= 0:
            return
        short = n - (self.capacity - len(self.blocks) - self.reserved)
        if short > 0:
            victims = self._plan_eviction(short)
            if len(victims) < short:
                free = self.capacity - len(self.blocks) - self.reserved
                raise PoolExhausted(
                    f"KV pool exhausted: need {n} free blocks, {free} free and {len(victims)} evictable"
                    f" of {self.capacity} ({self._referenced} referenced, {self.pinned_count()} pinned,"
                    f" {self.reserved} reserved)"
                )
            self._remove(victims)
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved = max(0, self.reserved - n)

    def commit(self, hashes: Sequence[int], start: int, payloads: Sequence[T], reserved: int) -> int:
        """Store ``hashes[start:]`` (``payloads`` aligned with them) for a request that holds
        ``hashes[:start]`` and reserved ``reserved`` blocks; the request now holds the whole chain.

        Blocks another request stored meanwhile are referenced instead. Returns blocks added.
        """
        if len(payloads) != len(hashes) - start:
            raise ValueError("one payload per new block")
        if reserved < len(hashes) - start:
            raise ValueError(f"commit of {len(hashes) - start} blocks with only {reserved} reserved")
        self.unreserve(reserved)
        blocks = self.blocks
        parent = hashes[start - 1] if start > 0 else 0
        i = start
        while i < len(hashes) and hashes[i] in blocks:  # stored concurrently: a leading run
            self._ref(blocks[hashes[i]])
            parent = hashes[i]
            i += 1
        fragment_parent = parent
        added = 0
        for j in range(i, len(hashes)):
            h = hashes[j]
            if h in blocks:
                raise ValueError(f"block {h:#x} already held under another parent")
            if parent and parent not in blocks:
                raise ValueError(f"parent {parent:#x} of block {h:#x} is not held")
            blocks[h] = Block(h, parent, payloads[j - start], refs=1)
            self._referenced += 1
            if parent:
                blocks[parent].children.add(h)
            parent = h
            added += 1
        if added and self.listener is not None:
            self.listener.stored(fragment_parent, list(hashes[i:]))
        return added

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one reference from each of ``hashes`` (a chain from the root), leaf first."""
        blocks = self.blocks
        lru = self.lru
        for h in reversed(hashes):
            b = blocks.get(h)
            if b is None or b.refs <= 0:
                continue
            b.refs -= 1
            if b.refs == 0:
                self._referenced -= 1
                lru[h] = None
                lru.move_to_end(h)

    # -- pins and explicit eviction ----------------------------------------------------------

    def pin(self, hashes: Iterable[int], seconds: float) -> tuple[int, int]:
        """Keep these blocks from LRU eviction for ``seconds`` (0 unpins). Returns (pinned, missing)."""
        until = self.clock() + seconds if seconds > 0 else 0.0
        pinned = missing = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None:
                missing += 1
                continue
            pinned += 1
            b.pin_until = max(b.pin_until, until) if seconds > 0 else 0.0
            if b.pin_until > 0:
                self._pinned[h] = b.pin_until
            else:
                self._pinned.pop(h, None)
        return pinned, missing

    def evict(self, hashes: Iterable[int] = (), *, everything: bool = False) -> list[int]:
        """Remove these blocks and all their descendants, pins notwithstanding, except any
        block with a referenced descendant (in use by a running request). ``everything``:
        every such block in the pool. Returns what went, children before parents."""
        if everything:
            roots = [b.hash for b in self.blocks.values() if b.parent == 0]
        else:
            roots = [h for h in dict.fromkeys(hashes) if h in self.blocks]
        victims: list[int] = []
        for root in roots:
            if root in self.blocks:
                self._collect_free_subtree(root, victims)
        victims = list(dict.fromkeys(victims))
        if everything and len(victims) == len(self.blocks):
            self._drop(victims)
            if victims and self.listener is not None:
                self.listener.cleared()
            return victims
        self._remove(victims)
        return victims

    def _collect_free_subtree(self, root: int, out: list[int]) -> bool:
        """Post-order collect of ``root``'s subtree; returns True when all of it can go."""
        stack: list[tuple[int, bool]] = [(root, False)]
        removable: dict[int, bool] = {}
        while stack:
            h, expanded = stack.pop()
            b = self.blocks[h]
            if not expanded:
                stack.append((h, True))
                stack.extend((c, False) for c in b.children)
                continue
            ok = b.refs == 0 and all(removable[c] for c in b.children)
            removable[h] = ok
            if ok:
                out.append(h)
        return removable[root]

    # -- internals ---------------------------------------------------------------------------

    def _ref(self, b: Block[T]) -> None:
        if b.refs == 0:
            self._referenced += 1
            self.lru.pop(b.hash, None)
        b.refs += 1

    def _plan_eviction(self, n: int) -> list[int]:
        """Up to ``n`` evictable blocks in LRU order, leaves first (one pass: parents are
        more recent than children, so a parent freed by evicting its last child comes later)."""
        now = self.clock()
        blocks = self.blocks
        gone_children: dict[int, int] = {}
        victims: list[int] = []
        for h in self.lru:
            if len(victims) >= n:
                break
            b = blocks[h]
            if b.pin_until > now:
                continue
            if len(b.children) > gone_children.get(h, 0):
                continue
            victims.append(h)
            if b.parent:
                gone_children[b.parent] = gone_children.get(b.parent, 0) + 1
        return victims

    def _remove(self, victims: Sequence[int]) -> None:
        if not victims:
            return
        self._drop(victims)
        if self.listener is not None:
            self.listener.removed(list(victims))

    def _drop(self, victims: Sequence[int]) -> None:
        blocks = self.blocks
        for h in victims:
            b = blocks.pop(h)
            self.lru.pop(h, None)
            self._pinned.pop(h, None)
            if b.parent:
                p = blocks.get(b.parent)
                if p is not None:
                    p.children.discard(h)

    def check(self) -> None:
        """Assert the invariants (tests): closure, refcounts, LRU membership, capacity."""
        referenced = 0
        for h, b in self.blocks.items():
            assert b.hash == h
            if b.parent:
                assert b.parent in self.blocks, f"{h:#x} held without parent"
                assert h in self.blocks[b.parent].children
            for c in b.children:
                assert self.blocks[c].parent == h
            assert b.refs >= 0
            if b.refs:
                referenced += 1
                assert h not in self.lru
            else:
                assert h in self.lru
        assert referenced == self._referenced
        assert len(self.lru) == len(self.blocks) - referenced
        assert len(self.blocks) + self.reserved <= self.capacity
