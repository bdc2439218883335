"""The ``BlockIndex`` contract, checked against a small reference model for every implementation.

Hypothesis drives random sequences of stores (chains from the root, fragments after a held
parent, fragments after a missing parent), touches, lookups, closed removals, clears,
resyncs and capacity changes; after every step the implementation must agree with the model
(plain dicts, linear scans) on every node's block set, capacity and lookups.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from prefixgate.cachetier import open_index
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.resilient import ResilientIndex
from tests.cachetier.support import redis_url, test_prefix

CAPACITY = 12  # small, so evictions happen all the time
NODES = ("n0", "n1", "n2")
ROOT = Namespace("contract-model").root()

Path = tuple[int, ...]
T = TypeVar("T")


def chain(path: Path) -> list[int]:
    """Block hashes of a prompt whose blocks are ``path`` (block size 1)."""
    return block_hashes(struct.pack(f"<{len(path)}I", *path), 1, ROOT)


# -- the reference model -----------------------------------------------------------------


class RefNode:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.last_use: dict[int, int] = {}


class RefIndex:
    """What every index must do, written as plainly as possible."""

    def __init__(self, capacity: int) -> None:
        self.default_capacity = capacity
        self.nodes: dict[str, RefNode] = {}
        self.clock = 0
        self.low = 0

    def node(self, name: str) -> RefNode:
        if name not in self.nodes:
            self.nodes[name] = RefNode(self.default_capacity)
        return self.nodes[name]

    def _use(self, n: RefNode, h: int) -> None:
        self.clock += 1
        n.last_use[h] = self.clock

    def _evict(self, n: RefNode, protect: int) -> None:
        while len(n.last_use) > n.capacity and len(n.last_use) > protect:
            oldest = min(n.last_use, key=n.last_use.__getitem__)
            del n.last_use[oldest]

    def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        out = []
        for op in ops:
            n = self.node(op.node)
            if op.parent and op.parent not in n.last_use:
                out.append(False)
                continue
            out.append(True)
            if n.capacity <= 0:
                continue
            keep = list(op.hashes[: n.capacity])
            if op.parent:
                # a fragment: new blocks become the least recent, deepest first; nothing is touched
                for h in keep:
                    if h not in n.last_use:
                        self.low -= 1
                        n.last_use[h] = self.low
                self._evict(n, protect=0)
                continue
            for h in reversed(keep):  # root last: parents stay more recent than children
                self._use(n, h)
            self._evict(n, protect=len(keep))
        return out

    def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None) -> dict[str, int]:
        names = list(self.nodes) if nodes is None else list(nodes)
        out = {}
        for name in names:
            held = self.nodes[name].last_use if name in self.nodes else {}
            run = 0
            while run < len(hashes) and hashes[run] in held:
                run += 1
            out[name] = run
        return out

    def remove(self, name: str, hashes: Sequence[int]) -> int:
        n = self.nodes.get(name)
        if n is None:
            return 0
        return sum(1 for h in set(hashes) if n.last_use.pop(h, None) is not None)

    def clear_node(self, name: str) -> int:
        n = self.nodes.get(name)
        if n is None:
            return 0
        count = len(n.last_use)
        n.last_use.clear()
        return count

    def replace_node(self, name: str, chains: Sequence[Sequence[int]]) -> None:
        self.node(name).last_use.clear()
        self.store([StoreOp(name, tuple(c)) for c in chains])

    def set_capacity(self, name: str, blocks: int) -> None:
        n = self.node(name)
        n.capacity = max(0, blocks)
        self._evict(n, protect=0)


# -- implementations under test ----------------------------------------------------------

Factory = Callable[[], Awaitable[BlockIndex]]


async def _memory() -> BlockIndex:
    return MemoryIndex(CAPACITY)


async def _redis() -> BlockIndex:
    return RedisIndex.from_url(redis_url(), prefix=test_prefix(), default_capacity=CAPACITY)


async def _redis_packed() -> BlockIndex:
    return RedisIndex.from_url(redis_url(), prefix=test_prefix(), layout="packed", default_capacity=CAPACITY)


async def _resilient() -> BlockIndex:
    # generous deadline: this suite checks semantics; degraded mode has its own tests
    return open_index(redis_url(), prefix=test_prefix(), default_capacity=CAPACITY, lookup_timeout=2.0)


async def _purge(index: BlockIndex) -> None:
    if isinstance(index, ResilientIndex):
        assert isinstance(index.primary, RedisIndex)
        assert not index.degraded
        await index.primary.purge()
    elif isinstance(index, RedisIndex):
        await index.purge()


paths = st.lists(st.integers(0, 2), min_size=1, max_size=10).map(tuple)
nodes = st.sampled_from(NODES)


class IndexContract(RuleBasedStateMachine):
    factory: Factory

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.index = self.run(self.factory())
        self.ref = RefIndex(CAPACITY)
        self.paths: dict[int, Path] = {}  # every hash seen -> its path

    def run(self, aw: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await aw

        return self.loop.run_until_complete(wrap())

    def teardown(self) -> None:
        try:
            self.run(_purge(self.index))
            self.run(self.index.close())
        finally:
            self.loop.close()

    def hashes(self, path: Path) -> list[int]:
        hs = chain(path)
        for i, h in enumerate(hs):
            self.paths[h] = path[: i + 1]
        return hs

    def held(self, node: str) -> list[int]:
        n = self.ref.nodes.get(node)
        return sorted(n.last_use) if n is not None else []

    def check_store(self, ops: list[StoreOp]) -> None:
        assert self.run(self.index.store(ops)) == self.ref.store(ops)

    # -- rules ----------------------------------------------------------------------------

    @rule(batch=st.lists(st.tuples(nodes, paths), min_size=1, max_size=4))
    def store_chains(self, batch: list[tuple[str, Path]]) -> None:
        self.check_store([StoreOp(n, tuple(self.hashes(p))) for n, p in batch])

    @rule(node=nodes, ext=paths, data=st.data())
    def store_fragment(self, node: str, ext: Path, data: st.DataObject) -> None:
        held = self.held(node)
        if not held:
            return
        parent = data.draw(st.sampled_from(held))
        base = self.paths[parent]
        frag = self.hashes(base + ext)[len(base) :]
        self.check_store([StoreOp(node, tuple(frag), parent)])

    @rule(node=nodes, path=paths, ext=paths)
    def store_orphan(self, node: str, path: Path, ext: Path) -> None:
        """A fragment whose parent the node does not hold is refused."""
        parent = self.hashes(path)[-1]
        frag = self.hashes(path + ext)[len(path) :]
        self.check_store([StoreOp(node, tuple(frag), parent), StoreOp(node, tuple(self.hashes(ext)))])

    @rule(node=nodes, data=st.data())
    def touch(self, node: str, data: st.DataObject) -> None:
        """Store again (a request that hit): the chain up to a held block becomes most recent."""
        held = self.held(node)
        if not held:
            return
        path = self.paths[data.draw(st.sampled_from(held))]
        self.check_store([StoreOp(node, tuple(self.hashes(path)))])

    @rule(path=paths, which=st.sampled_from(["all", "some", "unknown"]))
    def lookup(self, path: Path, which: str) -> None:
        names: list[str] | None = None
        if which == "some":
            names = ["n1", "n0"]
        elif which == "unknown":
            names = ["n2", "nobody"]
        hs = self.hashes(path)
        assert self.run(self.index.lookup(hs, names)) == self.ref.lookup(hs, names)

    @rule(node=nodes, data=st.data(), extra=paths)
    def remove_closed(self, node: str, data: st.DataObject, extra: Path) -> None:
        """Remove a block with all its descendants (a closed set), plus blocks not held."""
        held = self.held(node)
        victims = [h for h in self.hashes(extra)[-1:] if h not in held]
        if held:
            top = self.paths[data.draw(st.sampled_from(held))]
            victims += [h for h in held if self.paths[h][: len(top)] == top]
        assert self.run(self.index.remove(node, victims)) == self.ref.remove(node, victims)

    @rule(node=st.sampled_from((*NODES, "nobody")))
    def clear_node(self, node: str) -> None:
        assert self.run(self.index.clear_node(node)) == self.ref.clear_node(node)

    @rule(node=nodes, chains=st.lists(paths, max_size=3))
    def replace_node(self, node: str, chains: list[Path]) -> None:
        cs = [self.hashes(p) for p in chains]
        self.run(self.index.replace_node(node, cs))
        self.ref.replace_node(node, cs)

    @rule(node=nodes, blocks=st.integers(-1, CAPACITY + 4))
    def set_capacity(self, node: str, blocks: int) -> None:
        self.run(self.index.set_capacity(node, blocks))
        self.ref.set_capacity(node, blocks)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def same_blocks_and_capacity(self) -> None:
        stats = self.run(self.index.stats())
        assert set(stats.nodes) == set(self.ref.nodes)
        for name, ref in self.ref.nodes.items():
            assert self.run(self.index.node_hashes(name)) == set(ref.last_use)
            assert stats.nodes[name].blocks == len(ref.last_use)
            assert stats.nodes[name].capacity == ref.capacity
        assert stats.total_blocks == sum(len(n.last_use) for n in self.ref.nodes.values())

    @invariant()
    def model_is_prefix_closed(self) -> None:
        for n in self.ref.nodes.values():
            for h in n.last_use:
                path = self.paths[h]
                if len(path) > 1:
                    assert chain(path[:-1])[-1] in n.last_use


# Examples per implementation: nearly all of a run's CPU is Hypothesis drawing the steps, so these
# are sized for one CI run (under 10 s for all four, not 25); with no example database every run
# draws new sequences, so the runs add up to what a larger count would try in one.
IMPLEMENTATIONS: dict[str, tuple[Factory, int]] = {
    "memory": (_memory, 60),
    "redis": (_redis, 40),
    "redis-packed": (_redis_packed, 40),
    "resilient-redis": (_resilient, 20),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_index_contract(impl: str) -> None:
    factory, examples = IMPLEMENTATIONS[impl]
    if impl != "memory":
        redis_url()  # skip or fail before hypothesis starts
    machine = type(f"IndexContract_{impl}", (IndexContract,), {"factory": staticmethod(factory)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
