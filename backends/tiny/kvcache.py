"""The tiny model's attention cache and its KV page format. Pure.

One array ``(layers, 2, kv_heads, capacity, head_dim)`` of float32 holds K (post-rotary) and V
for every position. A page is a block's slice of it, ``PAGE_LAYOUT`` order, little-endian, in
the page dtype: ``f32`` as is, ``f16`` rounded (the cache holds the rounded values too, so
computing with pages received from elsewhere gives the same numbers as computing locally).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from prefixgate.backends.tiny.config import TinyConfig

PAGE_LAYOUT = "tiny:layer,kv,kv_head,token,head_dim"
_WIRE_DTYPES: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
MIN_CAPACITY = 64


class KVCache:
    """K and V of one sequence; grows by doubling."""

    def __init__(self, cfg: TinyConfig, capacity: int) -> None:
        self.cfg = cfg
        self.wire = _WIRE_DTYPES[cfg.kv_dtype]
        self.round = cfg.kv_dtype != "f32"
        self.data: NDArray[np.float32] = np.zeros(self._shape(max(capacity, MIN_CAPACITY)), dtype=np.float32)
        self.length = 0  # positions filled
        self._scratch: NDArray[np.float32] = np.empty(0, dtype=np.float32)

    def _shape(self, capacity: int) -> tuple[int, int, int, int, int]:
        c = self.cfg
        return (c.layers, 2, c.kv_heads, capacity, c.head_dim)

    @property
    def capacity(self) -> int:
        return int(self.data.shape[3])

    def ensure(self, positions: int) -> None:
        if positions <= self.capacity:
            return
        grown = np.zeros(self._shape(max(positions, 2 * self.capacity)), dtype=np.float32)
        grown[:, :, :, : self.length, :] = self.data[:, :, :, : self.length, :]
        self.data = grown

    def scratch(self, elements: int) -> NDArray[np.float32]:
        """A reusable float32 work buffer (attention scores) of at least ``elements``."""
        if self._scratch.size < elements:
            self._scratch = np.empty(elements, dtype=np.float32)
        return self._scratch[:elements]

    def write(self, layer: int, start: int, k: NDArray[np.float32], v: NDArray[np.float32]) -> None:
        """K and V of shape (kv_heads, T, head_dim) at positions start.."""
        end = start + k.shape[1]
        if self.round:
            k = k.astype(self.wire).astype(np.float32)
            v = v.astype(self.wire).astype(np.float32)
        self.data[layer, 0, :, start:end, :] = k
        self.data[layer, 1, :, start:end, :] = v

    def page(self, start: int, end: int) -> bytes:
        """Page bytes of positions [start, end)."""
        return bytes(self.data[:, :, :, start:end, :].astype(self.wire).tobytes())

    def load(self, page: bytes, start: int) -> int:
        """Put a page's K and V at positions start..; returns the number of tokens it held."""
        c = self.cfg
        per_token = c.kv_bytes_per_token
        if len(page) % per_token:
            raise ValueError(f"KV page of {len(page)} bytes is not a whole number of {per_token}-byte tokens")
        t = len(page) // per_token
        arr = np.frombuffer(page, dtype=self.wire).reshape(c.layers, 2, c.kv_heads, t, c.head_dim)
        self.ensure(start + t)
        self.data[:, :, :, start : start + t, :] = arr
        self.length = max(self.length, start + t)
        return t

    def load_pages(self, pages: Sequence[bytes], start: int = 0) -> int:
        """Pages in order from position ``start``; returns the position after the last."""
        pos = start
        for p in pages:
            pos += self.load(p, pos)
        return pos
