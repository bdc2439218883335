"""Real node servers on 127.0.0.1 for the backends tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from prefixgate.backends.server import NodeServer, start_node
from prefixgate.cachetier.hashing import Namespace, block_hashes

StartNode = Callable[..., Awaitable[NodeServer]]


@pytest.fixture
async def nodes() -> AsyncIterator[StartNode]:
    """``await nodes(role, **start_node options)``; every node is stopped after the test."""
    started: list[NodeServer] = []

    async def make(role: str = "monolithic", **options: Any) -> NodeServer:
        options.setdefault("time_scale", 0.0)
        ns = await start_node(role, "127.0.0.1", 0, **options)
        started.append(ns)
        return ns

    yield make
    for ns in started:
        await ns.stop(grace=0.2)


@pytest.fixture
def prompt() -> Callable[..., tuple[bytes, list[int]]]:
    """``prompt(n_tokens, salt=0, block_size=64, prefix=b"")`` -> (packed tokens, block hashes)."""
    root = Namespace("sim-test", "tenant-a", 64).root()

    def make(
        n_tokens: int, salt: int = 0, block_size: int = 64, prefix: bytes = b""
    ) -> tuple[bytes, list[int]]:
        body = bytes((i * 31 + salt * 7 + 13) % 251 for i in range(n_tokens * 4 - len(prefix)))
        tokens = prefix + body
        r = root if block_size == 64 else Namespace("sim-test", "tenant-a", block_size).root()
        return tokens, block_hashes(tokens, block_size, r)

    return make
