"""The index of gateway workers on their embedded store: each worker's own, kept the same in all.

Why: the workers of one supervisor (``prefixgate gateway --workers N`` without ``--redis``)
used to share the index in their private store as replicas share Redis, so every request cost
its worker a lookup round trip and a write of its prediction through redis-py (3.55-3.63 M
instructions a request where the in-process index costs 3.20 M, under callgrind; a lookup p99
of 0.5 ms). Yet the workers see the
same things: each already follows every node's KV events. So each worker routes on an
in-process ``IndexCore`` (a lookup is a few dict probes, no I/O) and keeps it the same as its
siblings' this way:

- the nodes' KV events: each worker applies them to its own core (``ReplicatedIndex.local``,
  not published);
- the writes a worker makes on its own (its routing predictions, admin evictions and clears,
  node removal, capacities, pins): applied to its core and **published** to the others on the
  store's pub/sub, one compact binary message per write batch, which names its sender;
- what the others publish: applied as it arrives (``ReplicatedIndex._received``).

Each worker listens on a channel of its own (``P`` + ``index-ops:`` + its number among the
supervisor's workers, which a replacement keeps), and a message is published to each sibling's
channel (one ``PUBLISH`` for two workers), never to the sender's: receiving its own messages
only to skip them cost a worker as much as applying a sibling's (a wakeup of its event loop,
some 170,000 instructions a request under callgrind). A message from its own sender id is
still skipped (two gateways given one prefix and store by mistake).

Pub/sub is at most once: a message lost (a reconnection, a subscriber the server disconnected
for falling behind) loses predictions, which are hints; the nodes' events, followed by every
worker, keep what the nodes hold right, and a misprediction resyncs a node from its snapshot.

Everything is bounded: a message (``MAX_MESSAGE_BYTES``, ``MAX_OPS_PER_MESSAGE``; one store
longer than a message keeps its leading blocks, a valid chain), what waits to be sent
(``MAX_PUBLISH_BACKLOG``: beyond it messages are dropped and counted), what a subscriber holds
(one message being read; the server disconnects one that falls behind its output-buffer limit),
and the reconnection backoff (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``).

The codec is pure. ``IndexPeers`` is the thin shell around two connections (one publishes, one
is subscribed), each re-made with backoff; commands are packed and replies read by hiredis (the
C protocol reader redis-py uses). Not redis-py's own clients: its pub/sub and its commands await
every reply, and a publish that waits for its answer (how many received it, which nothing here
reads) is the round trip a request must not pay; the publishing connection has its replies off.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
import structlog

from prefixgate.cachetier.index import DEFAULT_CAPACITY_BLOCKS, IndexStats, StoreOp
from prefixgate.cachetier.memory import IndexCore, MemoryIndex
from prefixgate.cachetier.tasks import stop_tasks

log = structlog.get_logger("prefixgate.cachetier.replicated")

#: The largest message published (and accepted): 1 MiB holds one store of 131,000 blocks.
MAX_MESSAGE_BYTES = 1 << 20
#: Ops per message (the writer's batches hold at most 256).
MAX_OPS_PER_MESSAGE = 256
#: Bytes waiting to be sent to the store beyond which new messages are dropped (and counted).
MAX_PUBLISH_BACKLOG = 4 << 20
#: Longest node id carried (node ids are addresses or short names); longer ones are not sent.
MAX_NODE_BYTES = 1024
#: Reconnection backoff: the first retry, doubled at each failure up to the last.
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
#: How long a connection and its handshake may take.
CONNECT_TIMEOUT_S = 2.0
#: A link's disconnections are logged at most this often (with how many there were).
LOG_EVERY_S = 60.0
#: The channels under the key prefix: ``PREFIX index-ops:N`` is worker N's.
CHANNEL_SUFFIX = "index-ops"

VERSION = 1
_HEADER = struct.Struct("<BQHH")  # version, sender, node names, ops
_NAME = struct.Struct("<H")
_OP = struct.Struct("<BH")  # kind, node number
_STORE = struct.Struct("<QI")  # parent, blocks
_COUNT = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STORE_KIND, _REMOVE_KIND, _CLEAR_KIND, _CAPACITY_KIND = 1, 2, 3, 4
#: Blocks one op may carry so that it fits a message by itself.
MAX_OP_BLOCKS = (MAX_MESSAGE_BYTES - _HEADER.size - _NAME.size - MAX_NODE_BYTES - 32) // 8


# -- the ops and their encoding (pure) -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoveOp:
    """These blocks are gone from a node."""

    node: str
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClearOp:
    """Every block of a node is gone."""

    node: str


@dataclass(frozen=True, slots=True)
class CapacityOp:
    """A node's capacity in blocks."""

    node: str
    blocks: int


