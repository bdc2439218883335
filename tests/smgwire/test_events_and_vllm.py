"""KV events over the SMG protocol (gaps, DATA_LOSS, OUT_OF_RANGE, UNIMPLEMENTED, duplicates,
page size != block size) from a scripted engine on real gRPC, and the vLLM adapter (generation,
the kv_transfer_params relay) against a VllmEngine face served through one of our nodes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient import KVEvent, NodeFailure
from prefixgate.gateway.nodeclient.handoff import RelayStream
from prefixgate.gateway.nodeclient.smg_common import SmgNodeClient, SmgOptions
from prefixgate.gateway.vocab import EventKind, Stage
from tests.smgwire import doubles
from tests.smgwire.conftest import BS, HF, StartNode, root_of
from tests.smgwire.test_sglang_adapter import LONG, collect, direct_ids, prompt

PAGES = [list(range(i * 16 + 1, i * 16 + 17)) for i in range(4)]
ROOT = root_of("double", "", "")  # the scripted engine names its model "double"
assert ROOT is not None


def gw(pages: list[list[int]], block_size: int = BS) -> list[int]:
    return block_hashes(pack_ids([t for p in pages for t in p]), block_size, ROOT)  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []
    clients: list[SmgNodeClient] = []

    async def start(
        script: doubles.Script | None, block_size: int = BS, loads: bool = True
    ) -> tuple[doubles.ScriptedSglang, SmgNodeClient]:
        servicer = doubles.ScriptedSglang(script, loads)
        server, addr = await doubles.serve(doubles.add_sglang(servicer))
        servers.append(server)
        c = SmgNodeClient(
            f"grpc://{addr}", addr, SmgOptions(block_size=block_size, root_of=root_of, codec=HF)
        )
        clients.append(c)
        return servicer, c

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        await s.stop(0)


async def take(c: SmgNodeClient, n: int) -> list[KVEvent]:
    out: list[KVEvent] = []
    gen = c.kv_events(0)
    try:
        async with asyncio.timeout(5):
            async for ev in gen:
                out.append(ev)
                if len(out) == n:
                    break
    finally:
        await gen.aclose()
    return out


def shape(events: list[KVEvent]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(e.kind.value, e.parent, e.hashes) for e in events]


async def test_blocks_are_named_with_the_gateways_chain_and_duplicates_skipped(engine: Any) -> None:
    a, b = 101, -202  # engine hashes: any int64
    script = lambda n: [  # noqa: E731
        doubles.batch(0, doubles.stored(a, PAGES[0])),
        doubles.batch(0, doubles.stored(a, PAGES[0])),  # a duplicate sequence number: skipped
        doubles.batch(1, doubles.stored(b, PAGES[1], parent=a)),
        doubles.batch(2, common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=[b]))),
    ]
    _, c = await engine(script)
    events = await take(c, 4)
    h = gw(PAGES[:2])
    assert [e.seq for e in events] == [0, 1, 2, 3] and len({e.instance_id for e in events}) == 1
    assert shape(events) == [
        ("snapshot", 0, ()),
        ("stored", 0, (h[0],)),
        ("stored", h[0], (h[1],)),
        ("removed", 0, (h[1],)),
    ]


async def test_engine_pages_smaller_than_gateway_blocks(engine: Any) -> None:
    script = lambda n: [  # noqa: E731
        doubles.batch(0, doubles.stored(1, PAGES[0]), doubles.stored(2, PAGES[1], parent=1)),
        doubles.batch(1, doubles.stored(3, PAGES[2], parent=2), doubles.stored(4, PAGES[3], parent=3)),
    ]
    _, c = await engine(script, block_size=32)
    events = await take(c, 3)
    h = gw(PAGES, block_size=32)
    assert shape(events) == [("snapshot", 0, ()), ("stored", 0, (h[0],)), ("stored", h[0], (h[1],))]


@pytest.mark.parametrize("how", ["gap", grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE])
async def test_lost_events_clear_the_node_and_resubscribe(engine: Any, how: Any) -> None:
    def script(n: int) -> list[Any]:
        if n == 0:
            lost = doubles.batch(5, doubles.stored(9, PAGES[1], parent=1)) if how == "gap" else how
            return [doubles.batch(0, doubles.stored(1, PAGES[0])), lost]
        return [doubles.batch(0, doubles.stored(1, PAGES[0]), doubles.stored(2, PAGES[1], parent=1))]

    servicer, c = await engine(script)
    events = await take(c, 5)
    h = gw(PAGES[:2])
    assert shape(events) == [
        ("snapshot", 0, ()),
        ("stored", 0, (h[0],)),
        ("cleared", 0, ()),
        ("stored", 0, (h[0],)),
        ("stored", h[0], (h[1],)),
    ]
    assert servicer.subscriptions == 2


async def test_data_parallel_ranks_number_their_batches_apart(engine: Any) -> None:
    script = lambda n: [  # noqa: E731
        doubles.batch(0, doubles.stored(1, PAGES[0]), rank=0),
        doubles.batch(0, doubles.stored(2, PAGES[0]), rank=1),
        doubles.batch(1, doubles.stored(3, PAGES[1], parent=1), rank=0),
    ]
    servicer, c = await engine(script)
    events = await take(c, 4)
    h = gw(PAGES[:2])
    assert shape(events)[1:] == [("stored", 0, (h[0],)), ("stored", 0, (h[0],)), ("stored", h[0], (h[1],))]
    assert servicer.subscriptions == 1  # no gap seen


async def test_an_engine_without_get_loads_is_probed_with_health_check(engine: Any) -> None:
    _, c = await engine(None, loads=False)
    for _ in range(2):
        st = await c.status(timeout=5)
        assert st.engine == "sglang" and st.running_requests == 0


async def test_unimplemented_turns_kv_events_off(engine: Any) -> None:
    _, c = await engine(None)
    assert c.capabilities.kv_events
    events = [e async for e in c.kv_events(0)]
    assert [e.kind for e in events] == [EventKind.SNAPSHOT]
    assert not c.capabilities.kv_events
    assert [e async for e in c.kv_events(0)] == []  # not asked again


# -- vLLM ---------------------------------------------------------------------------------------


@pytest.fixture
async def vllm(nodes: StartNode) -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []
    clients: list[SmgNodeClient] = []

    async def start(kv_role: str = "") -> tuple[doubles.VllmOverOurNode, SmgNodeClient, Any]:
        ns = await nodes("monolithic")
        servicer = doubles.VllmOverOurNode(ns.address, kv_role, ns.node)
        server, addr = await doubles.serve(doubles.add_vllm(servicer))
        servers.append(server)
        c = SmgNodeClient(f"grpc://{addr}", addr, SmgOptions(block_size=BS, root_of=root_of, codec=HF))
        clients.append(c)
        return servicer, c, ns

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        await s.stop(0)


async def test_vllm_detected_and_generates_the_nodes_text(vllm: Any) -> None:
    servicer, c, ns = await vllm()
    st = await c.status(timeout=5)
    assert c.runtime is not None and c.runtime.name == "vllm" and st.engine == "vllm"
    expected = HF.decode(await direct_ids(ns, LONG, 12))
    text, finish, completion = await collect(c.generate(prompt(LONG), timeout=30))
    assert (text, finish, completion) == (expected, "length", 12)  # delta counters added up
    req = servicer.requests[-1]
    assert req.sampling_params.top_k == 0 and req.sampling_params.max_tokens == 12


async def test_vllm_relay_hands_the_prefills_params_to_decode_verbatim(vllm: Any) -> None:
    pre, p, _ = await vllm("kv_producer")
    dec, d, dns = await vllm("kv_consumer")
    await p.status(timeout=5)
    await d.status(timeout=5)
    assert (await p.status(timeout=5)).role == "prefill"
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG, 12, stop=("zzz-never",)), p, d, timeout=30)
    assert isinstance(s, RelayStream)
    text, finish, _ = await collect(s)
    assert (text, finish) == (HF.decode(await direct_ids(dns, LONG, 12)), "length")
    leg = pre.requests[-1]
    assert not leg.stream and leg.sampling_params.max_tokens == 1 and leg.sampling_params.ignore_eos
    assert (
        list(leg.sampling_params.stop) == [] and json.loads(leg.kv_transfer_params_json)["do_remote_decode"]
    )
    out = dec.requests[-1]
    assert out.request_id == leg.request_id and list(out.sampling_params.stop) == ["zzz-never"]
    assert json.loads(dec.params_seen[-1])["remote_engine_id"] == f"engine-{pre.target}"
    assert s.relayed and s.prefill is not None


async def test_vllm_relay_streams_the_decode_leg_of_a_whole_answer(vllm: Any) -> None:
    """The client takes the answer whole: the prefill leg answers one ``complete`` as always,
    and the decode leg still streams, since only its first item tells that its fetch of the KV
    is over (docs/engines.md, Aborts)."""
    pre, p, _ = await vllm("kv_producer")
    dec, d, dns = await vllm("kv_consumer")
    await p.status(timeout=5)
    await d.status(timeout=5)
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG, 12, stream=False), p, d, timeout=30)
    assert not getattr(s, "whole_answer", False)
    text, finish, _ = await collect(s)
    assert (text, finish) == (HF.decode(await direct_ids(dns, LONG, 12)), "length")
    assert [r.stream for r in pre.requests] == [False] and [r.stream for r in dec.requests] == [True]


async def test_vllm_whole_answer_with_stop_strings_is_cut_as_the_streamed_one(vllm: Any) -> None:
    """vLLM is sent the stop strings and stops on them itself: a whole answer is asked whole,
    and the gateway cuts its text where it cuts the streamed one."""
    servicer, c, ns = await vllm()
    await c.status(timeout=5)
    full = HF.decode(await direct_ids(ns, LONG, 16))
    ids = HF.encode(full, add_special_tokens=False).ids
    stop = HF.decode(ids[5:7])
    assert len(stop) > 1 and stop in full
    whole = await collect(c.generate(prompt(LONG, 16, stop=(stop,), stream=False), timeout=30))
    streamed = await collect(c.generate(prompt(LONG, 16, stop=(stop,)), timeout=30))
    assert whole[:2] == streamed[:2] == (full[: full.index(stop)], "stop")
    assert [r.stream for r in servicer.requests] == [False, True]
    assert [list(r.sampling_params.stop) for r in servicer.requests] == [[stop], [stop]]


async def test_vllm_prefill_failure_is_the_prefill_nodes(vllm: Any, nodes: StartNode) -> None:
    _, p, pns = await vllm("kv_producer")
    _, d, _ = await vllm("kv_consumer")
    await p.status(timeout=5)
    await d.status(timeout=5)
    await pns.stop(grace=0)  # the prefill engine behind the vLLM face is gone
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG), p, d, timeout=10)
    with pytest.raises(NodeFailure) as e:
        await s.__anext__()
    assert e.value.node_id == p.address and e.value.stage == Stage.PREFILL
    await s.aclose()


async def test_vllm_decode_is_still_sent_when_the_prefill_returns_no_params(vllm: Any) -> None:
    pre, p, _ = await vllm("kv_both")  # answers without kv_transfer_params_json
    dec, d, dns = await vllm("kv_consumer")
    await p.status(timeout=5)
    await d.status(timeout=5)
    assert p.handoff is not None
    s = p.handoff.start(prompt(LONG), p, d, timeout=30)
    assert isinstance(s, RelayStream)
    text, finish, _ = await collect(s)
    assert (text, finish) == (HF.decode(await direct_ids(dns, LONG, 12)), "length")
    assert not s.relayed and dec.params_seen == [] and len(pre.requests) == 1


async def test_a_long_prompts_batch_is_named_like_a_short_one_and_in_order(engine: Any) -> None:
    """A batch as large as a long prompt's blocks is rehashed off the event loop: the same
    names, and the batch after it (chained on its last page) still comes after it."""
    from prefixgate.gateway.nodeclient.smg_common import REHASH_OFF_LOOP_BYTES

    pages, big, last = doubles.long_prompt_batches()
    assert big.ByteSize() >= REHASH_OFF_LOOP_BYTES
    _, c = await engine(lambda n: [big, last])
    got = await take(c, 1 + len(pages))
    assert got[0].kind is EventKind.SNAPSHOT
    named = [h for e in got[1:] for h in e.hashes]
    assert named == gw(pages)
    assert got[-1].parent == named[-2] and got[-1].hashes == (named[-1],)
