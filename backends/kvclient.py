"""The gRPC side of KV transfer: a prefill node streaming pages to a decode node's TransferKV."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from prefixgate.backends.convert import header_to_proto, page_to_proto
from prefixgate.backends.errors import NodeError
from prefixgate.backends.transfer import TransferAck, TransferHeader, WirePage
from prefixgate.v1 import node_pb2, node_pb2_grpc

REQUEST_ID_KEY = "x-prefixgate-request-id"
CACHED_TOKENS_KEY = "x-prefixgate-cached-tokens"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
MAX_CHANNELS = 64


class GrpcKVSender:
    """Keeps one channel per decode address (bounded, least recently used closed first)."""

    def __init__(self, max_channels: int = MAX_CHANNELS) -> None:
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._max = max_channels
        self._closing: set[asyncio.Task[None]] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is not None:
            self._channels.move_to_end(address)
            return ch
        ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._channels[address] = ch
        while len(self._channels) > self._max:
            _, old = self._channels.popitem(last=False)
            task = asyncio.create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return ch

    async def send(
        self,
        address: str,
        header: TransferHeader,
        pages: Sequence[WirePage],
        *,
        cached_tokens: int = 0,
        timeout: float | None = None,
    ) -> TransferAck:
        stub = node_pb2_grpc.NodeStub(self._channel(address))

        async def chunks() -> AsyncIterator[node_pb2.KVTransferChunk]:
            yield node_pb2.KVTransferChunk(header=header_to_proto(header))
            for p in pages:
                yield node_pb2.KVTransferChunk(page=page_to_proto(p))

        metadata = ((REQUEST_ID_KEY, header.request_id), (CACHED_TOKENS_KEY, str(cached_tokens)))
        try:
            ack = await stub.TransferKV(chunks(), timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            raise NodeError(
                f"KV transfer to decode node {address} failed ({code.name}): {e.details()}",
                stage="transfer",
                code=code,
            ) from None
        return TransferAck(ack.kv_handle, ack.pages, ack.bytes, ack.reused_pages)

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            await ch.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
