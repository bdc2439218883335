"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from prefixgate.v1 import node_pb2_grpc


@pytest.fixture
async def stub() -> AsyncIterator[Callable[[str], Any]]:
    """``stub(address)``: a Node stub on a channel closed after the test."""
    channels: list[grpc.aio.Channel] = []

    def make(address: str) -> Any:
        ch = grpc.aio.insecure_channel(address)
        channels.append(ch)
        return node_pb2_grpc.NodeStub(ch)

    yield make
    for ch in channels:
        await ch.close()
