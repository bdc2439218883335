"""KV events from an engine's ZMQ publisher (vLLM, SGLang ``--kv-events-config``) as ``KVEvent``s.

Why: real engines publish their block pool over ZMQ, not over prefixgate's node protocol. A
worker given ``kv_events = ["WORKER_ADDR=tcp://HOST:PORT?replay=tcp://HOST:PORT2&topic=T"]``
gets its index from that publisher instead of (or because it lacks) a node event stream.

The wire (both engines, read strictly in ``zmq_wire``): a PUB socket sends ``[topic, seq
(8 bytes, big-endian), payload]``; ``seq`` starts at 0 per publisher and only resets when the
engine restarts. The payload is a msgpack batch of events (stored blocks with their token ids,
removed blocks, all cleared). The ROUTER replay socket answers ``[b"", start_seq]`` with every
buffered batch from ``start_seq`` and ends with seq ``2**64-1``.

The engine's block hashes are engine-specific (SHA-256 chains, Python ``hash()``...), so they
are only handles here: every stored block is re-hashed from its token ids into the gateway's own
chained block hashes (``cachetier.hashing``) in the namespace a request of that model would use
(``Namespace(model or lora_name, salt_of(cache_salt), block_size, tokenizer)``: the event's
``cache_salt`` is what the gateway gave the engine for a tenant's namespace, mapped back; blocks
under none belong to the gateway's one namespace, or with several tenants to none,
``gateway.core.tenancy``). Engine blocks whose token ids are missing
cannot be named in the gateway's hashes: they are counted (``unmapped``) and left out, and so
are their descendants. The engine's block size need not equal the gateway's: tokens are carried
across engine blocks until a gateway block is full; removing an engine block removes the
gateway blocks it completed.

Gaps (a skipped seq) are filled from the replay socket; when that is impossible (no replay
endpoint, no answer, history gone) the worker's blocks are dropped (CLEARED) and the mapping
starts over (resync). Every new subscription starts with an empty SNAPSHOT, then replays the
publisher's buffered history from 0 to learn what it already holds.

A publisher is trusted with nothing (``zmq_flow``, ``zmq_wire``): a malformed message, batch or
event is dropped and counted (``dropped``, the ``prefixgate_kv_events_dropped`` metric, a log
line at most every ``LOG_EVERY_S`` per kind); a bad stored event is dropped alone, anything else
bad clears the worker. The work is paced (the event loop is handed back every ``SLICE_S``, long
events are mapped ``STEP_BLOCKS`` at a time) and memory is bounded: frames by ``MAX_FRAME_BYTES``
(libzmq's ``ZMQ_MAXMSGSIZE``), libzmq's queues by their high-water marks, the batches waiting
by ``MAX_PENDING_BATCHES`` / ``MAX_PENDING_BYTES`` (beyond them the subscriber is behind: they
are dropped, the worker cleared, and the stream followed from there), a replay by
``DEFAULT_MAX_REPLAY_BYTES`` and in time by ``DEFAULT_REPLAY_DEADLINE_S``, the engine blocks
mapped by an LRU. A replay that broke off, and a subscription that follows its predecessor too
soon (a history the gateway cannot take, replayed again and again), back off exponentially.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    Handoff,
    KVEvent,
    NodeClient,
    NodeFailure,
    NodeStatus,
    PrefillReport,
    Prompt,
    TokenStream,
)
from prefixgate.gateway.nodeclient.zmq_flow import Backoff, Inbox, Pacer, Parts, Throttle
from prefixgate.gateway.nodeclient.zmq_wire import (
    END_SEQ,
    MAX_FRAME_BYTES,
    BadEvent,
    BadMessage,
    BadPayload,
    Cleared,
    EngineEvent,
    Removed,
    Stored,
    decode_batch,
    decode_envelope,
    decode_event,
)
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage

__all__ = [
    "BadPayload",
    "BlockMapper",
    "Change",
    "Cleared",
    "EngineEvent",
    "Removed",
    "Stored",
    "ZmqEventsClient",
    "ZmqKVEvents",
    "ZmqSource",
    "decode_batch",
    "decode_event",
    "events_connector",
    "parse_kv_events",
    "parse_source",
]

log = structlog.get_logger("prefixgate.zmq_events")

MAIN_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
DEVICE_MEDIA = frozenset({"GPU", "gpu", "cuda", "device"})
DEFAULT_MAX_BLOCKS = 262_144
# libzmq's queues, in messages (it has no bound in bytes): the subscriber reads its SUB socket at
# every pause, so the queue there only fills while the loop is busy elsewhere; a full one drops
# (the seq gap shows it). The replay socket's is short: a replay comes all at once.
DEFAULT_RCVHWM = 1000
REPLAY_RCVHWM = 64
# The batches read and waiting to be applied; beyond either bound the subscriber is behind.
MAX_PENDING_BATCHES = 4096
MAX_PENDING_BYTES = 32 << 20
BEHIND_BATCHES = 64  # a gap seen with this many batches waiting is not replayed: we are behind
SLICE_S = 0.001  # the longest the subscriber works before handing the event loop back
STEP_BLOCKS = 512  # engine blocks of one event mapped per step
DEFAULT_REPLAY_TIMEOUT_S = 2.0  # the longest wait for the replay's next message
DEFAULT_REPLAY_DEADLINE_S = 10.0  # the longest a whole replay may take
DEFAULT_MAX_REPLAY_BYTES = 64 << 20
MAX_REPLAY_BATCHES = 100_000  # one replay answer at most (the engines buffer 10 000 by default)
BACKOFF_MIN_S = 0.5  # replays after one broke off; resubscriptions in a row
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0  # a subscription that lasted this long was a success: no backoff after it
LOG_EVERY_S = 10.0  # one line per kind of drop (and of unrecoverable gap) at most this often


# -- the setting ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ZmqSource:
    """Where one worker publishes: the SUB endpoint, its replay endpoint ("" = none), the topic."""

    endpoint: str
    replay: str = ""
    topic: str = ""


def parse_source(spec: str) -> ZmqSource:
    """``tcp://H:P[?replay=tcp://H:Q][&topic=T]`` (``*``/``0.0.0.0`` hosts are not connectable)."""
    parts = urlsplit(spec)
    if parts.scheme not in ("tcp", "ipc", "inproc") or not (parts.netloc or parts.path):
        raise ValueError(f"kv events endpoint {spec!r}: expected tcp://HOST:PORT[?replay=...&topic=...]")
    if parts.scheme == "tcp":
        host = parts.hostname or ""
        if host in ("", "*", "0.0.0.0", "::") or parts.port is None:
            raise ValueError(f"kv events endpoint {spec!r}: give the publisher's HOST:PORT to connect to")
    query = parse_qs(parts.query)
    base = f"{parts.scheme}://{parts.netloc}{parts.path}"
    replay = query.get("replay", [""])[-1]
    if replay and not replay.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"kv events replay endpoint {replay!r}: expected tcp://HOST:PORT")
    return ZmqSource(base, replay, query.get("topic", [""])[-1])


