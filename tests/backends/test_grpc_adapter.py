"""The gateway's adapter for prefixgate's node protocol, against real node servers on loopback:
what the seam promises (status, generate, the push handoff, events, cache operations, failures
with kind, stage and the right node) holds on the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from prefixgate.gateway.nodeclient import NodeFailure, Prompt, TokenStream
from prefixgate.gateway.nodeclient.prefixgate_grpc import PUSH_HANDOFF, GrpcNodeClient
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage
from prefixgate.openai.schema import Sampling

MakePrompt = Callable[..., tuple[bytes, list[int]]]


@pytest.fixture
async def client() -> AsyncIterator[Callable[[str], GrpcNodeClient]]:
    made: list[GrpcNodeClient] = []

    def make(address: str) -> GrpcNodeClient:
        c = GrpcNodeClient(address)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def collect(stream: TokenStream) -> tuple[str, str, int]:
    text, finish, completion = "", "", 0
    async for d in stream:
        text += d.text
        finish = d.finish_reason or finish
        completion = d.completion_tokens or completion
    return text, finish, completion


async def test_status_generate_and_the_push_handoff(nodes: Any, client: Any, prompt: MakePrompt) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    pc, dc = client(p.address), client(d.address)
    st = await pc.status(timeout=2)
    assert st.role == "prefill" and st.kv_format.block_size == 64 and st.instance_id
    assert st.kv_format == (await dc.status(timeout=2)).kv_format
    tokens, hashes = prompt(300)
    req = Prompt("r1", tokens, hashes, Sampling(max_tokens=6, temperature=0.0))
    split = PUSH_HANDOFF.start(req, pc, dc, timeout=10)
    text, finish, completion = await collect(split)
    assert finish == "length" and completion == 6 and text
    assert split.prefill is not None and split.prefill.transfer_bytes > 0
    again = PUSH_HANDOFF.start(Prompt("r2", tokens, hashes, req.sampling), pc, dc, timeout=10)
    assert (await collect(again))[0] == text
    assert again.cached_tokens == 256  # 4 full blocks held by the prefill node
    whole = dc.generate(Prompt("r3", tokens, hashes, req.sampling), timeout=10)
    assert (await collect(whole))[0] == text  # split and whole requests answer alike


async def test_a_refused_transfer_names_the_decode_node(nodes: Any, client: Any, prompt: MakePrompt) -> None:
    p, other = await nodes("prefill"), await nodes("decode", block_size=32)
    tokens, hashes = prompt(200)
    stream = PUSH_HANDOFF.start(
        Prompt("r", tokens, hashes, Sampling(max_tokens=4)),
        client(p.address),
        client(other.address),
        timeout=10,
    )
    with pytest.raises(NodeFailure) as info:
        await stream.__anext__()
    f = info.value
    assert (f.node_id, f.stage, f.kind) == (other.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED)
    assert "block_size" in f.detail


async def test_invalid_input_and_a_down_node_fail_with_their_kind(nodes: Any, client: Any) -> None:
    m = await nodes("monolithic")
    bad = client(m.address).generate(Prompt("r", b"xyz", [], Sampling(max_tokens=2)), timeout=5)
    with pytest.raises(NodeFailure) as info:
        await bad.__anext__()
    assert (info.value.kind, info.value.stage) == (FailureKind.INVALID, Stage.GENERATE)
    await m.stop(grace=0.1)
    with pytest.raises(NodeFailure) as down:
        await client(m.address).status(timeout=2)
    assert (down.value.kind, down.value.stage) == (FailureKind.UNAVAILABLE, Stage.PROBE)


async def test_events_warm_pin_and_evict(nodes: Any, client: Any, prompt: MakePrompt) -> None:
    n = await nodes("prefill")
    c = client(n.address)
    events = c.kv_events(0)
    snap = await events.__anext__()
    assert snap.kind == EventKind.SNAPSHOT and snap.seq == 0 and snap.hashes == ()
    tokens, hashes = prompt(640)
    report = await c.warm(Prompt("w", tokens, hashes, Sampling(max_tokens=1)), pin_seconds=0, timeout=10)
    assert report.cached_tokens == 0
    stored = await events.__anext__()
    assert (stored.kind, stored.seq, stored.parent, stored.hashes) == (EventKind.STORED, 1, 0, tuple(hashes))
    assert await c.pin(hashes, seconds=30, timeout=5) == (len(hashes), 0)
    assert (await c.status(timeout=2)).pinned_blocks == len(hashes)
    evicted = await c.evict([hashes[0]], everything=True, timeout=5)
    assert set(evicted) == set(hashes)
    removed = await events.__anext__()
    assert removed.kind in (EventKind.REMOVED, EventKind.CLEARED)
    await events.aclose()
