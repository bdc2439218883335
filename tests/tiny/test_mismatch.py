"""KV pages from a differently configured node are refused, and the gateway serves around it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx
import pytest

from prefixgate.backends.server import NodeServer
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.v1 import node_pb2
from tests.tiny.support import BS, SMALL, StartNode, make_prompt

MISMATCHES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "weights": ({"engine": f"{SMALL},seed=9"}, ["model_fingerprint: sender 'tiny:"]),
    "block_size": ({"block_size": 2 * BS}, [f"block_size: sender {BS} != receiver {2 * BS}"]),
    "dtype": (
        {"engine": f"{SMALL},kv_dtype=f16"},
        ["dtype: sender 'f32' != receiver 'f16'", "bytes_per_token"],
    ),
    "sim_engine": ({"engine": "sim", "time_scale": 0.0}, ["model_fingerprint", "layout"]),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
async def test_decode_node_refuses_foreign_pages(
    nodes: StartNode, stub: Callable[[str], Any], kind: str
) -> None:
    options, expected = MISMATCHES[kind]
    p = await nodes("prefill")
    d = await nodes("decode", **options)
    tokens, hashes = make_prompt(2 * BS + 3, salt=70)
    sp = node_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub(p.address).Prefill(
            node_pb2.PrefillRequest(
                request_id="x", tokens=tokens, block_hashes=hashes, sampling=sp, decode_address=d.address
            )
        )
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details() or ""
    prefix = f"KV transfer to decode node {d.address} failed (FAILED_PRECONDITION): KV format mismatch: "
    assert details.startswith(prefix), details
    for text in expected:
        assert text in details, details
    assert dict(err.trailing_metadata() or ()).get("x-prefixgate-stage") == "transfer"
    # Nothing was taken on the decode node.
    assert d.node.pool.counts().used == 0 and not d.node.handles


@asynccontextmanager
async def gateway(
    prefill: list[str], decode: list[str], monolithic: tuple[str, ...] = ()
) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process gateway (HTTP app over ASGI) in front of the given node addresses."""
    settings = Settings(
        prefill=prefill, decode=decode, monolithic=list(monolithic), block_size=BS, stats_interval_s=0.2
    )
    svc = GatewayService(settings)
    await svc.start()
    try:
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            yield client
    finally:
        await svc.stop()


async def complete(client: httpx.AsyncClient, **body: Any) -> tuple[str, dict[str, str]]:
    r = await client.post("/v1/completions", json={"model": "prefixgate-sim", "max_tokens": 16, **body})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"]), dict(r.headers)


PROMPT = "Pages must arrive intact; a reused prefix must give the same answer. " * 3


async def test_gateway_serves_a_mismatched_pair_by_fallback(nodes: StartNode) -> None:
    p: NodeServer = await nodes("prefill")
    bad = await nodes("decode", engine=f"{SMALL},seed=9")
    good = await nodes("decode")
    mono = await nodes("monolithic")
    async with gateway([p.address], [good.address]) as gw:
        greedy, h = await complete(gw, prompt=PROMPT, temperature=0)
        seeded, _ = await complete(gw, prompt=PROMPT, temperature=0.9, seed=77)
        assert h["x-prefixgate-route"] == "disaggregated" and greedy and seeded != greedy

    # The only decode node refuses the prefill node's pages: the monolithic pool answers, with
    # the same tokens as the consistent pair.
    async with gateway([p.address], [bad.address], (mono.address,)) as gw:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"temperature": 0}, greedy),
            ({"temperature": 0.9, "seed": 77}, seeded),
        ]
        for body, want in cases:
            text, h = await complete(gw, prompt=PROMPT, **body)
            assert text == want
            assert h["x-prefixgate-route"] == "fallback" and h["x-prefixgate-decode-node"] == mono.address
    assert not bad.node.handles and bad.node.pool.counts().used == 0

    # Two decode nodes, one mismatched: the split path retries on the other (or picks it first).
    async with gateway([p.address], [bad.address, good.address]) as gw:
        text, h = await complete(gw, prompt=PROMPT, temperature=0)
        assert text == greedy
        assert h["x-prefixgate-route"] == "disaggregated" and h["x-prefixgate-decode-node"] == good.address

    # Nothing else can serve: a clear 503 naming the refusal, never an answer from foreign pages.
    async with gateway([p.address], [bad.address]) as gw:
        request = {"model": "prefixgate-sim", "prompt": PROMPT, "max_tokens": 4}
        r = await gw.post("/v1/completions", json=request)
        assert r.status_code == 503
        assert "KV format mismatch: model_fingerprint" in r.json()["error"]["message"]