def parse_kv_events(entries: Iterable[str]) -> dict[str, ZmqSource]:
    """The ``kv_events`` setting: ``WORKER_ADDR=ENDPOINT`` entries -> {worker address: source}."""
    out: dict[str, ZmqSource] = {}
    for entry in entries:
        worker, sep, spec = entry.partition("=")
        if not sep or not worker.strip() or not spec.strip():
            raise ValueError(f"kv_events entry {entry!r}: expected WORKER_ADDR=tcp://HOST:PORT")
        out[worker.strip()] = parse_source(spec.strip())
    return out


# -- mapping: engine blocks -> the gateway's chained hashes (pure) --------------------------------


# Where an engine block's prefix stands: (last, chain, carry, root, completed) -- the gateway hash
# of the last full gateway block up to here (0: none yet), the chaining value after it (the
# namespace root when ``last`` is 0), the tokens after it (packed LE uint32), the namespace root,
# the gateway blocks this engine block completed. A plain tuple of ints and bytes: the garbage
# collector stops tracking such tuples, and a mapper holds up to ``DEFAULT_MAX_BLOCKS`` of them
# (as objects they made every full collection of the gateway's heap slower, and more frequent
# while blocks come and go fast).
_Mapped = tuple[int, int, bytes, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Change:
    """One index change: STORED (``parent``, ``hashes`` root first), REMOVED or CLEARED."""

    kind: EventKind
    parent: int = 0
    hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class BlockMapper:
    """Per worker: engine block handle -> where its prefix stands in the gateway's hashes."""

    model: str
    block_size: int  # the gateway's
    tokenizer: str
    max_blocks: int = DEFAULT_MAX_BLOCKS
    blocks: OrderedDict[Hashable, _Mapped] = field(default_factory=OrderedDict)
    unmapped: int = 0  # engine blocks left out (no token ids, unknown parent, other tier)
    # The gateway's namespace salt for the salt an engine reports (``Tenancy.event_salt``).
    salt_of: Callable[[str], str] | None = None
    _roots: dict[tuple[str, str], int] = field(default_factory=dict)

    def root(self, lora_name: str, cache_salt: str) -> int:
        key = (lora_name, cache_salt)
        r = self._roots.get(key)
        if r is None:
            if len(self._roots) > 1024:
                self._roots.clear()
            salt = self.salt_of(cache_salt) if self.salt_of is not None else cache_salt
            ns = Namespace(lora_name or self.model, salt, self.block_size, self.tokenizer)
            r = self._roots[key] = ns.root()
        return r

    def clear(self) -> Change:
        self.blocks.clear()
        return Change(EventKind.CLEARED)

    def apply(self, ev: EngineEvent) -> list[Change]:
        """Every change one event makes, at once."""
        return [c for step in self.steps(ev, max(1, len(getattr(ev, "block_hashes", ())))) for c in step]

    def steps(self, ev: EngineEvent, per_step: int = STEP_BLOCKS) -> Iterator[list[Change]]:
        """The changes of one event, ``per_step`` engine blocks at a time (a long event is worked
        through with the event loop given back in between). Stored steps chain on one another,
        so the changes mean what one change for the whole event would."""
        if isinstance(ev, Cleared):
            yield [self.clear()]
        elif isinstance(ev, Removed):
            yield from self._removed(ev, per_step)
        else:
            yield from self._stored(ev, per_step)

    def _stored(self, ev: Stored, per_step: int) -> Iterator[list[Change]]:
        if (ev.medium is not None and ev.medium not in DEVICE_MEDIA) or (
            ev.spec_kind is not None and ev.spec_kind not in MAIN_ATTENTION
        ):
            return
        n = len(ev.block_hashes)
        stride = 4 * ev.block_size
        if not n or len(ev.tokens) != n * stride:
            self.unmapped += n  # no token ids (or not whole blocks): not nameable in our hashes
            return
        root = self.root(ev.lora_name, ev.cache_salt)
        if ev.parent is None:
            last, chain, carry = 0, root, b""
        else:
            parent = self.blocks.get(ev.parent)
            if parent is None or parent[3] != root:
                self.unmapped += n  # its prefix is unknown here: its gateway hashes cannot be had
                return
            self.blocks.move_to_end(ev.parent)
            last, chain, carry = parent[0], parent[1], parent[2]
        full_stride = 4 * self.block_size
        for lo in range(0, n, per_step):
            first_parent = last
            new: list[int] = []
            for i in range(lo, min(n, lo + per_step)):
                buf = carry + ev.tokens[i * stride : (i + 1) * stride]
                full = len(buf) // full_stride
                done = tuple(block_hashes(buf, self.block_size, chain)) if full else ()
                if done:
                    last = chain = done[-1]
                carry = buf[full * full_stride :]
                new.extend(done)
                handle = ev.block_hashes[i]
                self.blocks[handle] = (last, chain, carry, root, done)
                self.blocks.move_to_end(handle)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)
            yield [Change(EventKind.STORED, first_parent, tuple(new))] if new else []

    def _removed(self, ev: Removed, per_step: int) -> Iterator[list[Change]]:
        if ev.medium is not None and ev.medium not in DEVICE_MEDIA:
            return
        for lo in range(0, len(ev.block_hashes), per_step):
            gone: list[int] = []
            for handle in ev.block_hashes[lo : lo + per_step]:
                state = self.blocks.pop(handle, None)
                if state is not None:
                    gone.extend(state[4])
            yield [Change(EventKind.REMOVED, 0, tuple(gone))] if gone else []