IndexOp = StoreOp | RemoveOp | ClearOp | CapacityOp


class MalformedMessage(ValueError):
    """A message that does not decode (another version, truncated, garbage)."""


def apply(core: IndexCore, ops: Iterable[IndexOp]) -> None:
    """Apply ops to ``core`` in order, as the worker that published them did."""
    for op in ops:
        if isinstance(op, StoreOp):
            core.store((op,))
        elif isinstance(op, RemoveOp):
            core.remove(op.node, op.hashes)
        elif isinstance(op, ClearOp):
            core.clear_node(op.node)
        else:
            core.set_capacity(op.node, op.blocks)


def bounded(ops: Iterable[IndexOp]) -> Iterator[IndexOp]:
    """Each op small enough for a message by itself: a long store keeps its leading blocks (a
    chain's head is a chain), a long removal is split; ops of a node whose id is too long for
    a message are left out."""
    for op in ops:
        if len(op.node.encode()) > MAX_NODE_BYTES:
            continue
        if isinstance(op, StoreOp) and len(op.hashes) > MAX_OP_BLOCKS:
            yield StoreOp(op.node, op.hashes[:MAX_OP_BLOCKS], op.parent)
        elif isinstance(op, RemoveOp) and len(op.hashes) > MAX_OP_BLOCKS:
            for i in range(0, len(op.hashes), MAX_OP_BLOCKS):
                yield RemoveOp(op.node, op.hashes[i : i + MAX_OP_BLOCKS])
        else:
            yield op


def _op_size(op: IndexOp) -> int:
    if isinstance(op, StoreOp):
        return _OP.size + _STORE.size + 8 * len(op.hashes)
    if isinstance(op, RemoveOp):
        return _OP.size + _COUNT.size + 8 * len(op.hashes)
    if isinstance(op, ClearOp):
        return _OP.size
    return _OP.size + _U64.size


class _Draft:
    """One message being filled."""

    __slots__ = ("names", "ops", "size")

    def __init__(self) -> None:
        self.names: dict[str, bytes] = {}
        self.ops: list[IndexOp] = []
        self.size = _HEADER.size

    def cost(self, op: IndexOp) -> int:
        name = 0 if op.node in self.names else _NAME.size + len(op.node.encode())
        return name + _op_size(op)

    def add(self, op: IndexOp, cost: int) -> None:
        if op.node not in self.names:
            self.names[op.node] = op.node.encode()
        self.ops.append(op)
        self.size += cost

    def encode(self, sender: int) -> bytes:
        number = {name: i for i, name in enumerate(self.names)}
        parts = [_HEADER.pack(VERSION, sender, len(self.names), len(self.ops))]
        for raw in self.names.values():
            parts += (_NAME.pack(len(raw)), raw)
        for op in self.ops:
            if isinstance(op, StoreOp):
                n = len(op.hashes)
                parts += (_OP.pack(_STORE_KIND, number[op.node]), _STORE.pack(op.parent, n))
                parts.append(struct.pack(f"<{n}Q", *op.hashes))
            elif isinstance(op, RemoveOp):
                n = len(op.hashes)
                parts += (_OP.pack(_REMOVE_KIND, number[op.node]), _COUNT.pack(n))
                parts.append(struct.pack(f"<{n}Q", *op.hashes))
            elif isinstance(op, ClearOp):
                parts.append(_OP.pack(_CLEAR_KIND, number[op.node]))
            else:
                parts += (_OP.pack(_CAPACITY_KIND, number[op.node]), _U64.pack(max(0, op.blocks)))
        return b"".join(parts)


def encode(
    sender: int,
    ops: Iterable[IndexOp],
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_ops: int = MAX_OPS_PER_MESSAGE,
) -> list[bytes]:
    """``ops`` as messages of at most ``max_bytes`` and ``max_ops`` each, in order."""
    out: list[bytes] = []
    draft = _Draft()
    for op in bounded(ops):
        cost = draft.cost(op)
        if draft.ops and (len(draft.ops) >= max_ops or draft.size + cost > max_bytes):
            out.append(draft.encode(sender))
            draft = _Draft()
            cost = draft.cost(op)
        draft.add(op, cost)
    if draft.ops:
        out.append(draft.encode(sender))
    return out


def sender_of(message: bytes) -> int:
    """The id of the worker that published ``message`` (0 when it is too short to say)."""
    return _U64.unpack_from(message, 1)[0] if len(message) >= _HEADER.size else 0


