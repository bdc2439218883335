"""The engines' ZMQ KV event wire, read strictly and within bounds: messages -> batches -> events.

Why: a publisher is another process, possibly another version, possibly broken. Everything it
sends is checked before the gateway acts on it, and nothing it sends can make the gateway hold
more than a bounded amount of memory or do an unbounded amount of work in one step.

A message is ``[topic, seq (8 bytes, big-endian), payload]`` (a replay answer: ``[b"", seq,
payload]``, or with a topic before ``seq``). A payload is a msgpack batch, an array ``[ts,
events, dp_rank?]`` (SGLang, older vLLM) or a map ``{ts, events, data_parallel_rank}`` (vLLM
main); each event is a msgspec-tagged array (``["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium, ...]``, array-like structs) or a map with ``"type"`` (SGLang 0.5+,
vLLM main).

Decoding is typed (msgspec structs with constraints, checked in C as the bytes are read): a batch
is decoded with its events left as raw msgpack (``msgspec.Raw``), each event is then decoded on
its own, so one bad event costs only itself and a batch is worked through event by event. The
bounds: the payload's size (``MAX_FRAME_BYTES``; libzmq's ``ZMQ_MAXMSGSIZE`` drops larger frames
before they are read), the events in a batch, the token ids and block hashes in an event, the
length of a hash, a name or a block size; token ids in [0, 2**32). msgspec bounds the nesting
depth itself (``RecursionError``), and a length prefix is checked against the limit before any
of it is read.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Annotated, Any, cast

import msgspec
from msgspec import Meta, Raw, Struct

from prefixgate.cachetier.tokenizer import pack_ids, unpack_ids

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
MAX_FRAME_BYTES = 2 << 20  # one payload: ~400,000 token ids, more than an engine step stores
MAX_PARTS = 4  # parts of one message kept (topic, seq, payload; a replay's empty first part)
MAX_EVENTS_PER_BATCH = 1 << 16
MAX_IDS_PER_EVENT = 1 << 18  # token ids, and block hashes, in one event
MAX_HANDLE_BYTES = 128  # an engine block hash given as bytes (SHA-256: 32)
MAX_NAME_CHARS = 1024  # a LoRA name, a cache salt, a medium...
MAX_BIGRAM = 8  # SGLang's EAGLE publishes [token, next] cells

KNOWN_KINDS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class BadMessage(ValueError):
    """A message that is not ``[topic, seq, payload]``: no batch can be read from it."""


class BadPayload(ValueError):
    """A payload that is not an engine KV event batch (its events are all lost)."""


class BadEvent(ValueError):
    """One event of a batch that cannot be read; ``kind`` is its tag when that was readable."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


# -- messages -------------------------------------------------------------------------------------


def split_message(parts: list[bytes], extra: int = 0, max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, bytes]:
    """(seq, payload) of one message; ``extra`` counts parts beyond ``MAX_PARTS`` not kept."""
    if extra or not 3 <= len(parts) <= MAX_PARTS:
        raise BadMessage(f"{len(parts) + extra} parts")
    seq, payload = parts[-2], parts[-1]
    if len(seq) != 8:
        raise BadMessage(f"a sequence number of {len(seq)} bytes")
    if len(payload) > max_bytes:
        raise BadMessage(f"a payload of {len(payload)} bytes (at most {max_bytes})")
    return int.from_bytes(seq, "big"), payload


# -- the typed wire -------------------------------------------------------------------------------

TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]
TokenCell = TokenId | Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_BIGRAM)]
TokenIds = Annotated[list[TokenCell], Meta(max_length=MAX_IDS_PER_EVENT)]
WireHandle = int | Annotated[bytes, Meta(max_length=MAX_HANDLE_BYTES)]
Handles = Annotated[list[WireHandle], Meta(max_length=MAX_IDS_PER_EVENT)]
BlockSize = Annotated[int, Meta(gt=0, le=MAX_IDS_PER_EVENT)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Events = Annotated[list[Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)]


class _ArrayBatch(Struct, array_like=True):
    ts: float
    events: Events
    data_parallel_rank: int | None = None


class _MapBatch(Struct):
    events: Events
    ts: float | None = None
    data_parallel_rank: int | None = None


# array_like field order after the tag (vLLM's BlockStored / BlockRemoved; SGLang's array-like
# releases publish the first five cells of the same order); later cells are ignored.
class _ArrayStored(Struct, array_like=True, tag="BlockStored"):
    block_hashes: Handles
    parent_block_hash: WireHandle | None
    token_ids: TokenIds | None
    block_size: BlockSize
    lora_id: Any = None
    medium: Name | None = None
    lora_name: Name | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: Name | None = None
    kv_cache_spec_sliding_window: Any = None
    locality: Name | None = None


class _ArrayRemoved(Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: Handles
    medium: Name | None = None
    group_idx: int | None = None


class _ArrayCleared(Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapStored(Struct, tag="BlockStored"):
    block_hashes: Handles
    block_size: BlockSize
    parent_block_hash: WireHandle | None = None
    token_ids: TokenIds | None = None
    medium: Name | None = None
    lora_name: Name | None = None
    cache_salt: Name | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: Name | None = None
    locality: Name | None = None


class _MapRemoved(Struct, tag="BlockRemoved"):
    block_hashes: Handles
    medium: Name | None = None
    group_idx: int | None = None


class _MapCleared(Struct, tag="AllBlocksCleared"):
    pass


class _ArrayTag(Struct, array_like=True):
    tag: str


class _MapTag(Struct):
    type: str


_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_array_event = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_map_event = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_array_tag = msgspec.msgpack.Decoder(_ArrayTag)
_map_tag = msgspec.msgpack.Decoder(_MapTag)
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError)  # ValidationError is a DecodeError


def _shape(data: bytes | memoryview | Raw) -> str:
    """``"array"``, ``"map"`` or ``""`` from a msgpack value's first byte."""
    view = memoryview(data)
    if not len(view):
        return ""
    b = view[0]
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    return ""


# -- batches and events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    tokens: bytes  # the token ids, packed little-endian uint32 (``cachetier.tokenizer``)
    block_size: int
    lora_name: str = ""
    cache_salt: str = ""
    medium: str | None = None
    group_idx: int | None = None
    spec_kind: str | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(unpack_ids(self.tokens))


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


EngineEvent = Stored | Removed | Cleared


def decode_envelope(payload: bytes | memoryview) -> list[Raw]:
    """A batch's events, each still raw msgpack, in order."""
    shape = _shape(payload)
    try:
        if shape == "array":
            return _array_batch.decode(payload).events
        if shape == "map":
            return _map_batch.decode(payload).events
    except _DECODE_ERRORS as e:
        raise BadPayload(f"not an event batch: {str(e)[:200]}") from None
    raise BadPayload("not an event batch: neither an array nor a map")


def _pack(cells: list[int | list[int]]) -> bytes:
    """Token ids (already range-checked) packed; SGLang's EAGLE bigrams hold their first id."""
    try:
        return pack_ids(cast(list[int], cells))
    except TypeError:  # some cells are [token, next]
        return pack_ids([c if isinstance(c, int) else c[0] for c in cells])


def decode_event(raw: bytes | Raw) -> EngineEvent | None:
    """One event (None: a kind the index does not use, or a remote copy)."""
    shape = _shape(raw)
    try:
        if shape == "array":
            ev: Any = _array_event.decode(raw)
        elif shape == "map":
            ev = _map_event.decode(raw)
        else:
            raise BadEvent("an event is neither a tagged array nor a tagged map")
    except _DECODE_ERRORS as e:
        kind = _kind(raw, shape)
        if kind and kind not in KNOWN_KINDS:
            return None  # an event kind added later: not ours to guess
        raise BadEvent(f"{kind or 'event'}: {str(e)[:200]}", kind) from None
    if isinstance(ev, _ArrayStored | _MapStored):
        if ev.locality is not None and ev.locality.upper() != "LOCAL":
            return None  # a remote copy: not this worker's to serve from
        return Stored(
            tuple(ev.block_hashes),
            ev.parent_block_hash,
            _pack(ev.token_ids or []),
            ev.block_size,
            lora_name=ev.lora_name or "",
            cache_salt=(ev.cache_salt if isinstance(ev, _MapStored) else None) or "",
            medium=ev.medium,
            group_idx=ev.group_idx,
            spec_kind=ev.kv_cache_spec_kind or None,
        )
    if isinstance(ev, _ArrayRemoved | _MapRemoved):
        return Removed(tuple(ev.block_hashes), ev.medium, ev.group_idx)
    return Cleared()


def _kind(raw: bytes | Raw, shape: str) -> str:
    """The tag of an event that did not decode ("" when not even that is readable)."""
    try:
        if shape == "array":
            return _array_tag.decode(raw).tag
        if shape == "map":
            return _map_tag.decode(raw).type
    except _DECODE_ERRORS:
        pass
    return ""


def decode_batch(payload: bytes) -> list[EngineEvent]:
    """A whole payload -> its events, in order; any bad event makes the batch bad."""
    out: list[EngineEvent] = []
    for raw in decode_envelope(payload):
        try:
            ev = decode_event(raw)
        except BadEvent as e:
            raise BadPayload(str(e)) from None
        if ev is not None:
            out.append(ev)
    return out
