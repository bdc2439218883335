"""The gateway workers' replicated index: its message codec and its connection's reading of the
store's replies, then two indexes on
one real Valkey server (the embedded store the supervisor runs) kept the same through its
pub/sub, through a dropped subscriber and a slow one the server disconnects."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.cachetier.index import StoreOp
from prefixgate.cachetier.memory import IndexCore
from prefixgate.cachetier.replicated import (
    MAX_OP_BLOCKS,
    CapacityOp,
    ClearOp,
    IndexOp,
    MalformedMessage,
    RemoveOp,
    ReplicatedIndex,
    WorkerSlot,
    _Link,
    apply,
    channel_of,
    command,
    decode,
    encode,
    sender_of,
)
from prefixgate.gateway.ops.embedded_store import EmbeddedStore

U64 = st.integers(min_value=1, max_value=(1 << 64) - 1)
NODES = st.sampled_from(["n1", "node-2", "http://127.0.0.1:8001", "ü"])
OPS = st.one_of(
    st.builds(StoreOp, NODES, st.lists(U64, max_size=40).map(tuple), st.one_of(st.just(0), U64)),
    st.builds(RemoveOp, NODES, st.lists(U64, max_size=40).map(tuple)),
    st.builds(ClearOp, NODES),
    st.builds(CapacityOp, NODES, st.integers(min_value=0, max_value=1 << 40)),
)


# -- the codec ---------------------------------------------------------------------------------


@given(st.lists(OPS, max_size=60), st.integers(min_value=1, max_value=(1 << 63)))
def test_messages_decode_to_the_ops_in_order(ops: list[IndexOp], sender: int) -> None:
    messages = encode(sender, ops, max_bytes=600, max_ops=7)
    decoded: list[IndexOp] = []
    for m in messages:
        assert len(m) <= 600 or len(decode(m)[1]) == 1  # only an op larger than a message alone
        got_sender, got = decode(m)
        assert got_sender == sender == sender_of(m)
        assert 1 <= len(got) <= 7
        decoded += got
    assert decoded == ops


def test_one_message_per_batch_and_small() -> None:
    chain = tuple(range(1, 33))  # a 2 KB prompt of 64-token blocks is 8; a long one 32
    (message,) = encode(7, [StoreOp("node-1", chain), StoreOp("node-2", chain[:8])])
    assert len(message) < 14 + 2 * 10 + 2 * 15 + 40 * 8 + 1


def test_a_store_longer_than_a_message_keeps_its_head_and_a_removal_is_split() -> None:
    long = tuple(range(1, MAX_OP_BLOCKS + 11))
    messages = encode(1, [StoreOp("a", long), RemoveOp("a", long)])
    ops = [op for m in messages for op in decode(m)[1]]
    assert ops[0] == StoreOp("a", long[:MAX_OP_BLOCKS])
    assert [len(op.hashes) for op in ops[1:] if isinstance(op, RemoveOp)] == [MAX_OP_BLOCKS, 10]


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"\x02" + bytes(13),  # another version
        encode(1, [StoreOp("a", (1, 2))])[0][:-3],
        encode(1, [ClearOp("a")])[0] + b"x",
    ],
)
def test_malformed_messages_are_refused(message: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode(message)


def test_applied_ops_give_the_publishers_index() -> None:
    ops: list[IndexOp] = [
        StoreOp("a", (1, 2, 3)),
        StoreOp("a", (4,), parent=3),
        StoreOp("b", (1, 2)),
        RemoveOp("a", (4,)),
        CapacityOp("b", 1),
        ClearOp("c"),
    ]
    here, there = IndexCore(), IndexCore()
    apply(here, ops)
    apply(there, [op for m in encode(5, ops) for op in decode(m)[1]])
    assert here.stats() == there.stats()
    assert there.lookup([1, 2, 3, 4]) == {"a": 3, "b": 1}


# -- the protocol reader -------------------------------------------------------------------


async def _served(
    tmp_path: Path, pieces: list[bytes], link: _Link, until: Callable[[], bool] = lambda: False
) -> None:
    """``link`` connected to a server on a Unix socket that sends ``pieces`` one at a time, until
    the link ends or ``until()`` (10 s at most: the pieces take longer on a loaded machine)."""

    async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        await asyncio.sleep(5)

    path = str(tmp_path / "s")
    server = await asyncio.start_unix_server(serve, path)
    try:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: link, path)
        deadline = loop.time() + 10.0
        while not link.ended.done() and not until() and loop.time() < deadline:
            await asyncio.sleep(0.01)
    finally:
        if link.transport is not None:
            link.transport.close()
        server.close()


def _holds(items: list[object], n: int) -> bool:
    return len(items) == n


async def test_replies_are_read_whole_whatever_the_cuts(tmp_path: Path) -> None:
    stream = (
        b"+OK\r\n"
        + b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n"
        + b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhe\r\no\r\n"
        + b"$-1\r\n"
    )
    for cut in (1, 3, 7):
        replies: list[object] = []
        link = _Link(2, replies.append, max_bulk=100)
        pieces = [stream[i : i + cut] for i in range(0, len(stream), cut)]
        await _served(tmp_path, pieces, link, until=functools.partial(_holds, replies, 2))
        assert link.handshake.done() and link.handshake.exception() is None
        assert replies == [[b"message", b"ch", b"he\r\no"], None]
    assert command(b"PING") == b"*1\r\n$4\r\nPING\r\n"


async def test_a_refused_handshake_or_a_reply_past_the_bound_ends_the_link(tmp_path: Path) -> None:
    refused = _Link(1, list().append, max_bulk=100)
    await _served(tmp_path, [b"-ERR unknown command\r\n"], refused)
    assert refused.ended.done() and refused.handshake.exception() is not None
    replies: list[object] = []
    big = _Link(1, replies.append, max_bulk=100)
    pieces = [b"+OK\r\n", b"$1000\r\n" + b"x" * 500, b"x" * 500 + b"\r\n", b":1\r\n"]
    await _served(tmp_path, pieces, big)
    assert big.ended.done() and replies == []  # held past its bound: the link ends, nothing more read


# -- two workers' indexes on a real store --------------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[EmbeddedStore]:
    s = EmbeddedStore.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def pair(store: EmbeddedStore) -> AsyncIterator[tuple[ReplicatedIndex, ReplicatedIndex]]:
    prefix = f"prefixgate-test-{time.monotonic_ns()}:"
    a = ReplicatedIndex(store.url, prefix, WorkerSlot(0, 2))
    b = ReplicatedIndex(store.url, prefix, WorkerSlot(1, 2))
    try:
        assert await a.start() and await b.start()
        yield a, b
    finally:
        await a.close()
        await b.close()


async def until(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.005)


Pair = tuple[ReplicatedIndex, ReplicatedIndex]


async def test_writes_through_one_worker_reach_the_other(pair: Pair) -> None:
    a, b = pair
    ops = [StoreOp("n1", (1, 2, 3)), StoreOp("n2", (1,)), StoreOp("n1", (9,), parent=77)]
    assert await a.store(ops) == [True, True, False]
    await until(lambda: b.core.lookup([1, 2, 3]) == {"n1": 3, "n2": 1})
    assert a.peers.stats.published == 1  # one batch, one message
    await b.remove("n1", [3])
    await b.set_capacity("n2", 0)
    await until(lambda: a.core.lookup([1, 2, 3]) == {"n1": 2, "n2": 0})
    await a.replace_node("n1", [[5, 6], [5, 7]])
    await until(lambda: b.core.lookup([5, 7]) == {"n1": 2, "n2": 0})
    assert await b.lookup([1]) == {"n1": 0, "n2": 0}
    await a.clear_node("n1")
    await until(lambda: not b.core.nodes["n1"].blocks)
    assert a.core.stats() == b.core.stats()
    # each receives the other's messages alone (on a channel of its own)
    assert a.peers.stats.received == b.peers.stats.published == 2
    assert b.peers.stats.received == a.peers.stats.published == 3
    assert (await a.stats()).backend == "replicated"


async def test_three_workers_tell_each_other_and_not_themselves(store: EmbeddedStore) -> None:
    prefix = f"prefixgate-test-{time.monotonic_ns()}:"
    workers = [ReplicatedIndex(store.url, prefix, WorkerSlot(i, 3)) for i in range(3)]
    try:
        for w in workers:
            assert await w.start()
        assert workers[1].peers.channel == channel_of(prefix, 1).encode() == f"{prefix}index-ops:1".encode()
        await workers[1].store([StoreOp("n1", (1, 2))])
        await until(lambda: all(w.core.lookup([1, 2]) == {"n1": 2} for w in workers))
        await asyncio.sleep(0.05)
        assert [w.peers.stats.received for w in workers] == [1, 0, 1]
        assert workers[1].peers.stats.published == 1
    finally:
        for w in workers:
            await w.close()


async def test_the_nodes_events_are_applied_locally_not_published(
    pair: Pair,
) -> None:
    a, b = pair
    await a.local.store([StoreOp("n1", (1, 2))])
    await a.local.replace_node("n2", [[3]])
    await a.store([StoreOp("n3", (4,))])  # a marker: published after them
    await until(lambda: b.core.lookup([4]).get("n3") == 1)
    assert b.core.lookup([1, 2]).get("n1", 0) == 0 and "n2" not in b.core.nodes
    assert a.peers.stats.published == 1


async def test_a_dropped_subscriber_comes_back(store: EmbeddedStore, pair: Pair) -> None:
    a, b = pair
    admin = redis.Redis(unix_socket_path=str(store.socket_path))
    try:
        assert admin.client_kill_filter(_type="pubsub") >= 2
        await until(lambda: b.peers.stats.disconnects == 1 and b.peers.subscribed.is_set())
        await a.store([StoreOp("n1", (1,))])
        await until(lambda: b.core.lookup([1]) == {"n1": 1})
    finally:
        admin.close()


async def test_a_subscriber_that_falls_behind_is_dropped_by_the_server_and_carries_on(
    store: EmbeddedStore, pair: Pair
) -> None:
    a, b = pair
    admin = redis.Redis(unix_socket_path=str(store.socket_path))
    limit = str(admin.config_get("client-output-buffer-limit")["client-output-buffer-limit"])
    try:
        admin.config_set("client-output-buffer-limit", "pubsub 256kb 128kb 1")
        link = b.peers.links["subscriber"]
        assert link.transport is not None
        link.transport.pause_reading()  # a worker too busy to read
        chain = tuple(range(1, 2001))
        for i in range(100):  # 1.6 MB of messages
            await a.store([StoreOp(f"n{i}", chain)])
            await asyncio.sleep(0)
        await until(lambda: admin.pubsub_numsub(b.peers.channel)[0][1] == 0)  # b's is gone
        link.transport.resume_reading()  # it reads what it has, then the end of the connection
        await until(lambda: b.peers.stats.disconnects == 1 and b.peers.subscribed.is_set())
        await a.store([StoreOp("late", (5,))])
        await until(lambda: b.core.lookup([5], ["late"]) == {"late": 1})
        assert b.peers.stats.received < 101  # what was published while it was away is lost
    finally:
        admin.config_set("client-output-buffer-limit", limit)
        admin.close()


def test_on_uvloop_as_the_gateway_runs(store: EmbeddedStore) -> None:
    import uvloop

    async def scenario() -> None:
        a, b = (
            ReplicatedIndex(store.url, "uv:", WorkerSlot(0, 2)),
            ReplicatedIndex(store.url, "uv:", WorkerSlot(1, 2)),
        )
        try:
            assert await a.start() and await b.start()
            await a.store([StoreOp("n1", (1, 2))])
            await until(lambda: b.core.lookup([1, 2]) == {"n1": 2})
        finally:
            await a.close()
            await b.close()

    uvloop.run(scenario())


async def test_without_a_store_writes_stay_local_and_are_counted(store: EmbeddedStore) -> None:
    index = ReplicatedIndex(f"unix://{store.directory}/nothing.sock", "x:", WorkerSlot(0, 2))
    try:
        assert not await index.start(wait=0.2)
        assert await index.store([StoreOp("n1", (1,))]) == [True]
        assert await index.lookup([1]) == {"n1": 1}
        assert (await index.stats()).health["peer_publish_dropped"] == 1
    finally:
        await index.close()
