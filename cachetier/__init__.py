"""Block hashing and the KV-block index shared by every gateway replica.

The Redis-backed parts (``RedisIndex``, ``ResilientIndex``, ``open_index``) are imported when first
asked for: a node, which hashes and tokenizes but keeps no shared index, does not load the Redis
client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefixgate.cachetier.hashing import BlockHasher, Namespace, block_hashes
from prefixgate.cachetier.index import BlockIndex, IndexStats, StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer, Tokenizer, load_tokenizer
from prefixgate.cachetier.writer import IndexWriter

if TYPE_CHECKING:
    from prefixgate.cachetier.factory import open_index
    from prefixgate.cachetier.redis_index import RedisIndex
    from prefixgate.cachetier.resilient import ResilientIndex

_LAZY = {
    "open_index": "prefixgate.cachetier.factory",
    "RedisIndex": "prefixgate.cachetier.redis_index",
    "ResilientIndex": "prefixgate.cachetier.resilient",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BlockHasher",
    "BlockIndex",
    "Bytes4Tokenizer",
    "IndexStats",
    "IndexWriter",
    "MemoryIndex",
    "Namespace",
    "RedisIndex",
    "ResilientIndex",
    "StoreOp",
    "Tokenizer",
    "block_hashes",
    "load_tokenizer",
    "open_index",
]
