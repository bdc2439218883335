"""Token for token the same answer on every path, with real KV over real gRPC nodes.

Paths: no cache (a node that never saw the prompt), prefix cache hit (the same node again),
disaggregated (prefill node -> KV pages over TransferKV -> decode node Decode), and
disaggregated on a prefill hit. Prompt lengths straddle block boundaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefixgate.backends.server import NodeServer
from prefixgate.v1 import node_pb2
from tests.tiny.support import BS, Output, StartNode, generate, make_prompt, split

LENGTHS = [BS - 1, BS, BS + 1, 3 * BS + 5]
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"max_tokens": 24, "temperature": 0.0},
    "seeded": {"max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 1234, "has_seed": True},
    "unseeded": {"max_tokens": 24, "temperature": 1.2},  # seeded from the prompt digest
}


def pool_pages(ns: NodeServer, hashes: list[int]) -> list[bytes]:
    return [p.data for p in ns.node.pool.payloads(hashes)]


@pytest.fixture
async def trio(nodes: StartNode) -> tuple[NodeServer, NodeServer, NodeServer]:
    return await nodes("monolithic"), await nodes("prefill"), await nodes("decode")


@pytest.mark.parametrize("kind", list(SAMPLINGS))
async def test_three_paths_agree(
    trio: tuple[NodeServer, NodeServer, NodeServer], stub: Callable[[str], Any], kind: str
) -> None:
    m, p, d = trio
    sp = node_pb2.SamplingParams(**SAMPLINGS[kind])
    seen: set[tuple[int, ...]] = set()
    for salt, n in enumerate(LENGTHS):
        tokens, hashes = make_prompt(n, salt=salt)
        full = (n // BS) * BS
        fresh = await generate(stub, m, tokens, hashes, sp)
        hit = await generate(stub, m, tokens, hashes, sp)
        disagg = await split(stub, p, d, tokens, hashes, sp)
        disagg_hit = await split(stub, p, d, tokens, hashes, sp)
        assert (fresh.cached_tokens, hit.cached_tokens) == (0, full)
        assert (disagg.cached_tokens, disagg_hit.cached_tokens) == (0, full)
        assert len(fresh.ids) == 24 and fresh.finish_reason == "length" and fresh.text
        for other in (hit, disagg, disagg_hit):
            assert other.ids == fresh.ids
            assert (other.text, other.finish_reason) == (fresh.text, fresh.finish_reason)
        # The pages moved intact: the decode node holds the prefill node's bytes, which are the
        # bytes the monolithic node computed on its own.
        assert pool_pages(d, hashes) == pool_pages(p, hashes) == pool_pages(m, hashes)
        assert disagg.transfer_bytes == n * m.node.engine.kv_format.bytes_per_token
        seen.add(tuple(fresh.ids))
    assert len(seen) == len(LENGTHS)  # different prompts, different answers


async def test_partial_hit_and_block_size_64(nodes: StartNode, stub: Callable[[str], Any]) -> None:
    """A prompt sharing two blocks with an earlier one reuses them and answers as a fresh node;
    also at the default 64-token block size with a 16K-capable cache layout."""
    for bs in (BS, 64):
        m = await nodes("monolithic", block_size=bs)
        fresh_node = await nodes("monolithic", block_size=bs)
        sp = node_pb2.SamplingParams(max_tokens=16, temperature=0.8, seed=5, has_seed=True)
        first, first_hashes = make_prompt(2 * bs + 7, salt=40, block_size=bs)
        await generate(stub, m, first, first_hashes, sp)
        second, hashes = make_prompt(3 * bs + 5, salt=41, block_size=bs, prefix=first[: 2 * bs * 4])
        assert hashes[:2] == first_hashes[:2]
        reused: Output = await generate(stub, m, second, hashes, sp)
        ref = await generate(stub, fresh_node, second, hashes, sp)
        assert reused.cached_tokens == 2 * bs and ref.cached_tokens == 0
        assert reused.ids == ref.ids and reused.text == ref.text
        assert pool_pages(m, hashes) == pool_pages(fresh_node, hashes)


async def test_stop_strings_and_one_token_on_the_split_path(
    trio: tuple[NodeServer, NodeServer, NodeServer], stub: Callable[[str], Any]
) -> None:
    m, p, d = trio
    tokens, hashes = make_prompt(2 * BS + 3, salt=60)
    base: dict[str, Any] = {"max_tokens": 30, "temperature": 0.9, "seed": 3, "has_seed": True}
    full = await generate(stub, m, tokens, hashes, node_pb2.SamplingParams(**base))
    stop = full.text[9:15]
    sp = node_pb2.SamplingParams(**base, stop=[stop])
    a, b = await generate(stub, m, tokens, hashes, sp), await split(stub, p, d, tokens, hashes, sp)
    assert a.text == b.text == full.text[: full.text.index(stop)]
    assert a.finish_reason == b.finish_reason == "stop"
    one = node_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    a, b = await generate(stub, m, tokens, hashes, one), await split(stub, p, d, tokens, hashes, one)
    assert a.ids == b.ids and len(a.ids) == 1 and a.finish_reason == b.finish_reason == "length"
