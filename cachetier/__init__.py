"""Block hashing and the KV-block index shared by every gateway replica."""

from cachetier.factory import open_index
from cachetier.hashing import BlockHasher, Namespace, block_hashes
from cachetier.index import BlockIndex, IndexStats, StoreOp
from cachetier.memory import MemoryIndex
from cachetier.redis_index import RedisIndex
from cachetier.resilient import ResilientIndex
from cachetier.tokenizer import Bytes4Tokenizer, Tokenizer, load_tokenizer
from cachetier.writer import IndexWriter

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
