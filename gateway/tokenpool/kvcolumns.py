"""An SMG ``KvEventBatch`` as columns: each event's fields, its blocks' handles, sizes and token
ids packed into bytes.

A long prompt's stored event holds one ``KvBlock`` message a page (2,000 of them for 124K
tokens at 64 tokens a page), and walking them in Python is most of re-hashing it (about 8 ms of
interpreter-lock time in the gateway). In columns the same event is four byte strings, which
``smg_events.ChainRehasher`` walks with a C call or two and one loop over the handles. A large
batch is turned into columns by a tokenizer child (``child``, from the batch's bytes as they
came off the wire); a small one by the gateway itself (``of_batch``), so both go through one
re-hashing path.

Pure: no I/O; imports nothing of the gateway's (the child uses it).
"""

from __future__ import annotations

import array
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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
    (its ``block_size``, 0 when not given), u32; ``tokens`` every block's ids, u32."""

    tier: int
    locality: int
    spec_kind: str
    parent: int | None
    lora: str
    salt: str
    handles: bytes
    sizes: bytes
    declared: bytes
    tokens: bytes

    @property
    def blocks(self) -> int:
        return len(self.sizes) // 4


@dataclass(frozen=True, slots=True)
class Removed:
    tier: int
    handles: bytes  # int64


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
    if not _LITTLE:
        tokens.byteswap()
    return Stored(
        _opt(m, "tier", 0),
        _opt(m, "locality", 0),
        _opt(m, "kv_cache_spec_kind", ""),
        _opt(m, "parent_block_hash", None),
        _opt(m, "lora_name", ""),
        _opt(m, "cache_salt", ""),
        _packed("q", handles),
        _packed("I", sizes),
        _packed("I", declared),
        tokens.tobytes(),
    )


def of_events(events: Iterable[Any]) -> list[Event]:
    """``KvCacheEvent`` messages in columns (events of no known kind left out)."""
    out: list[Event] = []
    for ev in events:
        which = ev.WhichOneof("data")
        if which == "stored":
            out.append(of_stored(ev.stored))
        elif which == "removed":
            r = ev.removed
            out.append(Removed(_opt(r, "tier", 0), _packed("q", r.block_hashes)))
        elif which == "cleared":
            out.append(Cleared())
    return out


def of_batch(msg: Any) -> Batch:
    """A parsed ``KvEventBatch`` in columns."""
    rank = _opt(msg, "dp_rank", 0)
    return Batch(msg.sequence_number, rank, msg.HasField("snapshot"), of_events(msg.events))


def parse_batch(raw: bytes) -> Batch:
    """A ``KvEventBatch`` 's bytes in columns."""
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
            parts += (ev.handles, ev.sizes, ev.declared, ev.tokens)
        elif isinstance(ev, Removed):
            head.append(["R", ev.tier])
            parts.append(ev.handles)
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
                if 4 * sum(unpacked("I", sizes)) != len(tokens):
                    raise BadColumns("the blocks' sizes do not add up to their tokens")
                tier, locality, kind, parent, lora, salt = e[1:]
                columns = (handles, sizes, declared, tokens)
                events.append(Stored(tier, locality, kind, parent, lora, salt, *columns))
            elif e[0] == "R":
                events.append(Removed(e[1], parts[i]))
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
