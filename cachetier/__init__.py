"""Block hashing and the KV-block index shared by every gateway replica."""

from prefixgate.cachetier.factory import open_index
from prefixgate.cachetier.hashing import BlockHasher, Namespace, block_hashes
from prefixgate.cachetier.index import BlockIndex, IndexStats, StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.redis_index import RedisIndex
from prefixgate.cachetier.resilient import ResilientIndex
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer, Tokenizer, load_tokenizer
from prefixgate.cachetier.writer import IndexWriter

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
