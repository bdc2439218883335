"""KV events over ZMQ, the engines' wire: a real PUB + ROUTER replay publisher on 127.0.0.1
drives the gateway's subscriber, and what it applies reaches the real in-memory index.

Payloads are encoded with the engines' own struct layouts (``engine_kv_structs``: vLLM main's
tagged maps, SGLang's array-like structs) and, for SGLang 0.5.23, with SGLang's own module and
its own ``ZmqEventPublisher``: the wheel's ``kv_events`` module, vendored unchanged in
``vendor/`` (the package's ``__init__``s pull in torch, so only that module is loaded, with its
two helper imports stood in for).
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import sys
import threading
import time
import types
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.cluster.events import EventSync
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.core.tenancy import HIDDEN_SALT, Tenancy, engine_salt
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status
from prefixgate.gateway.nodeclient.zmq_events import (
    BlockMapper,
    ZmqEventsClient,
    decode_batch,
    events_connector,
    parse_kv_events,
)
from prefixgate.gateway.nodeclient.zmq_wire import Stored
from prefixgate.gateway.vocab import EventKind
from tests.interop import engine_kv_structs as es

pytestmark = pytest.mark.timeout(60)

GW_BS = 4
NS = Namespace("prefixgate-sim", "", GW_BS, "bytes4")
ENC = msgspec.msgpack.Encoder()


# -- a publisher with the engines' socket protocol ------------------------------------------------


class Publisher:
    """PUB ``[topic, seq BE64, payload]`` + ROUTER replay of the last ``buffer`` batches, as
    vLLM's and SGLang's ``ZmqEventPublisher`` do; ``deliver=False`` buffers a batch without
    sending it (the subscriber sees a gap)."""

    def __init__(self, topic: bytes = b"kv", buffer: int = 100) -> None:
        self.topic = topic
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.replay_requests: list[int] = []
        self._out: queue.Queue[tuple[bytes, bool] | None] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, deliver: bool = True) -> None:
        self._out.put((payload, deliver), timeout=5)

    def _run(self) -> None:
        while True:
            if self.router.poll(5):
                ident, _, start = self.router.recv_multipart()
                s0 = int.from_bytes(start, "big")
                self.replay_requests.append(s0)
                for s, buf in list(self.buffer):
                    if s >= s0:
                        self.router.send_multipart([ident, b"", s.to_bytes(8, "big"), buf])
                self.router.send_multipart([ident, b"", (2**64 - 1).to_bytes(8, "big"), b""])
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                continue
            if item is None:
                break
            payload, deliver = item
            s, self.seq = self.seq, self.seq + 1
            self.buffer.append((s, payload))
            if deliver:
                self.pub.send_multipart([self.topic, s.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


# -- what a worker stores ------------------------------------------------------------------------


def chain(tokens: list[int], bs: int, first: int, parent: int | None) -> tuple[list[int], int | None]:
    """Engine handles for ``tokens`` in blocks of ``bs`` (arbitrary ids, like SHA chains)."""
    return [first + i for i in range(len(tokens) // bs)], parent


Handle = int | bytes


def vllm_stored(tokens: list[int], bs: int, hashes: list[Handle], parent: Handle | None) -> Any:
    return es.VllmBlockStored(hashes, parent, tokens, bs, None, "GPU", None)


def sglang_stored(tokens: list[int], bs: int, hashes: list[int], parent: int | None) -> Any:
    return es.SglangBlockStored(hashes, parent, tokens, bs, None)


def vllm_batch(*events: Any) -> bytes:
    return ENC.encode(es.VllmEventBatch(time.time(), list(events), 0))


def sglang_batch(*events: Any) -> bytes:
    return ENC.encode(es.SglangEventBatch(time.time(), list(events)))


def gw(tokens: list[int]) -> list[int]:
    return block_hashes(pack_ids(tokens), GW_BS, NS.root())


async def until(cond: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond() if asyncio.iscoroutinefunction(cond) else not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@dataclass
class Rig:
    pub: Publisher
    index: MemoryIndex
    sync: EventSync
    client: ZmqEventsClient

    async def hit(self, tokens: list[int]) -> int:
        return (await self.index.lookup(gw(tokens))).get("w1", 0)

    async def wait_hit(self, tokens: list[int], blocks: int, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.hit(tokens) != blocks:
            assert asyncio.get_running_loop().time() < deadline, (
                f"index holds {await self.hit(tokens)} blocks, expected {blocks}"
            )
            await asyncio.sleep(0.02)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    pub = Publisher(buffer=3)
    spec = f"w1={pub.endpoint}?replay={pub.replay_endpoint}&topic=kv"
    fake = FakeNodeClient("w1", status=fake_status("w1", "monolithic"))
    pool = NodePool(connect=events_connector([spec], NS, lambda a: fake), poll=False)
    index = MemoryIndex()
    sync = EventSync(pool, index, Metrics(), retry_s=0.05)
    node = pool.add("monolithic", "w1")
    assert isinstance(node.client, ZmqEventsClient)
    await pool.refresh(node)
    sync.watch(node)
    try:
        await until(lambda: sync.last_seq.get("w1", 0) >= 1)  # subscribed: the empty snapshot
        yield Rig(pub, index, sync, node.client)
    finally:
        await sync.close()
        await pool.close()
        pub.close()


# -- the tests -----------------------------------------------------------------------------------


def test_the_setting_maps_workers_to_endpoints_and_rejects_what_cannot_be_connected() -> None:
    got = parse_kv_events(["127.0.0.1:9000=tcp://127.0.0.1:5557?replay=tcp://127.0.0.1:5558&topic=kv-events"])
    src = got["127.0.0.1:9000"]
    assert (src.endpoint, src.replay, src.topic) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "kv-events",
    )
    for bad in ("w=tcp://*:5557", "w=http://h:1", "tcp://127.0.0.1:5557", "w=tcp://127.0.0.1"):
        with pytest.raises(ValueError):
            parse_kv_events([bad])


def test_both_payload_shapes_decode_to_the_same_events() -> None:
    toks = list(range(8))
    as_map = decode_batch(vllm_batch(vllm_stored(toks, 4, [11, 12], None), es.VllmBlockRemoved([12], "GPU")))
    as_array = decode_batch(sglang_batch(sglang_stored(toks, 4, [11, 12], None), es.SglangBlockRemoved([12])))
    assert [type(e).__name__ for e in as_map] == ["Stored", "Removed"]
    assert [type(e).__name__ for e in as_array] == ["Stored", "Removed"]
    assert as_map[0].token_ids == as_array[0].token_ids == tuple(toks)  # type: ignore[union-attr]
    assert as_map[0].block_hashes == as_array[0].block_hashes == (11, 12)  # type: ignore[union-attr]
    cpu = decode_batch(vllm_batch(es.VllmBlockStored([1], None, [1, 2, 3, 4], 4, None, "CPU", None)))
    assert BlockMapper("prefixgate-sim", GW_BS, "bytes4").apply(cpu[0]) == []  # not the device tier


def test_engine_blocks_of_another_size_map_onto_the_gateways_chain() -> None:
    """Engine blocks of 2 tokens, gateway blocks of 4: every second engine block completes one;
    removing it removes that gateway block; a block without token ids is counted, not guessed."""
    toks = list(range(100, 112))
    m = BlockMapper("prefixgate-sim", GW_BS, "bytes4")
    (ev,) = decode_batch(sglang_batch(sglang_stored(toks[:6], 2, [1, 2, 3], None)))
    (ch,) = m.apply(ev)
    assert ch.kind == EventKind.STORED and ch.parent == 0 and list(ch.hashes) == gw(toks)[:1]
    (ev,) = decode_batch(sglang_batch(sglang_stored(toks[6:], 2, [4, 5, 6], 3)))
    (ch,) = m.apply(ev)
    assert ch.parent == gw(toks)[0] and list(ch.hashes) == gw(toks)[1:3]
    (ev,) = decode_batch(sglang_batch(es.SglangBlockRemoved([6])))
    (ch,) = m.apply(ev)
    assert ch.kind == EventKind.REMOVED and list(ch.hashes) == gw(toks)[2:3]
    (ev,) = decode_batch(sglang_batch(es.SglangBlockStored([7], None, [], 2, None)))
    assert m.apply(ev) == [] and m.unmapped == 1


async def test_stored_blocks_become_index_hits_and_removed_ones_leave(rig: Rig) -> None:
    toks = list(range(1000, 1016))  # 4 gateway blocks
    rig.pub.publish(vllm_batch(vllm_stored(toks[:8], 4, [b"h1", b"h2"], None)))
    rig.pub.publish(sglang_batch(sglang_stored(toks[8:], 4, [3, 4], None)))  # another chain (root)
    await rig.wait_hit(toks, 2)
    rig.pub.publish(vllm_batch(vllm_stored(toks[8:], 4, [b"h3", b"h4"], b"h2")))
    await rig.wait_hit(toks, 4)
    rig.pub.publish(vllm_batch(es.VllmBlockRemoved([b"h4"], "GPU")))
    await rig.wait_hit(toks, 3)
    rig.pub.publish(vllm_batch(es.VllmAllBlocksCleared()))
    await rig.wait_hit(toks, 0)


async def test_a_gap_is_filled_from_the_replay_socket(rig: Rig) -> None:
    toks = list(range(2000, 2012))
    rig.pub.publish(vllm_batch(vllm_stored(toks[:4], 4, [1], None)))
    await rig.wait_hit(toks, 1)
    rig.pub.publish(vllm_batch(vllm_stored(toks[4:8], 4, [2], 1)), deliver=False)  # lost on the way
    rig.pub.publish(vllm_batch(vllm_stored(toks[8:], 4, [3], 2)))
    await rig.wait_hit(toks, 3)
    src = rig.client.source
    assert src.gaps == 1 and src.replays_failed == 0 and rig.pub.replay_requests[-1] == 1


async def test_a_gap_the_replay_cannot_fill_clears_the_worker_and_starts_over(rig: Rig) -> None:
    old = list(range(3000, 3008))
    rig.pub.publish(vllm_batch(vllm_stored(old, 4, [1, 2], None)))
    await rig.wait_hit(old, 2)
    for i in range(4):  # more than the publisher buffers (3): the first one is gone for good
        rig.pub.publish(
            vllm_batch(vllm_stored(list(range(4000 + 4 * i, 4004 + 4 * i)), 4, [10 + i], None)), False
        )
    new = list(range(5000, 5004))
    rig.pub.publish(vllm_batch(vllm_stored(new, 4, [20], None)))
    await rig.wait_hit(new, 1)
    await rig.wait_hit(old, 0)  # cleared: nothing known about the lost batches
    src = rig.client.source
    assert src.gaps == 1 and src.replays_failed == 1
    # ...and the mapping goes on from there: a child of the new chain is indexed.
    rig.pub.publish(vllm_batch(vllm_stored(list(range(5004, 5008)), 4, [21], 20)))
    await rig.wait_hit(new + list(range(5004, 5008)), 2)


async def test_a_subscriber_learns_what_the_publisher_already_holds_from_its_history() -> None:
    pub = Publisher()
    toks = list(range(6000, 6008))
    pub.publish(vllm_batch(vllm_stored(toks, 4, [1, 2], None)))  # before anyone listens
    fake = FakeNodeClient("w1", status=fake_status("w1", "monolithic"))
    client = events_connector(
        [f"w1={pub.endpoint}?replay={pub.replay_endpoint}&topic=kv"], NS, lambda a: fake
    )("w1")
    events = client.kv_events(0)
    try:
        got = [await anext(events), await anext(events)]
    finally:
        await events.aclose()
        pub.close()
    assert got[0].kind == EventKind.SNAPSHOT and not got[0].hashes
    assert got[1].kind == EventKind.STORED and list(got[1].hashes) == gw(toks)


# -- SGLang's own module and publisher -------------------------------------------------------------


def _sglang_kv_events() -> types.ModuleType:
    """``sglang.srt.disaggregation.kv_events`` of the SGLang wheel, alone (vendored in ``vendor/``)."""
    src = Path(__file__).parent / "vendor" / "sglang_0_5_23_kv_events.py"
    stubs = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.runtime_context": types.ModuleType("sglang.srt.runtime_context"),
        "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
        "sglang.srt.utils.network": types.ModuleType("sglang.srt.utils.network"),
    }
    stubs["sglang.srt.runtime_context"].get_parallel = None  # type: ignore[attr-defined]
    stubs["sglang.srt.utils.network"].NetworkAddress = None  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("sglang_kv_events_0523", src)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


@pytest.fixture(scope="module")
def sglang_events() -> Iterator[types.ModuleType]:
    yield _sglang_kv_events()


async def test_sglangs_own_publisher_drives_the_index(sglang_events: types.ModuleType) -> None:
    m = sglang_events
    pub = m.ZmqEventPublisher(
        0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv", bind=True
    )
    try:
        endpoint = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        toks = list(range(7000, 7012))
        pub.publish(
            m.KVEventBatch(time.time(), [m.BlockStored([1, 2], None, toks[:8], 4, None, medium="GPU")])
        )
        fake = FakeNodeClient("w1", status=fake_status("w1", "monolithic"))
        client = events_connector([f"w1={endpoint}?replay={replay}&topic=kv"], NS, lambda a: fake)("w1")
        events = client.kv_events(0)
        try:
            assert (await asyncio.wait_for(anext(events), 5)).kind == EventKind.SNAPSHOT
            first = await asyncio.wait_for(anext(events), 5)  # from the replay (published before)
            assert first.kind == EventKind.STORED and list(first.hashes) == gw(toks)[:2]
            pub.publish(m.KVEventBatch(time.time(), [m.BlockStored([3], 2, toks[8:], 4, None)]))
            second = await asyncio.wait_for(anext(events), 5)  # live
            assert second.parent == gw(toks)[1] and list(second.hashes) == gw(toks)[2:]
            pub.publish(m.KVEventBatch(time.time(), [m.BlockRemoved([3]), m.AllBlocksCleared()]))
            kinds = [(await asyncio.wait_for(anext(events), 5)).kind for _ in range(2)]
            assert kinds == [EventKind.REMOVED, EventKind.CLEARED]
        finally:
            await events.aclose()
    finally:
        pub.shutdown()


async def test_the_gateway_setting_puts_a_workers_events_on_zmq() -> None:
    from prefixgate.gateway.config import load_settings
    from prefixgate.gateway.core.service import GatewayService

    spec = "127.0.0.1:1=tcp://127.0.0.1:5557?replay=tcp://127.0.0.1:5558"
    settings = load_settings(None, {"decode": ["127.0.0.1:1", "127.0.0.1:2"]}, {"PREFIXGATE_KV_EVENTS": spec})
    assert settings.kv_events == [spec]
    service = GatewayService(settings)
    try:
        zmq_node = service.pool.add("decode", "127.0.0.1:1")
        plain = service.pool.add("decode", "127.0.0.1:2")
        assert isinstance(zmq_node.client, ZmqEventsClient) and zmq_node.client.capabilities.kv_events
        assert zmq_node.client.source.source.replay == "tcp://127.0.0.1:5558"
        assert not isinstance(plain.client, ZmqEventsClient)
    finally:
        await service.pool.close()
    with pytest.raises(ValueError):
        GatewayService(load_settings(None, {"kv_events": ["127.0.0.1:1=tcp://*:5557"]}, {}))


async def test_a_worker_naming_its_model_has_its_events_in_that_models_namespace() -> None:
    """The gateway's namespace is set up with the default model; the worker says it serves
    ``engine-model``, so its blocks are named as requests for ``engine-model`` are hashed."""
    pub = Publisher(buffer=3)
    spec = f"w1={pub.endpoint}?replay={pub.replay_endpoint}&topic=kv"
    status = replace(fake_status("w1", "monolithic"), models=("engine-model",))
    fake = FakeNodeClient("w1", status=status)
    pool = NodePool(connect=events_connector([spec], NS, lambda a: fake), poll=False)
    index = MemoryIndex()
    sync = EventSync(pool, index, Metrics(), retry_s=0.05)
    node = pool.add("monolithic", "w1")
    await pool.refresh(node)
    sync.watch(node)
    toks = list(range(2000, 2016))
    theirs = block_hashes(pack_ids(toks), GW_BS, replace(NS, model="engine-model").root())
    try:
        await until(lambda: sync.last_seq.get("w1", 0) >= 1)
        pub.publish(vllm_batch(vllm_stored(toks, 4, [b"a", b"b", b"c", b"d"], None)))
        deadline = asyncio.get_running_loop().time() + 10
        while (await index.lookup(theirs)).get("w1", 0) != 4:
            assert asyncio.get_running_loop().time() < deadline, await index.lookup(theirs)
            await asyncio.sleep(0.02)
        assert (await index.lookup(gw(toks))).get("w1", 0) == 0  # not under the default model
    finally:
        await sync.close()
        await pool.close()
        pub.close()


def test_an_events_salt_names_its_tenants_namespace_and_no_salt_none_of_several() -> None:
    """A block the engine stored under the salt the gateway gave tenant ``a`` is ``a``'s; with
    several tenants, one stored under no salt is nobody's (not the shared namespace's either)."""
    tenancy = Tenancy.of(["a", "b", "c"], ["c"])
    toks = list(range(200, 208))
    (ev,) = decode_batch(vllm_batch(vllm_stored(toks, 4, [b"s1", b"s2"], None)))
    m = BlockMapper("prefixgate-sim", GW_BS, "bytes4", salt_of=tenancy.event_salt)

    def hashes_in(salt: str) -> list[int]:
        return block_hashes(pack_ids(toks), GW_BS, Namespace("prefixgate-sim", salt, GW_BS, "bytes4").root())

    assert isinstance(ev, Stored)
    (salted,) = m.apply(replace(ev, cache_salt=engine_salt("a")))
    assert list(salted.hashes) == hashes_in("a")
    (bare,) = BlockMapper("prefixgate-sim", GW_BS, "bytes4", salt_of=tenancy.event_salt).apply(ev)
    assert list(bare.hashes) == hashes_in(HIDDEN_SALT) and list(bare.hashes) != hashes_in("")
