"""A transfer the decode node refuses is refused with its own code even while the sender is still
writing pages: the node reads what is still coming before it answers (``backends.server._drain``).
The race it guards against (a failed write overwriting the status in grpcio's asyncio client)
did not reproduce on demand here; this holds the refusal's code and its reading to the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from prefixgate.v1 import node_pb2, node_pb2_grpc
from tests.backends.conftest import StartNode


async def test_a_refused_transfer_gets_its_code_while_the_sender_still_writes(nodes: StartNode) -> None:
    d = await nodes("decode")

    sent = 0

    async def chunks() -> AsyncIterator[node_pb2.KVTransferChunk]:
        nonlocal sent
        for i in range(64):  # no header first: refused at the first message
            yield node_pb2.KVTransferChunk(page=node_pb2.KVPage(index=i, num_tokens=64, data=bytes(16384)))
            sent += 1
            if i % 16 == 0:
                await asyncio.sleep(0.01)  # still writing when the refusal is decided

    async with grpc.aio.insecure_channel(d.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await node_pb2_grpc.NodeStub(ch).TransferKV(chunks(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    assert "starts with a KVTransferHeader" in (ei.value.details() or "")
    assert sent == 64  # the node read every page before it answered
