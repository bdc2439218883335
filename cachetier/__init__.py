"""Block hashing and the KV-block index shared by every gateway replica."""

from cachetier.hashing import BlockHasher, Namespace, block_hashes
from cachetier.index import BlockIndex, IndexStats
from cachetier.memory import MemoryIndex
from cachetier.tokenizer import Bytes4Tokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BlockHasher",
    "BlockIndex",
    "Bytes4Tokenizer",
    "IndexStats",
    "MemoryIndex",
    "Namespace",
    "Tokenizer",
    "block_hashes",
    "load_tokenizer",
]