def decode(message: bytes) -> tuple[int, list[IndexOp]]:
    """(sender, ops) of a message; raises ``MalformedMessage``."""
    try:
        version, sender, n_names, n_ops = _HEADER.unpack_from(message, 0)
        if version != VERSION:
            raise MalformedMessage(f"message version {version}, expected {VERSION}")
        if n_ops > MAX_OPS_PER_MESSAGE:
            raise MalformedMessage(f"{n_ops} ops in one message")
        pos = _HEADER.size
        names: list[str] = []
        for _ in range(n_names):
            (size,) = _NAME.unpack_from(message, pos)
            pos += _NAME.size
            if pos + size > len(message):
                raise MalformedMessage("truncated node id")
            names.append(message[pos : pos + size].decode())
            pos += size
        ops: list[IndexOp] = []
        for _ in range(n_ops):
            kind, number = _OP.unpack_from(message, pos)
            pos += _OP.size
            node = names[number]
            if kind == _STORE_KIND:
                parent, n = _STORE.unpack_from(message, pos)
                pos += _STORE.size
                ops.append(StoreOp(node, struct.unpack_from(f"<{n}Q", message, pos), parent))
                pos += 8 * n
            elif kind == _REMOVE_KIND:
                (n,) = _COUNT.unpack_from(message, pos)
                pos += _COUNT.size
                ops.append(RemoveOp(node, struct.unpack_from(f"<{n}Q", message, pos)))
                pos += 8 * n
            elif kind == _CLEAR_KIND:
                ops.append(ClearOp(node))
            elif kind == _CAPACITY_KIND:
                (blocks,) = _U64.unpack_from(message, pos)
                pos += _U64.size
                ops.append(CapacityOp(node, blocks))
            else:
                raise MalformedMessage(f"unknown op kind {kind}")
        if pos != len(message):
            raise MalformedMessage(f"{len(message) - pos} bytes after the last op")
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise MalformedMessage(str(e)) from None
    return sender, ops


# -- the Redis protocol, as much as a publisher and a subscriber need (pure) ---------------


class ProtocolError(Exception):
    """The store sent more than this side takes at once (a reply past its bound)."""


def command(*args: bytes) -> bytes:
    """One command in the Redis protocol (hiredis packs it)."""
    packed: bytes = hiredis.pack_command(cast(Any, args))  # its stub types a 1-tuple only
    return packed


# -- the shell: two connections to the store ------------------------------------------------


@dataclass(slots=True)
class PeerStats:
    published: int = 0  # messages sent to the store
    publish_dropped: int = 0  # messages not sent: no connection, or too much waiting
    received: int = 0  # the other workers' messages applied
    received_ops: int = 0
    malformed: int = 0  # messages that did not decode
    disconnects: int = 0  # connections to the store that ended (the server drops a slow subscriber)


class _Link(asyncio.Protocol):
    """One connection: its first ``expect`` replies answer the handshake, the rest go to
    ``on_reply``; ``ended`` resolves when the connection does. Replies are parsed by hiredis's
    reader (the C parser redis-py uses); what it holds is bounded by ``max_bulk``: one reply
    being read, its framing included."""

    def __init__(self, expect: int, on_reply: Callable[[Any], None], max_bulk: int) -> None:
        loop = asyncio.get_running_loop()
        self.reader = hiredis.Reader()
        self.max_buffered = max_bulk + 256
        self.expect = expect
        self.on_reply = on_reply
        self.handshake: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                if self.expect:
                    self.expect -= 1
                    if isinstance(reply, hiredis.ReplyError):
                        self._fail(reply)
                        return
                    if not self.expect and not self.handshake.done():
                        self.handshake.set_result(None)
                else:
                    self.on_reply(reply)
        except hiredis.ProtocolError as e:
            self._fail(e)
            return
        if reader.len() > self.max_buffered:
            self._fail(ProtocolError(f"a reply of more than {self.max_buffered} bytes"))

    def _fail(self, error: Exception) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(error)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(exc or ConnectionResetError("the store closed the connection"))
        if not self.ended.done():
            self.ended.set_result(None)


