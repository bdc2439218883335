"""Block pool semantics: prefix reuse, refcounts, leaf-first LRU, pins, capacity, events."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.backends.pool import BlockPool, PoolExhausted


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, int, tuple[int, ...]]] = []

    def stored(self, parent: int, hashes: Sequence[int]) -> None:
        self.log.append(("stored", parent, tuple(hashes)))

    def removed(self, hashes: Sequence[int]) -> None:
        self.log.append(("removed", 0, tuple(hashes)))

    def cleared(self) -> None:
        self.log.append(("cleared", 0, ()))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def store(pool: BlockPool[str], chain: Sequence[int], keep: bool = False) -> int:
    """One request's life: acquire, reserve, commit; release unless ``keep``. Returns reused."""
    k = pool.acquire(chain)
    need = len(chain) - k
    pool.reserve(need)
    pool.commit(chain, k, [f"page{h}" for h in chain[k:]], need)
    if not keep:
        pool.release(chain)
    pool.check()
    return k


def test_prefix_reuse_and_fragment_events() -> None:
    rec = Recorder()
    pool: BlockPool[str] = BlockPool(10, listener=rec)
    assert store(pool, [1, 2, 3]) == 0
    assert store(pool, [1, 2, 3, 4, 5]) == 3
    assert store(pool, [1, 2, 6]) == 2
    assert pool.leading([1, 2, 3, 4, 9]) == 4
    assert pool.payloads([1, 4]) == ["page1", "page4"]
    assert rec.log == [("stored", 0, (1, 2, 3)), ("stored", 3, (4, 5)), ("stored", 2, (6,))]
    # Parents before children in the snapshot.
    order = [h for h, _ in pool.snapshot()]
    assert order.index(2) < order.index(6) and order.index(3) < order.index(4)


def test_lru_evicts_leaves_first_and_keeps_closure() -> None:
    rec = Recorder()
    pool: BlockPool[str] = BlockPool(5, listener=rec)
    store(pool, [1, 2, 3])  # oldest chain
    store(pool, [10, 11])
    store(pool, [20, 21])  # needs 2: the LRU chain goes leaf first
    assert 1 in pool and 2 not in pool and 3 not in pool
    assert rec.log[-2:] == [("removed", 0, (3, 2)), ("stored", 0, (20, 21))]
    store(pool, [1, 30])  # touching 1 makes it recent again; chain 10-11 is the oldest: leaf 11 goes
    assert 1 in pool and 10 in pool and 11 not in pool


def test_parent_not_evicted_while_child_referenced() -> None:
    pool: BlockPool[str] = BlockPool(3)
    store(pool, [1, 2])
    store(pool, [1, 2, 3], keep=True)  # a running request holds the whole chain
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    pool.check()
    assert len(pool) == 3 and pool.reserved == 0
    pool.release([1, 2, 3])
    pool.reserve(1)  # now the leaf 3 goes
    assert 3 not in pool and 1 in pool and 2 in pool
    pool.unreserve(1)
    pool.check()


def test_refcounts_two_holders() -> None:
    pool: BlockPool[str] = BlockPool(2)
    store(pool, [1, 2], keep=True)
    assert pool.acquire([1, 2]) == 2
    pool.release([1, 2])
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
    pool.release([1, 2])
    pool.reserve(2)
    assert len(pool) == 0
    pool.unreserve(2)
    pool.check()


def test_exhaustion_changes_nothing() -> None:
    rec = Recorder()
    pool: BlockPool[str] = BlockPool(4, listener=rec)
    store(pool, [1, 2])
    store(pool, [5, 6], keep=True)
    before = (pool.snapshot(), list(pool.lru), len(rec.log))
    with pytest.raises(PoolExhausted, match="need 3 free blocks"):
        pool.reserve(3)  # only 2 evictable: must not evict them for nothing
    assert (pool.snapshot(), list(pool.lru), len(rec.log)) == before
    pool.check()


def test_concurrent_duplicate_commit() -> None:
    rec = Recorder()
    pool: BlockPool[str] = BlockPool(6, listener=rec)
    assert pool.acquire([1, 2, 3]) == 0
    pool.reserve(3)
    assert pool.acquire([1, 2, 3]) == 0
    pool.reserve(3)
    assert pool.commit([1, 2, 3], 0, ["a", "b", "c"], 3) == 3
    assert pool.commit([1, 2, 3], 0, ["x", "y", "z"], 3) == 0
    assert pool.reserved == 0 and pool.payloads([1, 2, 3]) == ["a", "b", "c"]
    assert [e[0] for e in rec.log] == ["stored"]
    pool.release([1, 2, 3])
    assert pool.counts().referenced == 3
    pool.release([1, 2, 3])
    pool.check()
    assert pool.counts().referenced == 0


