"""What moves from a prefill node to a decode node, independent of the wire.

A transfer is a header (format, prompt, first token, sampling state) and one page per block of
the prompt: full blocks carry their block hash, the trailing partial block carries hash 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixgate.backends.engine import Sampling
from prefixgate.backends.kvpages import KVFormat


@dataclass(frozen=True, slots=True)
class TransferHeader:
    request_id: str
    kv_handle: str
    format: KVFormat
    tokens: bytes
    num_pages: int
    first_token: int
    state: int
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class WirePage:
    index: int
    block_hash: int  # 0 for the trailing partial block
    num_tokens: int
    data: bytes
    checksum: int


@dataclass(frozen=True, slots=True)
class TransferAck:
    kv_handle: str
    pages: int
    bytes: int
    reused_pages: int


class KVSender(Protocol):
    """Pushes a prompt's KV pages to the node at ``address``; raises ``NodeError`` (stage
    "transfer") carrying the receiver's status code when it refuses or cannot be reached."""

    async def send(
        self,
        address: str,
        header: TransferHeader,
        pages: Sequence[WirePage],
        *,
        cached_tokens: int = 0,
        timeout: float | None = None,
    ) -> TransferAck: ...

    async def close(self) -> None: ...