class IndexPeers:
    """Publishes messages to each of the ``tell`` channels of the store at ``url``
    (``unix://PATH`` or ``redis://HOST:PORT``) and hands every message published on ``listen``
    to ``on_message``: one connection for each, each re-made with backoff when it ends.

    ``publish`` never waits: it writes to the publishing connection, or drops (and counts) the
    messages when there is none or too much is still waiting to be sent."""

    def __init__(
        self,
        url: str,
        listen: str,
        tell: Sequence[str],
        on_message: Callable[[bytes], None],
        name: str = "",
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("unix", "redis") or parts.username or parts.password:
            raise ValueError(f"index peers take unix://PATH or redis://HOST:PORT (no credentials): {url!r}")
        self._path = parts.path if parts.scheme == "unix" else ""
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 6379
        self.channel = listen.encode()
        self.on_message = on_message
        self.name = name or secrets.token_hex(4)
        self.stats = PeerStats()
        self.subscribed = asyncio.Event()
        self._publisher: asyncio.Transport | None = None
        self.links: dict[str, _Link] = {}  # the connections up now, by role
        self._heads = [
            b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n" % (len(c), c) for c in (t.encode() for t in tell)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # -- publishing ------------------------------------------------------------------------

    def publish(self, messages: Sequence[bytes]) -> bool:
        """Send ``messages`` (one PUBLISH each to each sibling); False when they were dropped."""
        if not self._heads:
            return True  # no sibling to tell
        t = self._publisher
        if t is None or t.is_closing() or t.get_write_buffer_size() > MAX_PUBLISH_BACKLOG:
            self.stats.publish_dropped += len(messages)
            return False
        frames: list[bytes] = []
        for m in messages:
            size = b"$%d\r\n" % len(m)
            for head in self._heads:
                frames += (head, size, m, b"\r\n")
        t.write(b"".join(frames))
        self.stats.published += len(messages)
        return True

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._tasks or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._keep("publisher"), name="index-peers-publisher"),
            loop.create_task(self._keep("subscriber"), name="index-peers-subscriber"),
        ]

    async def close(self) -> None:
        self._closed = True
        tasks: list[asyncio.Future[Any]] = list(self._tasks)
        self._tasks = []
        await stop_tasks(tasks)

    # -- connections -----------------------------------------------------------------------

    async def _connect(self, role: str) -> _Link:
        loop = asyncio.get_running_loop()
        client = b"prefixgate-index-%s-%s" % (role[:3].encode(), self.name.encode())
        if role == "publisher":
            # replies off: a PUBLISH answers how many received it, which nothing here reads
            hello = command(b"CLIENT", b"SETNAME", client) + command(b"CLIENT", b"REPLY", b"OFF")
            link = _Link(1, _ignore, 1024)
        else:
            hello = command(b"CLIENT", b"SETNAME", client) + command(b"SUBSCRIBE", self.channel)
            link = _Link(2, self._on_reply, MAX_MESSAGE_BYTES)
        if self._path:
            await loop.create_unix_connection(lambda: link, self._path)
        else:
            await loop.create_connection(lambda: link, self._host, self._port)
        assert link.transport is not None
        try:
            link.transport.write(hello)
            await link.handshake
        except BaseException:
            link.handshake.cancel()  # nobody waits for it any more
            link.transport.abort()
            raise
        return link

    def _on_reply(self, reply: Any) -> None:
        if type(reply) is list and len(reply) == 3 and reply[0] == b"message":
            try:
                self.on_message(reply[2])
            except Exception as e:  # one bad message must not end the subscription
                self.stats.malformed += 1
                log.warning("index_peers_message_failed", error=repr(e)[:200])

    async def _keep(self, role: str) -> None:
        """Keep one connection up: made again after each end, with backoff while it fails."""
        delay = BACKOFF_MIN_S
        failing = False
        lost = 0
        logged_at = float("-inf")
        while not self._closed:
            try:
                link = await asyncio.wait_for(self._connect(role), CONNECT_TIMEOUT_S)
            except Exception as e:  # refused, absent, silent, or not speaking the protocol
                if not failing:
                    log.warning("index_peers_unreachable", link=role, error=repr(e)[:200])
                failing = True
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            if failing:
                log.info("index_peers_connected", link=role)
            failing = False
            delay = BACKOFF_MIN_S
            transport = link.transport
            assert transport is not None
            self.links[role] = link
            try:
                if role == "publisher":
                    self._publisher = transport
                else:
                    self.subscribed.set()
                await link.ended
            finally:
                self.links.pop(role, None)
                if role == "publisher":
                    self._publisher = None
                else:
                    self.subscribed.clear()
                transport.abort()
            if self._closed:
                return
            self.stats.disconnects += 1
            lost += 1
            now = time.monotonic()
            if now - logged_at >= LOG_EVERY_S:
                # a subscriber too far behind is disconnected by the server: what was published
                # meanwhile is lost to this worker (hints; the nodes' events keep the index right)
                log.warning("index_peers_disconnected", link=role, times=lost)
                logged_at, lost = now, 0


def _ignore(reply: Any) -> None:
    return None


