"""In-memory index semantics: leading run, LRU leaves first, capacity, prefix-closed."""

from __future__ import annotations

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
