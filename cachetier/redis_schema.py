"""Key schema of the Redis index, for both layouts (pure: names and packing, no I/O).

Two layouts, chosen per deployment (``RedisIndex(layout=...)``, ``open_index(layout=...)``);
every gateway sharing a prefix must use the same one. Neither reads the other's keys.

- ``zset`` (default): one skiplist ZSET per node (``P{node}:z``, meta ``P{node}:m``, registry
  ``Pnodes``); scripts in ``redis_scripts_zset.py``. Fastest writes (one ``ZADD`` per ~500
  blocks), ≈ 104 bytes of Redis memory per block.
- ``packed``: keys under ``V = P + "v2:"`` (``V{node}:m`` meta, ``V{node}:h`` buckets of packed
  14-byte entries, ``V{node}:z`` bucket bounds, ``Vnodes``); scripts in
  ``redis_scripts_packed.py``. ≈ 18 bytes per block, writes ≈ 3–7× the Redis CPU per block.

``{node}`` is a Redis Cluster hash tag: all of one node's keys live in one slot. Block hashes
already embed model, tenant salt and block size (``hashing.py``), so tenants never share a
member even though they share the keys of a node. See ``cachetier/README.md``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PREFIX = "prefixgate:"
LAYOUTS = ("zset", "packed")
DEFAULT_LAYOUT = "zset"
PACKED_VERSION = "v2:"  # the packed layout's keys live under P + "v2:"
BUCKET_FILL = 64  # average blocks per bucket before a split (a bucket is a ~0.9 KB string)
ENTRY_BYTES = 14  # 8-byte hash + 6-byte tick

_LE64 = struct.Struct("<Q")


def pack_hash(h: int) -> bytes:
    return _LE64.pack(h)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as one blob of 8-byte little-endian members (what the scripts slice)."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hash(member: bytes) -> int:
    value: int = _LE64.unpack(member)[0]
    return value


def entries(bucket: bytes) -> list[bytes]:
    """The 8-byte members of a bucket's packed entries (each followed by its 6-byte tick)."""
    return [bucket[i : i + 8] for i in range(0, len(bucket), ENTRY_BYTES)]


def bucket_of(h: int, level: int, split: int) -> int:
    """Linear hashing: the bucket of hash ``h`` among ``2**level + split`` buckets."""
    low = h & 0xFFFFFFFF
    a = low % (1 << level)
    return low % (2 << level) if a < split else a


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


@dataclass(frozen=True, slots=True)
class KeySchema:
    prefix: str = DEFAULT_PREFIX
    layout: str = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (they are the node's hash tag)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown index layout {self.layout!r}: one of {', '.join(LAYOUTS)}")

    @property
    def packed(self) -> bool:
        return self.layout == "packed"

    @property
    def versioned(self) -> str:
        """The prefix of this layout's keys."""
        return self.prefix + PACKED_VERSION if self.packed else self.prefix

    def meta(self, node: str) -> str:
        return f"{self.versioned}{{{node}}}:m"

    def blocks(self, node: str) -> str:
        """zset: the node's block ZSET; packed: its HASH of buckets."""
        return f"{self.versioned}{{{node}}}:{'h' if self.packed else 'z'}"

    def order(self, node: str) -> str:
        """packed: the node's ZSET of buckets by (a lower bound of) their least recent tick."""
        return f"{self.versioned}{{{node}}}:z"

    def node_keys(self, node: str) -> list[str]:
        """Every key of one node, in the order the write scripts take them."""
        if self.packed:
            return [self.meta(node), self.blocks(node), self.order(node)]
        return [self.blocks(node), self.meta(node)]

    def lookup_key(self, node: str) -> str:
        """The key the lookup scripts are given for a node."""
        return self.meta(node) if self.packed else self.blocks(node)

    @property
    def registry(self) -> str:
        return f"{self.versioned}nodes"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this prefix, any layout (glob characters escaped)."""
        return _glob_escape(self.prefix) + "*"

    def of_other_layout(self, key: str) -> bool:
        """A key of this prefix that the other layout wrote (never read by this one)."""
        if not key.startswith(self.prefix):
            return False
        if self.packed:
            return not key.startswith(self.versioned)
        return key.startswith(self.prefix + PACKED_VERSION)