# -- the index -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """A worker's place among its supervisor's: number ``index`` of ``count`` (a worker started
    to replace a dead one takes its number, and so its channel)."""

    index: int
    count: int


class ReplicatedIndex:
    """``BlockIndex`` on this worker's own ``IndexCore``: lookups local; the writes made through
    it are applied here and published to the sibling workers (``IndexPeers``), whose writes
    are applied here as they arrive. ``local`` is the same core without publishing: where the
    nodes' KV events go, which every worker follows itself."""

    backend = "replicated"

    def __init__(
        self,
        url: str,
        prefix: str,
        slot: WorkerSlot,
        *,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
        sender: int | None = None,
    ) -> None:
        self.core = IndexCore(default_capacity)
        self.local = MemoryIndex(core=self.core)
        self.slot = slot
        self.sender = sender if sender is not None else secrets.randbits(63) + 1
        self._own = _U64.pack(self.sender)
        self.peers = sibling_peers(url, prefix, slot, self._received, name=f"{slot.index}-{self.sender:016x}")

    async def start(self, wait: float = CONNECT_TIMEOUT_S) -> bool:
        """Connect to the store; True once subscribed (within ``wait``), else it goes on trying.
        A worker alone (``count`` 1) has no one to tell or hear: it does not connect."""
        if self.slot.count <= 1:
            return True
        self.peers.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self.peers.subscribed.wait()
        return self.peers.subscribed.is_set()

    def _publish(self, ops: Sequence[IndexOp]) -> None:
        if ops:
            self.peers.publish(encode(self.sender, ops))

    def _received(self, message: bytes) -> None:
        if message[1:9] == self._own:
            return
        try:
            _, ops = decode(message)
        except MalformedMessage as e:
            self.peers.stats.malformed += 1
            if self.peers.stats.malformed == 1:
                log.warning("index_peers_malformed_message", error=str(e)[:200], size=len(message))
            return
        apply(self.core, ops)
        self.peers.stats.received += 1
        self.peers.stats.received_ops += len(ops)

    # -- reads: local, no I/O ----------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int], nodes: Sequence[str] | None = None) -> dict[str, int]:
        return self.core.lookup(hashes, nodes)

    async def node_hashes(self, node: str) -> set[int]:
        return await self.local.node_hashes(node)

    async def stats(self) -> IndexStats:
        s = self.core.stats()
        st = self.peers.stats
        health = {
            "peer_publish_dropped": st.publish_dropped,
            "peer_disconnects": st.disconnects,
            "peer_malformed": st.malformed,
        }
        return IndexStats(self.backend, s.total_blocks, s.nodes, health=health)

    def peer_stats(self) -> dict[str, int]:
        return asdict(self.peers.stats)

    # -- writes: here, then to the other workers ------------------------------------------------

    async def store(self, ops: Sequence[StoreOp]) -> list[bool]:
        results = self.core.store(ops)
        self._publish([op for op, ok in zip(ops, results, strict=True) if ok])
        return results

    async def remove(self, node: str, hashes: Iterable[int]) -> int:
        hashes = tuple(hashes)
        n = self.core.remove(node, hashes)
        self._publish([RemoveOp(node, hashes)])
        return n

    async def clear_node(self, node: str) -> int:
        n = self.core.clear_node(node)
        self._publish([ClearOp(node)])
        return n

    async def replace_node(self, node: str, chains: Sequence[Sequence[int]]) -> None:
        self.core.replace_node(node, chains)
        self._publish([ClearOp(node), *(StoreOp(node, tuple(c)) for c in chains)])

    async def set_capacity(self, node: str, blocks: int) -> None:
        self.core.set_capacity(node, blocks)
        self._publish([CapacityOp(node, blocks)])

    async def close(self) -> None:
        await self.peers.close()


def channel_of(prefix: str, worker: int, suffix: str = CHANNEL_SUFFIX) -> str:
    """The pub/sub channel worker number ``worker`` listens on, of the workers sharing ``prefix``
    (``suffix``: what the channel carries; the index's writes by default)."""
    return f"{prefix}{suffix}:{worker}"


def sibling_peers(
    url: str,
    prefix: str,
    slot: WorkerSlot,
    on_message: Callable[[bytes], None],
    *,
    suffix: str = CHANNEL_SUFFIX,
    name: str = "",
) -> IndexPeers:
    """Worker ``slot``'s link to its siblings on the store at ``url``: it listens on its own
    channel and publishes to each of theirs (never its own)."""
    siblings = [channel_of(prefix, i, suffix) for i in range(slot.count) if i != slot.index]
    return IndexPeers(url, channel_of(prefix, slot.index, suffix), siblings, on_message, name=name)
