"""The frames the gateway and a tokenizer child exchange over the child's stdin and stdout.

A frame is a kind (one byte), the payload's length (u32) and the payload: a count (u32), that
many lengths (u32 each) and the parts one after the other: UTF-8 texts and the packed
little-endian u32 ids of each, or a KV event batch's bytes and its columns. Both sides are
plain blocking or non-blocking file descriptors, so this module only builds and splits frames;
it does no I/O.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence

HEADER = struct.Struct("<BI")  # kind, payload bytes
COUNT = struct.Struct("<I")

READY = 1  # child -> gateway, once loaded: the sha256 (hex) of the tokenizer.json it loaded
ENCODE = 2  # gateway -> child: texts; answered by IDS (one part a text) or FAILED
IDS = 3
FAILED = 4  # the child could not do it: the reason, as text
KV_BATCH = 5  # gateway -> child: a KvEventBatch's bytes; answered by COLUMNS (``kvcolumns``) or FAILED
COLUMNS = 6
#: What a child answers to each kind it is sent.
ANSWERS = {ENCODE: IDS, KV_BATCH: COLUMNS}

#: The largest payload either side accepts: a body is at most a few MiB of text, which is at
#: most four times that in ids; anything larger is a broken stream, not a request.
MAX_PAYLOAD = 256 << 20
#: Kinds a child may send, and kinds the gateway may send.
FROM_CHILD = frozenset({READY, IDS, FAILED, COLUMNS})
TO_CHILD = frozenset(ANSWERS)

_LITTLE = sys.byteorder == "little"


class BadFrame(ValueError):
    """A frame that does not follow this format: the other side is not to be trusted again."""


def frame(kind: int, parts: Sequence[bytes]) -> bytes:
    """One frame of ``parts`` (joined once: a single write carries it)."""
    lengths = array.array("I", [len(p) for p in parts])
    if not _LITTLE:
        lengths.byteswap()
    head = COUNT.pack(len(parts)) + lengths.tobytes()
    size = len(head) + sum(len(p) for p in parts)
    if size > MAX_PAYLOAD:
        raise BadFrame(f"a payload of {size} bytes is over {MAX_PAYLOAD}")
    return b"".join((HEADER.pack(kind, size), head, *parts))


def header(raw: bytes, allowed: frozenset[int]) -> tuple[int, int]:
    """The kind and payload size of a frame's first ``HEADER.size`` bytes."""
    kind, size = HEADER.unpack(raw)
    if kind not in allowed or size > MAX_PAYLOAD or size < COUNT.size:
        raise BadFrame(f"frame kind {kind} of {size} bytes")
    return kind, size


def split(payload: bytes) -> list[bytes]:
    """The parts of a payload; ``BadFrame`` when the lengths do not add up to it."""
    view = memoryview(payload)
    (count,) = COUNT.unpack_from(view)
    start = COUNT.size + 4 * count
    if start > len(payload):
        raise BadFrame(f"{count} parts do not fit {len(payload)} bytes")
    lengths = array.array("I")
    lengths.frombytes(view[COUNT.size : start])
    if not _LITTLE:
        lengths.byteswap()
    if start + sum(lengths) != len(payload):
        raise BadFrame("part lengths do not add up to the payload")
    out: list[bytes] = []
    for n in lengths:
        out.append(bytes(view[start : start + n]))
        start += n
    return out
