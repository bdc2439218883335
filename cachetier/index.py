"""The KV-block index contract: which node holds which blocks.

Semantics every implementation keeps (checked by ``tests/contract/test_index_contract.py``):

- A node's set of blocks is **prefix-closed**: a block is held only while its parent is. Stores
  are whole chains from the root (or fragments whose parent is held), removals take a block
  together with its descendants (callers pass closed sets: node events and node-side evictions
  report every block that went).
- A chain store (from the root) touches its blocks in reverse (root last), so a parent is always
  at least as recent as any child; evicting the least recently used block first therefore
  evicts leaves before parents and keeps the set prefix-closed. A fragment store cannot see its
  parent's ancestors, so it makes nothing more recent: the blocks it adds enter as the least
  recently used (deepest first), and blocks already held, the parent included, keep their place.
- Each node has a capacity in blocks (mirroring its KV pool); a store beyond it evicts LRU.
- ``lookup`` returns, per node, the length of the leading run of the prompt's blocks it holds.
  Because sets are prefix-closed, that run is found by binary search (log2(n) probes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

DEFAULT_CAPACITY_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class NodeOccupancy:
    node: str
    blocks: int
    capacity: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    backend: str
    total_blocks: int
    nodes: dict[str, NodeOccupancy] = field(default_factory=dict)
    degraded: bool = False
    health: dict[str, int] = field(default_factory=dict)  # fault counters of a resilient wrapper


@dataclass(frozen=True, slots=True)
class StoreOp:
    """One chain (or fragment after ``parent``) stored on one node."""

    node: str
    hashes: tuple[int, ...]
    parent: int = 0


@runtime_checkable
class BlockIndex(Protocol):
    """Async index API used by the gateway; implementations: memory and Redis."""

    backend: str

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        """Per node (all known nodes when ``nodes`` is None), the leading run of ``hashes`` held."""
        ...

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        """Apply a batch of stores atomically. False for an op whose parent is not held."""
        ...

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        """Remove these blocks (a prefix-closed complement) from a node; returns how many went."""
        ...

    async def clear_node(self, node: str) -> int:
        """Forget every block of a node (restart, resync, removal)."""
        ...

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        """Resync: the node's set becomes exactly these chains (each from the root)."""
        ...

    async def set_capacity(self, node: str, blocks: int) -> None: ...

    async def node_hashes(self, node: str) -> set[int]: ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...


def leading_run(held: HeldProbe, hashes: Sequence[int]) -> int:
    """Length of the leading run of ``hashes`` for which ``held`` is true, by binary search.

    Valid because a node's set is prefix-closed: held(h_i) implies held(h_j) for j < i.
    """
    n = len(hashes)
    if n == 0 or not held(hashes[0]):
        return 0
    lo, hi = 1, n  # hashes[:lo] held; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class HeldProbe(Protocol):
    def __call__(self, h: int, /) -> bool: ...
