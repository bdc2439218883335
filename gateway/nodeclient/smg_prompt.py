"""A Generate request's prompt ids on the SMG wire, made from the packed ids the gateway keeps.

Both runtimes carry the prompt as ``GenerateRequest.tokenized`` (a ``TokenizedInput``) whose
``input_ids`` is a packed repeated ``uint32``: varints one after the other. Building it the
protobuf way means unpacking a 124K-token prompt into a Python list, copying the list into the
message, copying that into the request and serializing it: about 9 ms of interpreter-lock time a
long prompt in the gateway, much of it in single C calls the event loop cannot interrupt. Here
the request is kept in two parts (``EngineRequest``): the message without its ids (small, built
and serialized as before), and the ``tokenized`` field already serialized, its varints made from
the packed ids by ``numpy`` (about 3 ms for 124K tokens, in array operations that let the other
threads run). Below ``NUMPY_FROM_IDS`` ids numpy's fixed cost per array operation is more than
protobuf's whole encoding (about 30 µs against 21 µs for 500 ids, 22 against 3 for 50): those
varints are protobuf's own, made by serializing a ``TokenizedInput`` of the ids. A protobuf
parser reads fields in any order and a field of a message that comes once is that field, so the
two parts joined are the request the engine would get otherwise (the tests compare both parses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2, vllm_engine_pb2

from prefixgate.cachetier.tokenizer import unpack_ids

_LEN = 2  # the length-delimited wire type


def _field_number(message: Any, name: str) -> int:
    numbers = {m.DESCRIPTOR.fields_by_name[name].number for m in message}
    assert len(numbers) == 1, f"{name}: the runtimes number it differently"
    return int(numbers.pop())


_RUNTIMES = (sglang_scheduler_pb2, vllm_engine_pb2)
TOKENIZED = _field_number([pb.GenerateRequest for pb in _RUNTIMES], "tokenized")
INPUT_IDS = _field_number([pb.TokenizedInput for pb in _RUNTIMES], "input_ids")
#: ids from which numpy makes the varints faster than protobuf does (measured: 500 ids 29 µs
#: against 21, 2,000 ids 55 against 79)
NUMPY_FROM_IDS = 1_024


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varints(packed: bytes) -> bytes:
    """The varints of packed little-endian u32 ids, as a packed ``uint32`` field holds them."""
    import numpy as np  # with the first prompt: a tenth of a gateway's start, for grpc:// workers only

    a = np.frombuffer(packed, dtype="<u4")
    if not a.size:
        return b""
    size = np.ones(a.size, dtype=np.uint8)  # bytes each id takes: 1 + one a 7 bits past the first 7
    for bits in (7, 14, 21, 28):
        size += a >= 1 << bits
    width = int(size.max())
    out = np.empty((a.size, width), dtype=np.uint8)
    for k in range(width):
        byte = (a >> 7 * k) & 0x7F
        if k + 1 < width:
            byte |= (size > k + 1).astype(np.uint32) << 7  # more bytes follow
        out[:, k] = byte
    if width == 1:
        return out.tobytes()
    return out[np.arange(width, dtype=np.uint8) < size[:, None]].tobytes()


def tokenized_field(packed: bytes) -> bytes:
    """``GenerateRequest.tokenized`` serialized: a ``TokenizedInput`` of the ids alone."""
    if len(packed) < 4 * NUMPY_FROM_IDS:
        inner: bytes = sglang_scheduler_pb2.TokenizedInput(input_ids=unpack_ids(packed)).SerializeToString()
    else:
        ids = varints(packed)
        inner = varint(INPUT_IDS << 3 | _LEN) + varint(len(ids)) + ids if ids else b""
    return varint(TOKENIZED << 3 | _LEN) + varint(len(inner)) + inner


@dataclass(slots=True)
class EngineRequest:
    """A Generate request: ``message`` without its prompt ids (the runtime's, still changed by
    split serving: bootstrap, transfer parameters) and ``tokenized``, its ids' field serialized
    (see the module docstring)."""

    message: Any
    tokenized: bytes

    def serialize(self) -> bytes:
        """The request as sent: a copy of the ids' bytes, not their encoding."""
        head: bytes = self.message.SerializeToString()
        return head + self.tokenized