def test_concurrent_commit_references_blocks_stored_meanwhile() -> None:
    pool: BlockPool[str] = BlockPool(6)
    store(pool, [1])
    k1 = pool.acquire([1, 2, 3])
    pool.reserve(2)
    k2 = pool.acquire([1, 2, 3, 4])
    pool.reserve(3)
    assert pool.commit([1, 2, 3], k1, ["p2", "p3"], 2) == 2
    assert pool.commit([1, 2, 3, 4], k2, ["x2", "x3", "p4"], 3) == 1  # 2 and 3 were stored meanwhile
    assert pool.payloads([2, 4]) == ["p2", "p4"]
    assert pool.reserved == 0
    pool.release([1, 2, 3])
    pool.release([1, 2, 3, 4])
    pool.check()
    assert pool.counts().referenced == 0


def test_pins_expire() -> None:
    clock = Clock()
    pool: BlockPool[str] = BlockPool(3, clock=clock)
    store(pool, [1, 2])
    assert pool.pin([2, 99], 10.0) == (1, 1)
    assert pool.counts().pinned == 1
    store(pool, [7])
    with pytest.raises(PoolExhausted):
        pool.reserve(2)  # 2 is pinned (and so 1, its parent, is not a leaf); only 7 can go
    clock.t += 11
    assert pool.counts().pinned == 0
    pool.reserve(2)
    assert 2 not in pool
    pool.unreserve(2)


def test_evictable_leaves_out_referenced_pinned_and_their_ancestors() -> None:
    clock = Clock()
    pool: BlockPool[str] = BlockPool(10, clock=clock)
    store(pool, [1, 2, 3])
    store(pool, [1, 2, 4])
    store(pool, [5, 6])
    c = pool.counts()
    assert (c.used, c.evictable, c.in_use) == (6, 6, 0)  # idle and warm: all of it reclaimable
    pool.acquire([5, 6])  # a running request
    pool.reserve(2)  # room for what it computes next
    pool.pin([3], 10.0)  # 1 and 2 stay with it
    c = pool.counts()
    assert (c.used, c.reserved, c.evictable, c.in_use) == (6, 2, 1, 7)  # only 4 may go
    victims = pool._plan_eviction(10)
    assert victims == [4]  # the count is what eviction can take
    clock.t += 11
    pool.release([5, 6])
    pool.unreserve(2)
    assert pool.counts().in_use == 0


def test_unpin() -> None:
    pool: BlockPool[str] = BlockPool(2)
    store(pool, [1, 2])
    pool.pin([1, 2], 60)
    pool.pin([2], 0)
    assert pool.counts().pinned == 1
    pool.reserve(1)
    assert 2 not in pool and 1 in pool


def test_evict_takes_descendants_but_not_referenced_ones() -> None:
    rec = Recorder()
    pool: BlockPool[str] = BlockPool(20, listener=rec)
    store(pool, [1, 2, 3, 4])
    store(pool, [1, 2, 5])
    store(pool, [1, 6], keep=True)
    pool.pin([4], 60)  # pins do not stop an explicit eviction
    gone = pool.evict([2])
    assert set(gone) == {2, 3, 4, 5}
    assert gone.index(4) < gone.index(3) < gone.index(2)
    # 1 has a referenced child (6): neither goes.
    assert pool.evict([1]) == []
    assert 1 in pool and 6 in pool
    pool.check()
    pool.release([1, 6])
    store(pool, [1, 7, 8])
    assert set(pool.evict(everything=True)) == {1, 6, 7, 8}
    assert rec.log[-1] == ("cleared", 0, ())
    assert len(pool) == 0
    pool.check()


def test_evict_everything_keeps_referenced_chains() -> None:
    pool: BlockPool[str] = BlockPool(20)
    store(pool, [1, 2, 3], keep=True)
    store(pool, [1, 2, 9])
    store(pool, [40, 41])
    assert set(pool.evict(everything=True)) == {9, 40, 41}
    assert pool.snapshot() == [(1, 0), (2, 1), (3, 2)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "hold", "release", "evict", "pin"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=5),
        ),
        max_size=40,
    )
)
def test_invariants_under_random_operations(ops: list[tuple[str, list[int]]]) -> None:
    """Chains over a small alphabet; whatever happens the pool stays consistent."""
    clock = Clock()
    pool: BlockPool[str] = BlockPool(6, clock=clock)
    held: list[list[int]] = []

    def chain(path: list[int]) -> list[int]:
        out, h = [], 0
        for x in path:
            h = h * 7 + x + 1
            out.append(h)
        return out

    for op, path in ops:
        c = chain(path)
        if op in ("store", "hold"):
            k = pool.acquire(c)
            try:
                pool.reserve(len(c) - k)
            except PoolExhausted:
                pool.release(c[:k])
            else:
                pool.commit(c, k, ["x"] * (len(c) - k), len(c) - k)
                if op == "hold":
                    held.append(c)
                else:
                    pool.release(c)
        elif op == "release" and held:
            pool.release(held.pop(0))
        elif op == "evict":
            pool.evict(c[:1])
        elif op == "pin":
            pool.pin(c, 5)
            clock.t += 2
        pool.check()
        for h in held:
            assert pool.leading(h) == len(h)  # held chains never lose a block
    for h in held:
        pool.release(h)
    pool.check()
    assert pool.counts().referenced == 0
