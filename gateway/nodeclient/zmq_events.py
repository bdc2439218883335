"""KV events from an engine's ZMQ publisher (vLLM, SGLang ``--kv-events-config``) as ``KVEvent``s.

Why: real engines publish their block pool over ZMQ, not over prefixgate's node protocol. A
worker given ``kv_events = ["WORKER_ADDR=tcp://HOST:PORT?replay=tcp://HOST:PORT2&topic=T"]``
gets its index from that publisher instead of (or because it lacks) a node event stream.

The wire (both engines): a PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]``;
``seq`` starts at 0 per publisher and only resets when the engine restarts. The payload is a
msgpack batch: an array ``[ts, events, dp_rank?]`` (SGLang, older vLLM) or a map ``{ts, events,
data_parallel_rank}`` (vLLM main). Each event is msgspec-tagged, either as an array whose first
cell is the tag (``array_like`` structs: ``["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium, ...]``) or as a map with ``"type"`` (SGLang 0.5+, vLLM main). The
ROUTER replay socket answers ``[b"", start_seq]`` with every buffered batch from ``start_seq``
(``[b"", seq, payload]``, or with a topic frame before ``seq``) and ends with seq ``2**64-1``.

The engine's block hashes are engine-specific (SHA-256 chains, Python ``hash()``...), so they
are only handles here: every stored block is re-hashed from its token ids into the gateway's own
chained block hashes (``cachetier.hashing``) in the namespace a request of that model would use
(``Namespace(model or lora_name, cache_salt or "", block_size, tokenizer)``; without API keys
the gateway's tenant is "" too, so requests match). Engine blocks whose token ids are missing
cannot be named in the gateway's hashes: they are counted (``unmapped``) and left out, and so
are their descendants. The engine's block size need not equal the gateway's: tokens are carried
across engine blocks until a gateway block is full; removing an engine block removes the
gateway blocks it completed.

Gaps (a skipped seq) are filled from the replay socket; when that is impossible (no replay
endpoint, no answer, history gone) the worker's blocks are dropped (CLEARED) and the mapping
starts over (resync). Every new subscription starts with an empty SNAPSHOT, then replays the
publisher's buffered history from 0 to learn what it already holds. Bounds: the SUB socket's
receive high-water mark (ZMQ drops beyond it; the seq gap then triggers a replay), the number
of engine blocks mapped (LRU), the replay wait, ZMQ's reconnect backoff.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import structlog
import zmq
import zmq.asyncio

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
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage

log = structlog.get_logger("prefixgate.zmq_events")

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
MAIN_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
DEVICE_MEDIA = frozenset({"GPU", "gpu", "cuda", "device"})
DEFAULT_MAX_BLOCKS = 262_144
DEFAULT_RCVHWM = 10_000
DEFAULT_REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_BATCHES = 100_000  # one replay answer at most (the engines buffer 10 000 by default)


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


# -- decoding: both payload shapes -> engine events ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    cache_salt: str = ""
    medium: str | None = None
    group_idx: int | None = None
    spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


EngineEvent = Stored | Removed | Cleared

# array_like field order after the tag (vLLM's BlockStored / BlockRemoved; SGLang's array-like
# releases publish the first five cells of the same order).
_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
_REMOVED = ("block_hashes", "medium", "group_idx")

_decoder = msgspec.msgpack.Decoder()


class BadPayload(ValueError):
    """A batch that is not an engine KV event batch."""


def _handle(h: Any) -> Hashable:
    if isinstance(h, int | bytes):
        return h
    if isinstance(h, bytearray | memoryview):
        return bytes(h)
    raise BadPayload(f"block hash of type {type(h).__name__}")


def _tokens(cells: Any) -> tuple[int, ...]:
    if not isinstance(cells, list):
        raise BadPayload("token_ids is not a list")
    # SGLang's EAGLE publishes [token, next] bigrams: the block holds the first.
    return tuple(int(c[0]) if isinstance(c, list | tuple) else int(c) for c in cells)


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of a tagged event, array-like or map."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return str(raw["type"]), raw
    raise BadPayload("an event is neither a tagged array nor a tagged map")


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def decode_event(raw: Any) -> EngineEvent | None:
    """One engine event (None: a kind the index does not use)."""
    tag = raw[0] if isinstance(raw, list) and raw else raw.get("type") if isinstance(raw, dict) else None
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED)
        locality = f.get("locality")
        if isinstance(locality, str) and locality.upper() != "LOCAL":
            return None  # a remote copy: not this worker's to serve from
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise BadPayload("BlockStored without block_hashes")
        parent = f.get("parent_block_hash")
        return Stored(
            tuple(_handle(h) for h in hashes),
            None if parent is None else _handle(parent),
            _tokens(f.get("token_ids") or []),
            int(f.get("block_size") or 0),
            lora_name=_str(f.get("lora_name")),
            cache_salt=_str(f.get("cache_salt")),
            medium=f.get("medium") if isinstance(f.get("medium"), str) else None,
            group_idx=f.get("group_idx") if isinstance(f.get("group_idx"), int) else None,
            spec_kind=_str(f.get("kv_cache_spec_kind")) or None,
        )
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED)
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise BadPayload("BlockRemoved without block_hashes")
        medium = f.get("medium")
        group = f.get("group_idx")
        return Removed(
            tuple(_handle(h) for h in hashes),
            medium if isinstance(medium, str) else None,
            group if isinstance(group, int) else None,
        )
    if tag == "AllBlocksCleared":
        return Cleared()
    if isinstance(tag, str):
        return None  # an event kind added later: not ours to guess
    raise BadPayload("an event without a tag")


def decode_batch(payload: bytes) -> list[EngineEvent]:
    """A published payload -> its events, in order."""
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise BadPayload(f"not msgpack: {e}") from None
    if isinstance(obj, list) and len(obj) >= 2:
        events = obj[1]
    elif isinstance(obj, dict):
        events = obj.get("events")
    else:
        raise BadPayload("not an event batch")
    if not isinstance(events, list):
        raise BadPayload("batch events is not a list")
    out: list[EngineEvent] = []
    for raw in events:
        ev = decode_event(raw)
        if ev is not None:
            out.append(ev)
    return out


# -- mapping: engine blocks -> the gateway's chained hashes (pure) --------------------------------


@dataclass(slots=True)
class _Mapped:
    last: int  # the gateway hash of the last full gateway block up to here (0: none yet)
    chain: int  # the chaining value after it (the namespace root when ``last`` is 0)
    carry: bytes  # tokens after the last full gateway block (packed LE uint32)
    root: int
    completed: tuple[int, ...] = ()  # gateway blocks this engine block completed


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
    _roots: dict[tuple[str, str], int] = field(default_factory=dict)

    def root(self, lora_name: str, cache_salt: str) -> int:
        key = (lora_name, cache_salt)
        r = self._roots.get(key)
        if r is None:
            if len(self._roots) > 1024:
                self._roots.clear()
            ns = Namespace(lora_name or self.model, cache_salt, self.block_size, self.tokenizer)
            r = self._roots[key] = ns.root()
        return r

    def clear(self) -> Change:
        self.blocks.clear()
        return Change(EventKind.CLEARED)

    def apply(self, ev: EngineEvent) -> list[Change]:
        if isinstance(ev, Cleared):
            return [self.clear()]
        if isinstance(ev, Removed):
            return self.removed(ev)
        return self.stored(ev)

    def stored(self, ev: Stored) -> list[Change]:
        if (ev.medium is not None and ev.medium not in DEVICE_MEDIA) or (
            ev.spec_kind is not None and ev.spec_kind not in MAIN_ATTENTION
        ):
            return []
        n = len(ev.block_hashes)
        bs = ev.block_size
        if not n or bs <= 0 or len(ev.token_ids) != n * bs:
            self.unmapped += n  # no token ids (or not whole blocks): not nameable in our hashes
            return []
        root = self.root(ev.lora_name, ev.cache_salt)
        if ev.parent is None:
            state = _Mapped(0, root, b"", root)
        else:
            parent = self.blocks.get(ev.parent)
            if parent is None or parent.root != root:
                self.unmapped += n  # its prefix is unknown here: its gateway hashes cannot be had
                return []
            self.blocks.move_to_end(ev.parent)
            state = parent
        first_parent = state.last
        new: list[int] = []
        stride = 4 * self.block_size
        for i, handle in enumerate(ev.block_hashes):
            toks = b"".join(t.to_bytes(4, "little") for t in ev.token_ids[i * bs : (i + 1) * bs])
            buf = state.carry + toks
            full = len(buf) // stride
            done = tuple(block_hashes(buf, self.block_size, state.chain)) if full else ()
            last = done[-1] if done else state.last
            chain = done[-1] if done else state.chain
            state = _Mapped(last, chain, buf[full * stride :], root, done)
            new.extend(done)
            self.blocks[handle] = state
            self.blocks.move_to_end(handle)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        return [Change(EventKind.STORED, first_parent, tuple(new))] if new else []

    def removed(self, ev: Removed) -> list[Change]:
        if ev.medium is not None and ev.medium not in DEVICE_MEDIA:
            return []
        gone: list[int] = []
        for handle in ev.block_hashes:
            state = self.blocks.pop(handle, None)
            if state is not None:
                gone.extend(state.completed)
        return [Change(EventKind.REMOVED, 0, tuple(gone))] if gone else []


# -- the subscriber -------------------------------------------------------------------------------


class ZmqKVEvents:
    """Subscribes to one publisher; ``events()`` yields the gateway's KVEvents for its worker."""

    def __init__(
        self,
        source: ZmqSource,
        namespace: Namespace,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        rcvhwm: int = DEFAULT_RCVHWM,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        reconnect_max_s: float = 5.0,
    ) -> None:
        self.source = source
        self.namespace = namespace
        self.max_blocks = max_blocks
        self.rcvhwm = rcvhwm
        self.replay_timeout_s = replay_timeout_s
        self.reconnect_max_s = reconnect_max_s
        self.mapper = self._mapper()
        # What happened, for metrics and tests.
        self.gaps = 0
        self.replays = 0
        self.replays_failed = 0
        self.restarts = 0
        self.bad_payloads = 0
        self.batches = 0

    def _mapper(self) -> BlockMapper:
        ns = self.namespace
        return BlockMapper(ns.model, ns.block_size, ns.tokenizer, self.max_blocks)

    def _socket(self, ctx: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.reconnect_max_s * 1000))
        return sock

    async def _replay(self, ctx: zmq.asyncio.Context, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from ``start`` on, or None when the history from ``start`` is gone."""
        if not self.source.replay:
            return None
        self.replays += 1
        sock = self._socket(ctx, zmq.DEALER)
        try:
            sock.connect(self.source.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while len(out) < MAX_REPLAY_BATCHES:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    return None
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    return None
                seq = int.from_bytes(frames[-2], "big")
                if seq == END_SEQ:
                    break
                out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)
        if not out or out[0][0] != start:
            return None
        return out

    async def events(self) -> AsyncGenerator[KVEvent, None]:
        """An empty SNAPSHOT, then the worker's changes; runs until closed or cancelled."""
        instance = f"zmq-{uuid.uuid4().hex[:12]}"
        seq = 0
        self.mapper = self._mapper()
        ctx = zmq.asyncio.Context()
        sub = self._socket(ctx, zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())

        def out(change: Change) -> KVEvent:
            nonlocal seq
            seq += 1
            return KVEvent(seq, instance, change.kind, change.parent, change.hashes)

        try:
            sub.connect(self.source.endpoint)
            seq += 1
            yield KVEvent(seq, instance, EventKind.SNAPSHOT)
            expected: int | None = None  # the next seq (None: take the first one seen)
            replayed = range(0)
            history = await self._replay(ctx, 0)  # what the publisher already holds, if buffered
            for s, payload in history or ():
                for change in self._apply(payload):
                    yield out(change)
                expected = s + 1
            if history:
                replayed = range(history[0][0], history[-1][0] + 1)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) < 3:
                    self.bad_payloads += 1
                    continue
                s = int.from_bytes(frames[-2], "big")
                payload = frames[-1]
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
                    missed = await self._replay(ctx, expected)
                    if missed is None:
                        self.replays_failed += 1
                        log.info(
                            "kv_events_gap_unrecoverable",
                            endpoint=self.source.endpoint,
                            expected=expected,
                            got=s,
                        )
                        yield out(self.mapper.clear())
                    else:
                        for rs, rp in missed:
                            if rs >= s:
                                break
                            for change in self._apply(rp):
                                yield out(change)
                        replayed = range(expected, missed[-1][0] + 1)
                for change in self._apply(payload):
                    yield out(change)
                expected = s + 1
                if s + 1 >= replayed.stop:
                    replayed = range(0)  # live past the replay: no duplicate can follow
        finally:
            sub.close(linger=0)
            ctx.term()

    def _apply(self, payload: bytes) -> list[Change]:
        self.batches += 1
        try:
            events = decode_batch(payload)
        except BadPayload as e:
            self.bad_payloads += 1
            log.warning("kv_events_bad_payload", endpoint=self.source.endpoint, error=str(e)[:200])
            return []
        changes: list[Change] = []
        for ev in events:
            changes.extend(self.mapper.apply(ev))
        return changes


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
) -> Callable[[str], NodeClient]:
    """``connect`` wrapped so that workers named in ``entries`` get their events over ZMQ.

    ``namespace``'s model, block size and tokenizer are the gateway's (its tenant is ignored:
    each event brings its own cache salt)."""
    sources = parse_kv_events(entries)
    if not sources:
        return connect

    def wrapped(address: str) -> NodeClient:
        client = connect(address)
        source = sources.get(address)
        if source is None:
            return client
        return ZmqEventsClient(client, ZmqKVEvents(source, namespace))

    return wrapped
