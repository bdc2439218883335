"""The ZMQ KV event subscriber under a publisher that misbehaves (``hostile_zmq``): malformed
payloads are dropped and the rest of the stream is indexed; an oversized message, a flood, a
poisoned, trickling or huge replay leave the event loop free and memory bounded; a subscription
that keeps failing backs off. Real sockets on 127.0.0.1, the real in-memory index."""

from __future__ import annotations

import asyncio
import gc
import itertools
import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import structlog
import zmq
import zmq.asyncio

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.cluster.events import EventSync
from prefixgate.gateway.cluster.nodes import NodePool
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient.fake import FakeNodeClient, fake_status
from prefixgate.gateway.nodeclient.zmq_events import ZmqEventsClient, ZmqKVEvents, events_connector
from prefixgate.gateway.nodeclient.zmq_flow import Inbox
from tests.interop.hostile_zmq import HostilePublisher, LagProbe, RssPeak

pytestmark = pytest.mark.timeout(30)

GW_BS = 4
NS = Namespace("prefixgate-sim", "", GW_BS, "bytes4")
ENC = msgspec.msgpack.Encoder()
MAX_LAG_S = 0.05
MiB = 1 << 20


def batch(*events: Any) -> bytes:
    """An SGLang-style batch: ``[ts, events]``, array-like events."""
    return ENC.encode([time.time(), list(events)])


def stored(hashes: list[Any], parent: Any, tokens: list[Any], bs: Any = GW_BS) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, bs, None]


def removed(hashes: list[Any]) -> list[Any]:
    return ["BlockRemoved", hashes]


def gw(tokens: list[int]) -> list[int]:
    return block_hashes(pack_ids(tokens), GW_BS, NS.root())


