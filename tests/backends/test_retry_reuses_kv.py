"""A decode that fails after its prefill was done is retried against the KV already computed: on
the same prefill node (it holds the prompt's prefix now, so the retry's prefill is a cache hit)
with another decode node, on real nodes over loopback gRPC."""

from __future__ import annotations

import pytest

from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.pipeline import Pipeline
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.state.documents import DocumentStore
from prefixgate.gateway.vocab import Mode
from tests.backends.conftest import StartNode
from tests.unit.seam_support import prepared

pytestmark = pytest.mark.timeout(30)

PROMPT_TOKENS = 2048


async def test_a_decode_failed_after_prefill_is_retried_on_the_prefill_node_holding_the_prefix(
    nodes: StartNode,
) -> None:
    prefill = [await nodes("prefill", node_id=f"prefill-{k}") for k in "ab"]
    # decode-a takes the pages but drops them at once (a handle that expires as it arrives):
    # its Decode fails after the prefill was done. Idle decode nodes are taken in id order.
    bad = await nodes("decode", node_id="decode-a", handle_ttl_s=0.0)
    good = await nodes("decode", node_id="decode-b")
    pool = NodePool(poll=False)
    for role, ns in [("prefill", p) for p in prefill] + [("decode", bad), ("decode", good)]:
        pool.add(role, ns.address)
    for n in pool.nodes.values():
        assert await pool.refresh(n)
    s = Settings()
    pipeline = Pipeline(s, pool, MemoryIndex(), Bytes4Tokenizer(), Metrics(), DocumentStore())
    try:
        for i in range(3):  # each its own prompt: nothing cached before its first attempt
            prep = prepared(pipeline, f"{i} " + "y" * (4 * PROMPT_TOKENS), max_tokens=4)
            ex = await pipeline.execute(prep)
            try:
                text = "".join([d.text async for d in ex.stream()])
            finally:
                await ex.close()
            assert ex.route == Mode.DISAGGREGATED and ex.attempts == 2, (ex.route, ex.reason)
            assert ex.decode_node.id == "decode-b" and text
            # the retry's prefill ran where the first one had: all but the last partial block cached
            assert ex.cached_tokens >= prep.prompt_tokens - s.block_size, (
                ex.cached_tokens,
                prep.prompt_tokens,
            )
            assert pool.by_id("decode-a") is not None
    finally:
        await pipeline.close()
        await pool.close()
