"""In-memory index: the embedded default, and the pure core the simulator drives directly."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat

from prefixgate.cachetier.index import (
    DEFAULT_CAPACITY_BLOCKS,
    IndexStats,
    NodeOccupancy,
    StoreOp,
    leading_run,
)


class NodeBlocks:
    """One node's blocks in LRU order (least recent first). Pure, no I/O."""

    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def store(self, hashes: Sequence[int], parent: int = 0) -> list[int]:
        """Store a chain (after ``parent``, 0 = root); returns the blocks evicted to make room.

        Raises KeyError when ``parent`` is not held (the caller's view is out of date).
        """
        if parent and parent not in self.blocks:
            raise KeyError(parent)
        if self.capacity <= 0:
            return []
        keep = list(hashes[: self.capacity])
        blocks = self.blocks
        if parent:
            # A fragment: the parent's ancestors are not in view, so nothing here may become
            # more recent than them. New blocks enter as the least recent (deepest first out).
            for h in keep:
                if h not in blocks:
                    blocks[h] = None
                    blocks.move_to_end(h, last=False)
            return self._evict_over(protect=0)
        # A chain from the root: touch in reverse so the parent stays more recent than every child.
        if blocks.keys().isdisjoint(keep):  # all new (a cold prompt): added in one call, in C
            blocks.update(dict.fromkeys(reversed(keep)))
        else:
            for h in reversed(keep):
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
        return self._evict_over(protect=len(keep))

    def _evict_over(self, protect: int) -> list[int]:
        """The least recent blocks dropped until the node is within its capacity, never the
        ``protect`` most recent ones: listed and dropped in two C calls (a long prompt stored
        on a full node evicts some 2,000 blocks; one by one that took 0.4 ms of the event loop)."""
        blocks = self.blocks
        over = min(len(blocks) - self.capacity, len(blocks) - protect)
        if over <= 0:
            return []
        evicted = list(islice(blocks, over))
        deque(map(blocks.__delitem__, evicted), maxlen=0)
        return evicted

    def touch(self, hashes: Sequence[int]) -> None:
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)

    def remove(self, hashes: Iterable[int]) -> int:
        """How many of ``hashes`` were held (each is dropped): one C call over them."""
        return list(map(self.blocks.pop, hashes, repeat(0))).count(None)

    def set_capacity(self, capacity: int) -> list[int]:
        self.capacity = max(0, capacity)
        return self._evict_over(protect=0)

    def leading(self, hashes: Sequence[int]) -> int:
        return leading_run(self.blocks.__contains__, hashes)


class IndexCore:
    """The index semantics for many nodes, synchronous and pure."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.nodes: dict[str, NodeBlocks] = {}
        self.default_capacity = default_capacity

    def node(self, node: str) -> NodeBlocks:
        nb = self.nodes.get(node)
        if nb is None:
            nb = self.nodes[node] = NodeBlocks(self.default_capacity)
        return nb

    def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        names = self.nodes.keys() if nodes is None else nodes
        out: dict[str, int] = {}
        for name in names:
            nb = self.nodes.get(name)
            out[name] = nb.leading(hashes) if nb is not None else 0
        return out

    def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        results: list[bool] = []
        for op in ops:
            try:
                self.node(op.node).store(op.hashes, op.parent)
                results.append(True)
            except KeyError:
                results.append(False)
        return results

    def remove(self, node: str, hashes: Iterable[int]) -> int:
        nb = self.nodes.get(node)
        return nb.remove(hashes) if nb is not None else 0

    def clear_node(self, node: str) -> int:
        nb = self.nodes.get(node)
        if nb is None:
            return 0
        n = len(nb)
        nb.blocks.clear()
        return n

    def drop_node(self, node: str) -> int:
        nb = self.nodes.pop(node, None)
        return len(nb) if nb is not None else 0

    def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        nb = self.node(node)
        nb.blocks.clear()
        for chain in chains:
            nb.store(chain)

    def set_capacity(self, node: str, blocks: int) -> None:
        self.node(node).set_capacity(blocks)

    def stats(self) -> IndexStats:
        occ = {n: NodeOccupancy(n, len(nb), nb.capacity) for n, nb in self.nodes.items()}
        return IndexStats("memory", sum(o.blocks for o in occ.values()), occ)


class MemoryIndex:
    """``BlockIndex`` over an ``IndexCore`` in this process (the embedded default)."""

    backend = "memory"

    def __init__(
        self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS, *, core: IndexCore | None = None
    ) -> None:
        """``core``: an existing one to read and write (a replicated index's, ``cachetier.replicated``)."""
        self.core = core if core is not None else IndexCore(default_capacity)

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        return self.core.lookup(hashes, nodes)

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        return self.core.store(ops)

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        return self.core.remove(node, hashes)

    async def clear_node(self, node: str) -> int:
        return self.core.clear_node(node)

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        self.core.replace_node(node, chains)

    async def set_capacity(self, node: str, blocks: int) -> None:
        self.core.set_capacity(node, blocks)

    async def node_hashes(self, node: str) -> set[int]:
        nb = self.core.nodes.get(node)
        return set(nb.blocks) if nb is not None else set()

    async def stats(self) -> IndexStats:
        return self.core.stats()

    async def close(self) -> None:
        return None
