"""Helpers for the tiny-engine tests: prompts and the three request paths over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixgate.backends.server import NodeServer
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.v1 import node_pb2

SMALL = "tiny:preset=small"
BS = 16  # small blocks: block-boundary cases stay a few dozen tokens long

StartNode = Callable[..., Awaitable[NodeServer]]


def make_prompt(
    n_tokens: int, salt: int, block_size: int = BS, prefix: bytes = b""
) -> tuple[bytes, list[int]]:
    """Random uint32 token ids (any id is valid input) and their block hashes."""
    rng = np.random.default_rng(1000 + salt)
    body = rng.integers(0, 1 << 32, n_tokens - len(prefix) // 4, dtype=np.uint32).astype("<u4").tobytes()
    tokens = prefix + body
    return tokens, block_hashes(tokens, block_size, Namespace("tiny-test", "t", block_size).root())


@dataclass
class Output:
    ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int
    transfer_bytes: int = 0


async def drain(call: AsyncIterator[node_pb2.TokenChunk]) -> tuple[list[int], str, node_pb2.TokenChunk]:
    ids: list[int] = []
    text = ""
    last = node_pb2.TokenChunk()
    async for c in call:
        ids.extend(c.token_ids)
        text += c.text
        last = c
    return ids, text, last


async def generate(stub: Any, node: NodeServer, tokens: bytes, hashes: list[int], sp: Any) -> Output:
    """The whole request on one node (prefill with prefix reuse, then decode)."""
    req = node_pb2.GenerateRequest(request_id="mono", tokens=tokens, block_hashes=hashes, sampling=sp)
    ids, text, last = await drain(stub(node.address).Generate(req))
    return Output(ids, text, last.finish_reason, last.cached_tokens)


async def split(stub: Any, p: NodeServer, d: NodeServer, tokens: bytes, hashes: list[int], sp: Any) -> Output:
    """Prefill on ``p`` pushing KV pages to ``d``, then Decode on ``d``."""
    r = await stub(p.address).Prefill(
        node_pb2.PrefillRequest(
            request_id="split", tokens=tokens, block_hashes=hashes, sampling=sp, decode_address=d.address
        )
    )
    ids, text, last = await drain(
        stub(d.address).Decode(node_pb2.DecodeRequest(request_id="split", kv_handle=r.kv_handle, sampling=sp))
    )
    ids = [r.first_token, *ids]
    return Output(ids, r.first_text + text, last.finish_reason, r.cached_tokens, r.transfer_bytes)
