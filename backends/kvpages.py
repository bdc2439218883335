"""KV pages: the format a node's KV is in, page bytes and their checksums.

Pages travel from a prefill node to a decode node only when both use the identical format
(model, page size, dtype, layout, bytes per token), as with page-granular RDMA transfer between
real servers. ``format_mismatch`` names every field that differs so a refusal is clear.

The reference model is a Llama-3.1-70B-class GQA model with an fp8 KV cache: 80 layers, 8 KV
heads of dimension 128, K and V, one byte each = 163,840 bytes (160 KiB) of KV per token. A
simulated node ships ``kv_scale`` of that (default 1/512 = 320 bytes a token, 20 KiB a 64-token
page) so tests and laptops move real bytes without moving gigabytes; the cost model still
charges the link for the full size.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields
from fractions import Fraction

import xxhash

_LE64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


REFERENCE_MODEL = ModelSpec(
    "llama-3.1-70b", layers=80, kv_heads=8, head_dim=128, dtype="fp8_e4m3", dtype_bytes=1
)
DEFAULT_KV_SCALE = 1 / 512
PAGE_LAYOUT = "page:layer,kv,head,token,dim"


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Mirror of ``prefixgate.v1.KVFormat``."""

    model_fingerprint: str
    block_size: int
    dtype: str
    layout: str
    bytes_per_token: int

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


def scaled_bytes_per_token(model: ModelSpec, kv_scale: float) -> int:
    if kv_scale <= 0:
        raise ValueError(f"kv_scale must be > 0, got {kv_scale}")
    return max(1, round(model.kv_bytes_per_token * kv_scale))


def parse_scale(text: str) -> float:
    """``0.001953125``, ``1/512`` or ``1e-3`` -> float (for the CLI)."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number or fraction: {text!r}") from None
    if value <= 0:
        raise ValueError(f"kv scale must be > 0, got {text!r}")
    return value


def format_mismatch(ours: KVFormat, theirs: KVFormat) -> list[str]:
    """Human-readable ``field: theirs != ours`` for every differing field; empty when equal."""
    out: list[str] = []
    for f in fields(KVFormat):
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        if a != b:
            out.append(f"{f.name}: sender {a!r} != receiver {b!r}")
    return out


def checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class Page:
    """One KV page held in a block pool: its bytes and their xxh3 checksum."""

    data: bytes
    checksum: int

    @classmethod
    def of(cls, data: bytes) -> Page:
        return cls(data, checksum(data))


def synth_page_bytes(key: int, size: int, salt: bytes = b"") -> bytes:
    """Deterministic page content for a 64-bit key (a block hash, or a digest of a tail block)."""
    seed = _LE64.pack(xxhash.xxh3_64_intdigest(_LE64.pack(key) + salt))
    return hashlib.shake_128(seed).digest(size)
