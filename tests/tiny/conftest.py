"""Tiny-engine nodes on 127.0.0.1 (small preset, 16-token blocks) and Node stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from prefixgate.backends.server import NodeServer, start_node
from tests.tiny.support import BS, SMALL, StartNode


@pytest.fixture
async def nodes() -> AsyncIterator[StartNode]:
    """``await nodes(role, engine=SMALL, block_size=BS, **start_node options)``; stopped after the test."""
    started: list[NodeServer] = []

    async def make(role: str = "monolithic", **options: Any) -> NodeServer:
        options.setdefault("engine", SMALL)
        options.setdefault("block_size", BS)
        ns = await start_node(role, "127.0.0.1", 0, **options)
        started.append(ns)
        return ns

    yield make
    for ns in started:
        await ns.stop(grace=0.2)
