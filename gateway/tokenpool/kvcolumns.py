"""An SMG ``KvEventBatch`` as columns: each event's fields, its blocks' handles, sizes and
declared sizes as lists, their token ids packed into bytes.

A long prompt's stored event holds one ``KvBlock`` message a page (2,000 of them for 124K
tokens at 64 tokens a page; 2,048 for a 2K-token prompt in SGLang's default one-token pages),
and walking them in Python is most of re-hashing it. ``parse_batch`` reads a batch through wire
messages that keep each block as bytes (``proto/prefixgate/v1/smg_kv.proto``): the blocks'
bytes joined parse as one message whose repeated fields hold every block's hash, size and
packed ids, in a few C calls. ``smg_events.ChainRehasher`` walks the columns with one loop over
the handles. A large batch is turned into columns by a tokenizer child (``child``, from the
batch's bytes as they came off the wire; packed into a frame, ``to_parts``); a small one by the
gateway itself, so both go through one re-hashing path.

Pure: no I/O; imports nothing of the gateway's (the child uses it).
"""

from __future__ import annotations

import array
import json
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from prefixgate.gateway.records import record

_LITTLE = sys.byteorder == "little"


def _packed(code: str, values: Iterable[int]) -> bytes:
    a = array.array(code, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpacked(code: str, raw: bytes) -> list[int]:
    """``raw`` as ``array`` typecode ``code`` values ('q': the engine's int64 block handles,
    'I': u32 sizes and token ids), little-endian."""
    a = array.array(code)
    a.frombytes(raw)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


@record
class Stored:
    """A ``KvBlocksStored``: ``parent`` the engine handle it continues (None: a chain from the
    root); per block, in order: ``handles`` (int64), ``sizes`` (ids it holds) and ``declared``
    (its ``block_size``, 0 when not given); ``tokens`` every block's ids, packed u32. The
    per-block columns are lists, packed only into a frame (``to_parts``): the gateway walks them
    as lists, and packing them only to unpack them again cost a tenth of a one-token-page batch."""

    tier: int
    locality: int
    spec_kind: str
    parent: int | None
    lora: str
    salt: str
    handles: list[int]
    sizes: list[int]
    declared: list[int]
    tokens: bytes

    @property
    def blocks(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True, slots=True)
class Removed:
    tier: int
    handles: list[int]  # int64


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@record
class Batch:
    """A batch's sequence number and data-parallel rank (0 when absent), whether it carries a
    snapshot, and its events in columns."""

    sequence: int
    rank: int
    snapshot: bool
    events: list[Event]

    @property
    def load_only(self) -> bool:
        """A load record: no events, no snapshot (the cursor stays)."""
        return not self.events and not self.snapshot


def _opt(msg: Any, name: str, default: Any) -> Any:
    return getattr(msg, name) if msg.HasField(name) else default


def _stored(
    m: Any, handles: list[int], sizes: list[int], declared: list[int], tokens: array.array[int]
) -> Stored:
    """The columns with the event's own fields (``m``: a ``KvBlocksStored`` or a ``KvStoredWire``,
    which name them alike)."""
    if not _LITTLE:
        tokens.byteswap()
    return Stored(
        _opt(m, "tier", 0),
        _opt(m, "locality", 0),
        _opt(m, "kv_cache_spec_kind", ""),
        _opt(m, "parent_block_hash", None),
        _opt(m, "lora_name", ""),
        _opt(m, "cache_salt", ""),
        handles,
        sizes,
        declared,
        tokens.tobytes(),
    )


def of_stored(m: Any) -> Stored:
    handles: list[int] = []
    sizes: list[int] = []
    declared: list[int] = []
    tokens = array.array("I")
    for b in m.blocks:
        # a slice is a list made in C; ``extend`` took the ids one by one through the
        # container's iterator, at twice the cost
        ids = b.token_ids[:]
        handles.append(b.block_hash)
        sizes.append(len(ids))
        declared.append(b.block_size)
        tokens.fromlist(ids)
    return _stored(m, handles, sizes, declared, tokens)


def of_events(events: Iterable[Any]) -> list[Event]:
    """``KvCacheEvent`` messages in columns (events of no known kind left out)."""
    out: list[Event] = []
    for ev in events:
        which = ev.WhichOneof("data")
        if which == "stored":
            out.append(of_stored(ev.stored))
        elif which == "removed":
            r = ev.removed
            out.append(Removed(_opt(r, "tier", 0), r.block_hashes[:]))
        elif which == "cleared":
            out.append(Cleared())
    return out


def of_batch(msg: Any) -> Batch:
    """A parsed ``KvEventBatch`` in columns."""
    rank = _opt(msg, "dp_rank", 0)
    return Batch(msg.sequence_number, rank, msg.HasField("snapshot"), of_events(msg.events))


class _Irregular(Exception):
    """Blocks the wire messages cannot read as the engine's own messages would."""


_CONTINUED = bytes(range(0x80, 0x100))  # a varint's bytes but its last
# Read through the wire messages when the blocks average at most this many bytes of the batch
# (a one-token block is about 17, a 16-token one about 55): below, a message a block is most of
# the cost; above, the ids' own conversion is, and the engine's messages do it in fewer steps
# (124K tokens in 64-token pages: 5 ms against 10).
SMALL_BLOCK_BYTES = 40
FEW_BLOCKS = 64  # above: numpy counts the blocks' ids (its fixed cost is less than a call a block)


def _sizes(packed: list[bytes], joined: bytes, ids: int) -> list[int]:
    """The ids in each block's packed ``token_ids`` (``joined``: them all, ``ids`` varints in
    all). Each entry must end where a varint ends, or the blocks are read as messages."""
    try:
        last = bytes(map(operator.itemgetter(-1), packed))
    except IndexError:  # an entry of no bytes: not what an encoder writes
        raise _Irregular from None
    if last and max(last) >= 0x80:
        raise _Irregular
    if ids == len(packed):  # each entry holds at least one id: exactly one each (one-token pages)
        return [1] * ids
    if len(packed) <= FEW_BLOCKS:  # the bytes that end a varint, per entry: a C call a block
        return [len(p.translate(None, _CONTINUED)) for p in packed]
    import numpy as np  # with the first batch of longer blocks: counted in a few array operations

    ends = np.cumsum(np.fromiter(map(len, packed), dtype=np.int64, count=len(packed)))
    ended = np.cumsum(np.frombuffer(joined, dtype=np.uint8) < 0x80)  # varints ended by each byte
    sizes: list[int] = np.diff(ended[ends - 1], prepend=0).tolist()
    return sizes


def _stored_wire(m: Any, pb: Any) -> Stored:
    """A ``KvStoredWire``: its blocks' bytes joined are read as one ``KvBlockColumns``, their
    token ids as one ``KvIds``: C calls over all the blocks instead of a message object each
    (``pb``: the wire messages' module)."""
    blocks = m.blocks
    n = len(blocks)
    cols = pb.KvBlockColumns.FromString(b"".join(blocks))
    handles, declared, packed = cols.block_hash[:], cols.block_size[:], cols.token_ids[:]
    if not declared:  # no block says its size
        declared = [0] * n
    if len(handles) != n or len(declared) != n or len(packed) != n:
        raise _Irregular  # a block left a field out (0, or no ids) or gave one twice
    joined = b"".join(packed)
    tokens = array.array("I", pb.KvIds.FromString(pb.KvPackedIds(ids=joined).SerializeToString()).ids[:])
    sizes = _sizes(packed, joined, len(tokens))
    return _stored(m, handles, sizes, declared, tokens)


def _of_wire(msg: Any) -> Batch:
    from prefixgate.v1 import smg_kv_pb2

    out: list[Event] = []
    for ev in msg.events:
        which = ev.WhichOneof("data")
        if which == "stored":
            out.append(_stored_wire(ev.stored, smg_kv_pb2))
        elif which == "removed":
            r = ev.removed
            out.append(Removed(_opt(r, "tier", 0), r.block_hashes[:]))
        elif which == "cleared":
            out.append(Cleared())
    return Batch(msg.sequence_number, _opt(msg, "dp_rank", 0), msg.HasField("snapshot"), out)


def parse_batch(raw: bytes) -> Batch:
    """A ``KvEventBatch`` 's bytes in columns. Small blocks (``SMALL_BLOCK_BYTES``) are read
    through the wire messages of ``proto/prefixgate/v1/smg_kv.proto`` (each stored block left as
    bytes: a 2K-token prompt stored in one-token pages reads in about a third of the time); larger
    ones, blocks those cannot read exactly as the engine's own messages would (a field left out or
    given twice), and bytes they cannot parse, through the engine's messages, which give the same
    columns or the error."""
    from prefixgate.v1 import smg_kv_pb2

    try:
        wire = smg_kv_pb2.KvBatchWire.FromString(raw)
        blocks = sum(len(ev.stored.blocks) for ev in wire.events if ev.HasField("stored"))
        if len(raw) <= SMALL_BLOCK_BYTES * blocks or not blocks:
            return _of_wire(wire)
    except (_Irregular, DecodeError):
        pass
    # larger pages: a message a block costs little a token, less than counting their ids here
    from smg_grpc_proto.generated import common_pb2

    return of_batch(common_pb2.KvEventBatch.FromString(raw))


def to_parts(batch: Batch) -> list[bytes]:
    """A batch as frame parts: a JSON head (the batch's fields, one entry an event), then each
    event's byte columns in order."""
    head: list[Any] = [batch.sequence, batch.rank, batch.snapshot]
    parts: list[bytes] = []
    for ev in batch.events:
        if isinstance(ev, Stored):
            head.append(["S", ev.tier, ev.locality, ev.spec_kind, ev.parent, ev.lora, ev.salt])
            parts += (_packed("q", ev.handles), _packed("I", ev.sizes), _packed("I", ev.declared), ev.tokens)
        elif isinstance(ev, Removed):
            head.append(["R", ev.tier])
            parts.append(_packed("q", ev.handles))
        else:
            head.append(["C"])
    return [json.dumps(head).encode(), *parts]


class BadColumns(ValueError):
    """Parts that are not a batch's columns."""


def from_parts(parts: list[bytes]) -> Batch:
    """``to_parts`` undone; ``BadColumns`` when the parts do not fit."""
    try:
        head = json.loads(parts[0])
        sequence, rank, snapshot, *entries = head
        events: list[Event] = []
        i = 1
        for e in entries:
            if e[0] == "S":
                handles, sizes, declared, tokens = parts[i : i + 4]
                i += 4
                n = len(sizes)
                if len(handles) != 2 * n or len(declared) != n or n % 4:
                    raise BadColumns("column lengths do not agree")
                counts = unpacked("I", sizes)
                if 4 * sum(counts) != len(tokens):
                    raise BadColumns("the blocks' sizes do not add up to their tokens")
                tier, locality, kind, parent, lora, salt = e[1:]
                columns = (unpacked("q", handles), counts, unpacked("I", declared), tokens)
                events.append(Stored(tier, locality, kind, parent, lora, salt, *columns))
            elif e[0] == "R":
                events.append(Removed(e[1], unpacked("q", parts[i])))
                i += 1
            else:
                events.append(Cleared())
    except BadColumns:
        raise
    except (ValueError, TypeError, IndexError) as e:
        raise BadColumns(repr(e)) from None
    if i != len(parts):
        raise BadColumns(f"{len(parts) - i} parts left over")
    return Batch(int(sequence), int(rank), bool(snapshot), events)
