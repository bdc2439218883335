"""Chained block hashes: ``h_i = xxh3_64(LE64(h_{i-1}) || block_bytes, seed)``.

Only full blocks are hashed. ``h_{-1}`` is derived from the namespace (model, tenant salt,
block size, tokenizer), so one id names the whole prefix up to and including its block, and
two namespaces never share an id.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

_LE64 = struct.Struct("<Q")
HASH_SEED = 0x70726566  # "pref"


@dataclass(frozen=True, slots=True)
class Namespace:
    model: str
    tenant: str = ""
    block_size: int = 64
    tokenizer: str = "bytes4"

    def root(self) -> int:
        key = f"prefixgate/v1\0{self.model}\0{self.tenant}\0{self.block_size}\0{self.tokenizer}"
        return xxhash.xxh3_64_intdigest(key.encode("utf-8"), seed=HASH_SEED)


def block_hashes(tokens: bytes, block_size: int, root: int, *, limit: int | None = None) -> list[int]:
    """Hashes of the full blocks of ``tokens`` (packed LE uint32), root first."""
    stride = block_size * 4
    n = len(tokens) // stride
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    append = out.append
    h = root
    digest = xxhash.xxh3_64_intdigest
    pack = _LE64.pack
    view = memoryview(tokens)
    for i in range(n):
        h = digest(pack(h) + view[i * stride : (i + 1) * stride], seed=HASH_SEED)
        append(h)
    return out


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token sequences for one namespace."""

    namespace: Namespace

    @property
    def block_size(self) -> int:
        return self.namespace.block_size

    def hashes(self, tokens: bytes) -> list[int]:
        return block_hashes(tokens, self.namespace.block_size, self.namespace.root())