@dataclass
class Rig:
    pub: HostilePublisher
    index: MemoryIndex
    sync: EventSync
    src: ZmqKVEvents

    async def hit(self, tokens: list[int]) -> int:
        return (await self.index.lookup(gw(tokens))).get("w1", 0)

    async def wait_hit(self, tokens: list[int], blocks: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while await self.hit(tokens) != blocks:
            assert time.monotonic() < deadline, f"index holds {await self.hit(tokens)}, expected {blocks}"
            await asyncio.sleep(0.02)


async def start_rig(pub: HostilePublisher, **settings: Any) -> tuple[Rig, NodePool]:
    spec = f"w1={pub.endpoint}?replay={pub.replay_endpoint}&topic=kv"
    fake = FakeNodeClient("w1", status=fake_status("w1", "monolithic"))
    pool = NodePool(connect=events_connector([spec], NS, lambda a: fake), poll=False)
    index = MemoryIndex()
    sync = EventSync(pool, index, Metrics(), retry_s=0.05)
    node = pool.add("monolithic", "w1")
    assert isinstance(node.client, ZmqEventsClient)
    src = node.client.source
    for k, v in settings.items():  # bounds a test tightens, set before the subscription starts
        setattr(src, k, v)
    await pool.refresh(node)
    sync.watch(node)
    return Rig(pub, index, sync, src), pool


@pytest.fixture
async def rigs() -> AsyncIterator[Any]:
    made: list[tuple[Rig, NodePool]] = []

    async def make(
        history: Sequence[bytes] = (), replay_delay_s: float = 0.0, wait: bool = True, **settings: Any
    ) -> Rig:
        pub = HostilePublisher(history=history, replay_delay_s=replay_delay_s)
        rig, pool = await start_rig(pub, **settings)
        made.append((rig, pool))
        deadline = time.monotonic() + 5
        while wait and rig.sync.last_seq.get("w1", 0) < 1:  # subscribed: the empty snapshot applied
            assert time.monotonic() < deadline, "no subscription"
            await asyncio.sleep(0.01)
        return rig

    yield make
    for rig, pool in made:
        await rig.sync.close()
        await pool.close()
        rig.pub.close()


def deep(depth: int) -> bytes:
    """A batch whose one event is ``depth`` arrays deep."""
    return b"\x92\xcb" + struct.pack(">d", time.time()) + b"\x91" + b"\x91" * depth + b"\xc0"


# -- malformed payloads ---------------------------------------------------------------------------


async def test_each_kind_of_malformed_payload_is_dropped_and_the_stream_goes_on(rigs: Any) -> None:
    rig: Rig = await rigs()
    one = list(range(100, 108))
    rig.pub.send(batch(stored([1], None, one[:4])))
    await rig.wait_hit(one, 1)
    # Bad stored events: dropped, the rest of the chain is not affected.
    for bad in (
        stored([9], 1, [-1, 2, 3, 4]),  # a negative token id
        stored([9], 1, [2**32, 2, 3, 4]),  # a token id beyond uint32
        stored([9], 1, ["a", "b", "c", "d"]),  # token ids that are strings
        stored([9], 1, one[4:], [4]),  # a list block_size
        stored([9], 1, one[4:], 0),  # a block size that is not positive
        stored([9], 1, one[4:], True),  # a boolean for an int
        stored([9.5], 1, one[4:]),  # a float block hash
    ):
        rig.pub.send(batch(bad, stored([2], 1, one[4:])))  # the good one next to it is applied
    await rig.wait_hit(one, 2)
    assert rig.src.dropped["event"] == 7
    # A removal that cannot be read: what the worker holds is no longer known, it is cleared.
    rig.pub.send(batch(removed(["not a hash"])))
    await rig.wait_hit(one, 0)
    # Payloads that are no batch at all, messages that are no event message.
    rig.pub.send(ENC.encode("a string"))
    rig.pub.send(deep(5000))
    rig.pub.send(ENC.encode([time.time(), "not a list"]))
    rig.pub.send_frames([b"kv", b"\x00" * 7, batch()])  # a sequence number of 7 bytes
    rig.pub.send_frames([b"kv", batch()])  # two frames
    two = list(range(200, 208))
    rig.pub.send(batch(stored([20], None, two[:4])))
    rig.pub.send(batch(stored([21], 20, two[4:])))
    await rig.wait_hit(two, 2)
    assert rig.src.dropped["payload"] == 3 and rig.src.dropped["message"] == 2
    assert rig.pub.replay_requests == [0]  # no resubscription: nothing escaped the subscriber


# -- loop lag and memory --------------------------------------------------------------------------


async def test_a_16_mib_message_leaves_the_loop_free_and_the_stream_resumes(rigs: Any) -> None:
    rig: Rig = await rigs(replay_timeout_s=0.3)
    tokens = list(range(1000, 1000 + 3_360_000))  # 16 MiB of msgpack, 210,000 engine blocks
    huge = batch(stored(list(range(1, 210_001)), None, tokens, 16))
    assert len(huge) >= 16 * MiB
    gc.collect()  # what earlier tests left is not this test's to collect
    probe = LagProbe().start()
    try:
        rig.pub.send(huge)
        after = list(range(300, 304))
        deadline = time.monotonic() + 6
        while await rig.hit(after) != 1:  # the publisher's later batches are indexed again
            assert time.monotonic() < deadline, "the stream did not resume"
            rig.pub.send(batch(stored([500], None, after)))
            await asyncio.sleep(0.1)
    finally:
        await probe.stop()
    assert probe.max < MAX_LAG_S, probe.report()
    assert rig.src.disconnects >= 1  # libzmq dropped the connection unread; the subscriber reconnected


def flood_payloads(n: int) -> list[bytes]:
    """``n`` batches of a worker whose pool cycles: each stores a 4-block chain (16 tokens of
    4) and removes the one stored ``n // 2`` batches before."""
    out = []
    for i in range(n):
        toks = list(range(10_000 + 16 * i, 10_016 + 16 * i))
        old = (i - n // 2) % n
        hashes = [4 * i + k for k in range(4)]
        out.append(batch(stored(hashes, None, toks), removed([4 * old + k for k in range(4)])))
    return out


async def test_a_flood_keeps_the_loop_responsive_and_memory_bounded(rigs: Any) -> None:
    rig: Rig = await rigs()
    payloads = flood_payloads(512)
    gc.collect()  # what earlier tests left is not this test's to collect
    probe = LagProbe().start()
    peak = RssPeak()
    try:
        sent = await asyncio.to_thread(rig.pub.flood(payloads, seconds=2.0, at_least=24_000))
        grew = peak.stop()
        after = list(range(400, 408))
        # what the socket still holds is drained first: more than 5 s once in CI on a loaded
        # two-core machine, so the bound is 15 s (a stream never followed again still fails)
        deadline = time.monotonic() + 15
        while await rig.hit(after) != 2:  # once it is over, the stream is followed again
            assert time.monotonic() < deadline, "not indexing after the flood"
            rig.pub.send(batch(stored([900, 901], None, after)))
            await asyncio.sleep(0.1)
    finally:
        await probe.stop()
    assert probe.max < MAX_LAG_S, probe.report()
    assert grew < 64 * MiB, f"RSS grew {grew / MiB:.0f} MiB"
    assert sent > 20_000, sent  # a real flood


async def test_the_inbox_sheds_what_it_cannot_hold_and_says_so_once() -> None:
    ctx = zmq.asyncio.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pub.bind("inproc://inbox")
        sub.connect("inproc://inbox")
        await asyncio.sleep(0.05)
        bad: list[Exception] = []
        inbox = Inbox(sub, max_batches=8, max_bytes=1 << 20, on_bad=bad.append)
        for s in range(20):
            await pub.send_multipart([b"kv", s.to_bytes(8, "big"), b"x"])
        await pub.send_multipart([b"kv", b"\x00", b"x"])  # not a sequence number
        deadline = time.monotonic() + 2
        while inbox.shed + len(inbox.queue) + len(bad) < 21:  # what arrived: shed, queued or bad
            assert time.monotonic() < deadline, (inbox.shed, len(inbox.queue), bad)
            inbox.drain()
            await asyncio.sleep(0.01)
        assert len(inbox.queue) <= 8 and inbox.shed >= 12 and len(bad) == 1
        assert await inbox.next() is None  # told once...
        inbox.shed = 0
        await pub.send_multipart([b"kv", (99).to_bytes(8, "big"), b"y"])
        got = await asyncio.wait_for(inbox.next(), 2)
        assert got is not None and got[0] in {*range(20), 99}  # ...then the stream goes on
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()


# -- replays --------------------------------------------------------------------------------------


async def test_a_poisoned_history_is_replayed_once_not_at_every_resubscription(rigs: Any) -> None:
    one = list(range(100, 108))
    history = [
        batch(stored([1], None, one[:4])),
        batch(stored([2], 1, [-5, 1, 2, 3])),  # poison: a negative token id
        batch(stored([3], 1, one[4:])),
    ]
    rig: Rig = await rigs(history=history)
    await rig.wait_hit(one, 2)
    await asyncio.sleep(1.0)
    assert rig.pub.replay_requests == [0] and rig.src.dropped["event"] == 1
    assert await rig.hit(one) == 2


def orphan_history() -> list[bytes]:
    """A history the index cannot take (a stored block whose gateway parent was removed), so
    the gateway resubscribes, and the replay brings the same again, every time."""
    t = list(range(700, 708))
    return [
        batch(stored([1, 2, 3], None, t[:6], 2)),  # engine blocks of 2: [1 2] completes block 1
        batch(removed([2])),  # ... which goes; [3] still chains after it
        batch(stored([4], 3, t[6:], 2)),  # completes block 2, its parent (block 1) gone
    ]


async def test_a_subscription_that_keeps_breaking_backs_off(rigs: Any) -> None:
    with structlog.testing.capture_logs() as logs:
        rig: Rig = await rigs(history=orphan_history(), wait=False)
        await asyncio.sleep(2.5)
    n = len(rig.pub.replay_requests)
    assert 2 <= n <= 4, f"{n} subscriptions in 2.5 s"  # at 0 s, then 0.5 s, 1 s, 2 s... apart
    times = rig.pub.replay_times
    waits = [b - a for a, b in itertools.pairwise(times)]
    assert waits[0] >= 0.45 and all(w2 > 1.5 * w1 for w1, w2 in itertools.pairwise(waits)), waits
    assert any(e["event"] == "kv_events_resubscribe_backoff" for e in logs)


async def test_a_trickling_replay_is_cut_off_logged_and_the_live_stream_indexed(rigs: Any) -> None:
    history = [batch(stored([1000 + i], None, list(range(4 * i, 4 * i + 4)))) for i in range(50)]
    with structlog.testing.capture_logs() as logs:
        rig: Rig = await rigs(history=history, replay_delay_s=0.2, replay_deadline_s=1.0)
        live = list(range(900, 904))
        deadline = time.monotonic() + 4
        while await rig.hit(live) != 1:
            assert time.monotonic() < deadline, "the live stream waits for the replay"
            rig.pub.send(batch(stored([77], None, live)))
            await asyncio.sleep(0.1)
    assert rig.src.replays_failed >= 1
    assert any(e["event"] == "kv_events_replay_failed" and "1.0 s" in e["reason"] for e in logs)


async def test_a_huge_replay_is_not_held_in_memory() -> None:
    filler = batch(["Padding", b"\x00" * (MiB - 64)])  # an event kind the gateway does not use
    assert MiB - 128 < len(filler) <= MiB
    pub = HostilePublisher(history=[filler] * 100)
    rig, pool = await start_rig(pub, max_replay_bytes=8 * MiB)
    peak = RssPeak()
    try:
        deadline = time.monotonic() + 5
        while rig.sync.last_seq.get("w1", 0) < 1 or not rig.pub.replay_requests:
            assert time.monotonic() < deadline, "no subscription"
            await asyncio.sleep(0.01)
        live = list(range(900, 904))
        deadline = time.monotonic() + 5
        while await rig.hit(live) != 1:  # the history is given up on, the live stream is followed
            assert time.monotonic() < deadline, "not indexing"
            rig.pub.send(batch(stored([77], None, live)))
            await asyncio.sleep(0.1)
    finally:
        grew = peak.stop()
        await rig.sync.close()
        await pool.close()
        pub.close()
    assert grew < 48 * MiB, f"RSS grew {grew / MiB:.0f} MiB"
