"""In-memory index semantics: leading run, LRU leaves first, capacity, prefix-closed."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.cachetier.index import StoreOp, leading_run
from prefixgate.cachetier.memory import IndexCore, NodeBlocks


def test_lookup_returns_the_leading_run_per_node() -> None:
    core = IndexCore()
    core.store([StoreOp("a", (1, 2, 3, 4)), StoreOp("b", (1, 2)), StoreOp("c", (9,))])
    assert core.lookup([1, 2, 3, 5]) == {"a": 3, "b": 2, "c": 0}
    assert core.lookup([1, 2, 3, 4, 5, 6], nodes=["a", "zzz"]) == {"a": 4, "zzz": 0}
    assert core.lookup([]) == {"a": 0, "b": 0, "c": 0}


def test_lru_evicts_leaves_before_parents() -> None:
    nb = NodeBlocks(capacity=5)
    nb.store([1, 2, 3])
    nb.store([1, 2, 4, 5])  # 1,2 shared; now 5 blocks
    evicted = nb.store([7, 8])  # needs 2 slots: oldest leaves go first
    assert evicted == [3, 5]
    assert 1 in nb and 2 in nb and 4 in nb
    # Prefix-closed: every held block's chain is held.
    assert nb.leading([1, 2, 4]) == 3


def test_parent_stays_more_recent_than_children() -> None:
    nb = NodeBlocks(capacity=3)
    nb.store([1, 2, 3])
    nb.touch([1])
    evicted = nb.store([9])
    assert evicted == [3]  # the leaf, not its recently touched root


def test_fragment_store_needs_its_parent() -> None:
    core = IndexCore()
    assert core.store([StoreOp("a", (1, 2))]) == [True]
    assert core.store([StoreOp("a", (3,), parent=2), StoreOp("a", (8,), parent=7)]) == [True, False]
    assert core.lookup([1, 2, 3]) == {"a": 3}


def test_chain_longer_than_capacity_keeps_its_head() -> None:
    nb = NodeBlocks(capacity=3)
    nb.store([1, 2, 3, 4, 5])
    assert set(nb.blocks) == {1, 2, 3}
    assert nb.leading([1, 2, 3, 4, 5]) == 3


def test_remove_clear_replace_capacity() -> None:
    core = IndexCore()
    core.store([StoreOp("a", (1, 2, 3))])
    assert core.remove("a", [3, 99]) == 1
    assert core.lookup([1, 2, 3]) == {"a": 2}
    core.replace_node("a", [[5, 6], [5, 7]])
    assert core.lookup([5, 7]) == {"a": 2}
    assert core.lookup([1]) == {"a": 0}
    core.set_capacity("a", 1)
    assert len(core.nodes["a"]) == 1 and 5 in core.nodes["a"]
    assert core.clear_node("a") == 1
    assert core.stats().total_blocks == 0


def test_binary_search_agrees_with_a_linear_scan_on_prefix_closed_sets() -> None:
    hashes = list(range(100, 200))
    for k in range(0, 101):
        held = set(hashes[:k])
        assert leading_run(held.__contains__, hashes) == k


class _Reference:
    """NodeBlocks as it was written first, one block at a time in Python: what the C-call
    version must keep doing."""

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def store(self, hashes: list[int], parent: int = 0) -> list[int]:
        if parent and parent not in self.blocks:
            raise KeyError(parent)
        keep = hashes[: self.capacity]
        if parent:
            for h in keep:
                if h not in self.blocks:
                    self.blocks[h] = None
                    self.blocks.move_to_end(h, last=False)
            return self._evict(0)
        for h in reversed(keep):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        return self._evict(len(keep))

    def _evict(self, protect: int) -> list[int]:
        out, over = [], len(self.blocks) - self.capacity
        while over > 0 and len(self.blocks) > protect:
            out.append(self.blocks.popitem(last=False)[0])
            over -= 1
        return out

    def remove(self, hashes: list[int]) -> int:
        return sum(1 for h in hashes if self.blocks.pop(h, 0) is None)


OPS = st.lists(
    st.tuples(st.sampled_from(["store", "fragment", "remove"]), st.lists(st.integers(1, 40), max_size=12)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 30), ops=OPS)
def test_stores_and_removals_keep_the_reference_order_and_evictions(capacity: int, ops: list[Any]) -> None:
    nb, ref = NodeBlocks(capacity), _Reference(capacity)
    for op, hashes in ops:
        chain = list(dict.fromkeys(hashes))
        if op == "remove":
            assert nb.remove(chain) == ref.remove(chain)
        elif op == "fragment" and ref.blocks:
            parent = next(iter(ref.blocks))
            assert nb.store(chain, parent) == ref.store(chain, parent)
        else:
            assert nb.store(chain) == ref.store(chain)
        assert list(nb.blocks) == list(ref.blocks)