# -- the subscriber -------------------------------------------------------------------------------


class ZmqKVEvents:
    """Subscribes to one publisher; ``events()`` yields the gateway's KVEvents for its worker.

    The object outlives its subscriptions (each ``events()`` call is one): it keeps the counters
    and the backoffs, so a subscription that keeps breaking, or a replay endpoint that keeps
    failing, is retried less and less often."""

    def __init__(
        self,
        source: ZmqSource,
        namespace: Namespace,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        rcvhwm: int = DEFAULT_RCVHWM,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_deadline_s: float = DEFAULT_REPLAY_DEADLINE_S,
        max_replay_bytes: int = DEFAULT_MAX_REPLAY_BYTES,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_pending_batches: int = MAX_PENDING_BATCHES,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        slice_s: float = SLICE_S,
        reconnect_max_s: float = 5.0,
        on_drop: Callable[[str, int], None] | None = None,
        salt_of: Callable[[str], str] | None = None,
    ) -> None:
        self.source = source
        self.salt_of = salt_of
        self.namespace = namespace
        self.max_blocks = max_blocks
        self.rcvhwm = rcvhwm
        self.replay_timeout_s = replay_timeout_s
        self.replay_deadline_s = replay_deadline_s
        self.max_replay_bytes = max_replay_bytes
        self.max_frame_bytes = max_frame_bytes
        self.max_pending_batches = max_pending_batches
        self.max_pending_bytes = max_pending_bytes
        self.slice_s = slice_s
        self.reconnect_max_s = reconnect_max_s
        self.on_drop = on_drop  # (what, count): the gateway's metric
        self.mapper = self._mapper()
        # What happened, for metrics and tests.
        self.gaps = 0
        self.replays = 0
        self.replays_failed = 0  # replays that broke off, and gaps no replay filled
        self.restarts = 0
        self.disconnects = 0
        self.batches = 0
        self.dropped: Counter[str] = Counter()  # message / payload / event / behind
        self._replay_backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
        self._resubscribe = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
        self._subscribed_at: float | None = None
        self._throttle = Throttle(LOG_EVERY_S)

    def _mapper(self) -> BlockMapper:
        ns = self.namespace
        return BlockMapper(ns.model, ns.block_size, ns.tokenizer, self.max_blocks, salt_of=self.salt_of)

    def _socket(self, ctx: zmq.asyncio.Context, kind: int, hwm: int) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.reconnect_max_s * 1000))
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # libzmq drops a larger frame unread
        sock.setsockopt(zmq.RCVHWM, hwm)
        return sock

    # -- what is dropped, said at most once per interval ------------------------------------

    def _drop(self, what: str, error: object, count: int = 1) -> None:
        self.dropped[what] += count
        if self.on_drop is not None:
            self.on_drop(what, count)
        held = self._throttle(what)
        if held is not None:
            log.warning(
                "kv_events_dropped",
                endpoint=self.source.endpoint,
                what=what,
                count=count,
                error=str(error)[:200],
                held_back=held,  # lines like this one not logged since the last
            )

    def _note(self, event: str, **fields: Any) -> None:
        held = self._throttle(event)
        if held is not None:
            log.info(event, endpoint=self.source.endpoint, held_back=held, **fields)

    # -- replay ------------------------------------------------------------------------------

    async def _replay(
        self, ctx: zmq.asyncio.Context, start: int, until: int | None, pace: Pacer
    ) -> list[tuple[int, bytes]] | None:
        """Buffered batches from ``start`` (up to ``until``, excluded), or None when they cannot
        be had: no replay endpoint, the history from ``start`` gone, or the replay broke off (no
        answer in ``replay_timeout_s``, not over in ``replay_deadline_s``, more than
        ``max_replay_bytes``, a batch skipped or malformed). A replay that broke off is logged and
        backs the next ones off."""
        if not self.source.replay:
            return None
        if self._replay_backoff.waiting:
            self._note("kv_events_replay_backing_off", start=start)
            return None
        self.replays += 1
        sock = self._socket(ctx, zmq.DEALER, REPLAY_RCVHWM)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        msg = Parts()
        out: list[tuple[int, bytes]] = []
        size = 0
        deadline = time.monotonic() + self.replay_deadline_s
        reason = ""
        try:
            sock.connect(self.source.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                await pace()
                try:
                    part = raw.recv(zmq.DONTWAIT)
                except zmq.Again:
                    left = deadline - time.monotonic()
                    wait = min(self.replay_timeout_s, left)
                    if wait <= 0 or not await sock.poll(int(wait * 1000) + 1):
                        reason = (
                            f"no answer in {self.replay_timeout_s:.1f} s"
                            if wait >= self.replay_timeout_s
                            else f"slower than {self.replay_deadline_s:.1f} s"
                        )
                        break
                    continue
                msg.add(part)
                if raw.getsockopt(zmq.RCVMORE):
                    continue
                try:
                    s, payload = msg.take(self.max_frame_bytes)
                except BadMessage as e:
                    reason = f"a bad message: {e}"
                    break
                if s == END_SEQ or (until is not None and s >= until):
                    break
                if s != start + len(out):
                    if out:
                        reason = f"batch {start + len(out)} skipped"
                        break
                    self._replay_backoff.reset()
                    return None  # the history from ``start`` is gone: a well-formed answer
                size += len(payload)
                if size > self.max_replay_bytes or len(out) >= MAX_REPLAY_BATCHES:
                    reason = f"more than {self.max_replay_bytes >> 20} MiB or {MAX_REPLAY_BATCHES} batches"
                    break
                out.append((s, payload))
        finally:
            sock.close(linger=0)
        if reason:
            self.replays_failed += 1
            backoff = self._replay_backoff.fail()
            log.warning(
                "kv_events_replay_failed",
                endpoint=self.source.replay,
                start=start,
                got=len(out),
                reason=reason,
                backoff_s=backoff,
            )
            return None
        self._replay_backoff.reset()
        return out or None

    # -- one batch ---------------------------------------------------------------------------

    async def _changes(self, payload: bytes, pace: Pacer, inbox: Inbox) -> AsyncGenerator[Change, None]:
        """The index changes of one batch, event by event and step by step, the loop handed
        back in between. A bad stored event is dropped alone (its blocks, and so their
        descendants, stay unknown); any other bad event, or a bad batch, loses what the worker
        holds: it is cleared. Stops early once the inbox has shed batches (behind)."""
        self.batches += 1
        try:
            raws = decode_envelope(payload)
        except BadPayload as e:
            self._drop("payload", e)
            yield self.mapper.clear()
            return
        for raw in raws:
            if inbox.shed:
                return
            try:
                ev = decode_event(raw)
            except BadEvent as e:
                self._drop("event", e)
                if e.kind != "BlockStored":
                    yield self.mapper.clear()
                ev = None
            if ev is not None:
                for step in self.mapper.steps(ev, STEP_BLOCKS):
                    for change in step:
                        yield change
                    await pace()
                    if inbox.shed:
                        return
            await pace()

    # -- the stream --------------------------------------------------------------------------

    async def _backoff_resubscribing(self) -> None:
        """A subscription that follows the last one within ``STABLE_S`` waits, longer each time
        (a history the gateway cannot take would otherwise be replayed in a loop)."""
        now = time.monotonic()
        last = self._subscribed_at
        if last is None or now - last >= STABLE_S:
            self._resubscribe.reset()
        else:
            delay = self._resubscribe.fail()
            log.warning(
                "kv_events_resubscribe_backoff",
                endpoint=self.source.endpoint,
                after_s=round(now - last, 3),
                delay_s=delay,
            )
            await asyncio.sleep(delay)
        self._subscribed_at = time.monotonic()

    async def _reconnect_on_drop(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """libzmq reconnects after a connection error, not after a protocol error, and a frame
        over ``ZMQ_MAXMSGSIZE`` is one: on every disconnection the subscriber connects again
        itself (at once, then backing off while they keep coming). What was lost on the way is
        a seq gap, as for any other loss."""
        backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
        last = -STABLE_S
        while True:
            if parse_monitor_message(await monitor.recv_multipart())["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.disconnects += 1
            if time.monotonic() - last < STABLE_S:
                delay = backoff.fail()
            else:
                backoff.reset()
                delay = 0.0
            self._note(
                "kv_events_disconnected",
                why=f"a frame over {self.max_frame_bytes} bytes, or the publisher went away",
                reconnect_in_s=delay,
            )
            if delay:
                await asyncio.sleep(delay)
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(self.source.endpoint)
            sub.connect(self.source.endpoint)
            last = time.monotonic()

    async def events(self) -> AsyncGenerator[KVEvent, None]:
        """An empty SNAPSHOT, then the worker's changes; runs until closed or cancelled."""
        await self._backoff_resubscribing()
        instance = f"zmq-{uuid.uuid4().hex[:12]}"
        seq = 0
        self.mapper = self._mapper()
        ctx = zmq.asyncio.Context()
        sub = self._socket(ctx, zmq.SUB, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        inbox = Inbox(
            sub,
            self.max_pending_batches,
            self.max_pending_bytes,
            lambda e: self._drop("message", e),
            self.max_frame_bytes,
        )
        pace = Pacer(self.slice_s, inbox.drain)

        def out(change: Change) -> KVEvent:
            nonlocal seq
            seq += 1
            return KVEvent(seq, instance, change.kind, change.parent, change.hashes)

        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watcher = asyncio.create_task(self._reconnect_on_drop(sub, monitor), name="kv-events-reconnect")
        try:
            sub.connect(self.source.endpoint)
            seq += 1
            yield KVEvent(seq, instance, EventKind.SNAPSHOT)
            expected: int | None = None  # the next seq (None: take the first one seen)
            replayed = range(0)
            history = await self._replay(ctx, 0, None, pace)  # what the publisher already holds
            if history:
                expected = history[-1][0] + 1
                replayed = range(history[0][0], expected)
                for _, payload in history:
                    if inbox.shed:
                        break  # behind already: the loop below starts over
                    async for change in self._changes(payload, pace, inbox):
                        yield out(change)
                history = None
            while True:
                got = await inbox.next()
                if got is None:  # behind the publisher: what waited is gone, start over
                    self._drop("behind", "the subscriber fell behind the publisher", inbox.shed)
                    inbox.shed = 0
                    yield out(self.mapper.clear())
                    expected, replayed = None, range(0)
                    continue
                s, payload = got
                if expected is None:
                    expected = s
                if s < expected:
                    if s in replayed:
                        continue  # also received through the replay
                    self.restarts += 1  # the publisher started over: its blocks are gone
                    log.info("kv_events_publisher_restarted", endpoint=self.source.endpoint, seq=s)
                    yield out(self.mapper.clear())
                    expected = s
                if s > expected:
                    self.gaps += 1
                    failed = self.replays_failed
                    # With batches waiting, the gap is ours (libzmq dropped what did not fit):
                    # catching up on it would only put us further behind.
                    behind = len(inbox.queue) >= BEHIND_BATCHES
                    missed = None if behind else await self._replay(ctx, expected, s, pace)
                    if missed is None:
                        self.replays_failed = max(self.replays_failed, failed + 1)
                        self._note("kv_events_gap_unrecoverable", expected=expected, got=s)
                        yield out(self.mapper.clear())
                    else:
                        replayed = range(expected, missed[-1][0] + 1)
                        for _, rp in missed:
                            if inbox.shed:
                                break
                            async for change in self._changes(rp, pace, inbox):
                                yield out(change)
                async for change in self._changes(payload, pace, inbox):
                    yield out(change)
                expected = s + 1
                if s + 1 >= replayed.stop:
                    replayed = range(0)  # live past the replay: no duplicate can follow
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await watcher
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            ctx.term()


# -- a node client whose KV events come from ZMQ ---------------------------------------------------


MODEL_NAME_TIMEOUT_S = 5.0  # the worker's status, for the model its events belong to


class ZmqEventsClient:
    """A worker's client with its ``kv_events`` taken from the engine's ZMQ publisher."""

    def __init__(self, inner: NodeClient, events: ZmqKVEvents) -> None:
        self.inner = inner
        self.source = events
        self._capabilities = replace(inner.capabilities, kv_events=True)

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def handoff(self) -> Handoff | None:
        return self.inner.handoff

    async def status(self, timeout: float) -> NodeStatus:
        return await self.inner.status(timeout)

    def generate(self, prompt: Prompt, *, timeout: float) -> TokenStream:
        return self.inner.generate(prompt, timeout=timeout)

    async def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        """Always from a fresh SNAPSHOT: a ZMQ publisher keeps no cursor for us. The blocks are
        named in the namespace of the model the worker says it serves (as requests for it are
        hashed), so the worker's status comes first."""
        status = await self.inner.status(MODEL_NAME_TIMEOUT_S)
        if status.models and status.models[0] != self.source.namespace.model:
            self.source.namespace = replace(self.source.namespace, model=status.models[0])
        gen = self.source.events()
        try:
            async for ev in gen:
                yield ev
        except zmq.ZMQError as e:
            raise NodeFailure(self.address, Stage.PROBE, FailureKind.UNAVAILABLE, f"kv events: {e}") from None
        finally:
            with contextlib.suppress(Exception):
                await gen.aclose()

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        return await self.inner.warm(prompt, pin_seconds=pin_seconds, timeout=timeout)

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        return await self.inner.evict(hashes, everything=everything, timeout=timeout)

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        return await self.inner.pin(hashes, seconds=seconds, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def events_connector(
    entries: Iterable[str],
    namespace: Namespace,
    connect: Callable[[str], NodeClient],
    on_drop: Callable[[str, int], None] | None = None,
    salt_of: Callable[[str], str] | None = None,
) -> Callable[[str], NodeClient]:
    """``connect`` wrapped so that workers named in ``entries`` get their events over ZMQ.

    ``namespace``'s model, block size and tokenizer are the gateway's (its tenant is ignored:
    each event brings its own cache salt, mapped by ``salt_of``); ``on_drop(what, count)`` hears
    of what was dropped."""
    sources = parse_kv_events(entries)
    if not sources:
        return connect

    def wrapped(address: str) -> NodeClient:
        client = connect(address)
        source = sources.get(address)
        if source is None:
            return client
        return ZmqEventsClient(client, ZmqKVEvents(source, namespace, on_drop=on_drop, salt_of=salt_of))

    return wrapped
