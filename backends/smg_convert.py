"""Between the SMG engine protocol (``smg-grpc-proto``: SGLang scheduler + common messages) and
the node's own types. Pure apart from reading the shipped tokenizer.

Token ids on that wire are the shipped tokenizer's (``backends.hftok``). The tiny engine's
output ids already are; the simulated engine's 256 words map one to one onto single tokens of
it (``TokenMap``). Prompts are any uint32 ids, packed little-endian for the node core.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import xxhash
from smg_grpc_proto.generated import common_pb2

from prefixgate.backends.engine import MAX_TOKENS_LIMIT, Constraint, Engine, Sampling
from prefixgate.backends.errors import InvalidArgument
from prefixgate.backends.events import EventKind, KVEventRecord
from prefixgate.backends.hftok import ShippedTokenizer
from prefixgate.backends.node import NodeSnapshot

MAX_N = 16
_U64 = 1 << 64
_I63 = 1 << 63


@dataclass(frozen=True, slots=True)
class TokenMap:
    """Engine output ids <-> wire (tokenizer) ids; identity where the engine speaks the tokenizer."""

    to_wire: dict[int, int]
    from_wire: dict[int, int]
    eos_engine: int
    eos_wire: int

    def wire(self, engine_id: int) -> int:
        return self.to_wire.get(engine_id, engine_id)

    def engine(self, wire_id: int) -> int:
        return self.from_wire.get(wire_id, wire_id)


def token_map(engine: Engine, tokenizer: ShippedTokenizer) -> TokenMap:
    if engine.name == "sim":
        from prefixgate.backends.sim import textgen

        to_wire: dict[int, int] = {}
        for engine_id, text in textgen.TEXT_OF.items():
            wire_id = tokenizer.id_of(text)
            if wire_id is None:
                raise ValueError(f"simulated word {text!r} is not one token of {tokenizer.path}")
            to_wire[engine_id] = wire_id
        to_wire[engine.eos_token] = tokenizer.eos_token_id
        return TokenMap(to_wire, {w: e for e, w in to_wire.items()}, engine.eos_token, tokenizer.eos_token_id)
    return TokenMap({}, {}, engine.eos_token, engine.eos_token)


def sampling_from_sglang(p: object) -> Sampling:
    """SGLang ``SamplingParams`` -> ``Sampling``; what the node cannot honour is refused, not dropped.

    String ``stop`` is refused as an SGLang engine started with ``skip_tokenizer_init`` does:
    the gateway owns text (stop strings are matched there; single-token ones arrive as
    ``stop_token_ids``). A constraint is taken as sent (``constraint_of``); whether the engine
    can follow it is the service's to say.
    """
    if list(p.stop):  # type: ignore[attr-defined]
        raise InvalidArgument("stop strings are not accepted: send stop_token_ids (the client owns text)")
    n = p.n or 1  # type: ignore[attr-defined]
    if n > MAX_N:
        raise InvalidArgument(f"n must be at most {MAX_N}, got {n}")
    max_new = p.max_new_tokens if p.HasField("max_new_tokens") else 0  # type: ignore[attr-defined]
    if max_new > MAX_TOKENS_LIMIT:
        raise InvalidArgument(f"max_new_tokens must be at most {MAX_TOKENS_LIMIT}, got {max_new}")
    temperature = float(p.temperature)  # type: ignore[attr-defined]
    sampling = Sampling.normalized(max_new, temperature, float(p.top_p), None, ())  # type: ignore[attr-defined]
    return replace(sampling, constraint=constraint_of(p))


SGLANG_CONSTRAINTS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "ebnf",
    "structural_tag": "structural_tag",
}


def constraint_of(p: object) -> Constraint | None:
    """SGLang ``SamplingParams.constraint`` (one of json_schema, regex, ebnf_grammar,
    structural_tag) as a ``Constraint``; None when unset."""
    which = p.WhichOneof("constraint")  # type: ignore[attr-defined]
    if not which:
        return None
    kind = SGLANG_CONSTRAINTS.get(which)
    if kind is None:
        raise InvalidArgument(f"constraint {which!r} is not supported")
    return Constraint(kind, str(getattr(p, which)))


def signed64(h: int) -> int:
    """A u64 block hash as the wire's int64."""
    return h - _U64 if h >= _I63 else h


def event_batch_events(
    rec: KVEventRecord, tokens_of: dict[int, bytes], block_size: int
) -> list[common_pb2.KvCacheEvent]:
    """One pool change as SMG KV events; blocks whose tokens this protocol never saw (stored
    over the native protocol, in another hash namespace) are left out."""
    if rec.kind == EventKind.STORED:
        blocks = []
        for h in rec.block_hashes:
            tokens = tokens_of.get(h)
            if tokens is None:
                break  # a chain: nothing after an unknown block can be placed
            ids = _unpack(tokens)
            blocks.append(common_pb2.KvBlock(block_hash=signed64(h), token_ids=ids, block_size=block_size))
        if not blocks:
            return []
        stored = common_pb2.KvBlocksStored(blocks=blocks)
        if rec.parent_hash and rec.parent_hash in tokens_of:
            stored.parent_block_hash = signed64(rec.parent_hash)
        return [common_pb2.KvCacheEvent(event_id=rec.seq, stored=stored)]
    if rec.kind == EventKind.REMOVED:
        gone = [signed64(h) for h in rec.block_hashes if h in tokens_of]
        if not gone:
            return []
        return [
            common_pb2.KvCacheEvent(event_id=rec.seq, removed=common_pb2.KvBlocksRemoved(block_hashes=gone))
        ]
    if rec.kind == EventKind.CLEARED:
        return [common_pb2.KvCacheEvent(event_id=rec.seq, cleared=common_pb2.KvCacheCleared())]
    return []


_LITTLE = sys.byteorder == "little"
_LE64 = struct.Struct("<Q")
HASH_SEED = 0x736D67  # "smg": this protocol's block chain, apart from the gateway's namespaces


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as the node core's packed little-endian u32."""
    arr = array.array("I", ids)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def held_blocks_events(
    pairs: Sequence[tuple[int, int]], tokens_of: dict[int, bytes], block_size: int
) -> list[common_pb2.KvCacheEvent]:
    """What the pool holds now (``(hash, parent)`` pairs, parents first) as stored events, one
    block each, for a subscriber that starts with nothing; blocks of other namespaces left out."""
    out = []
    for h, parent in pairs:
        tokens = tokens_of.get(h)
        if tokens is None:
            continue
        block = common_pb2.KvBlock(block_hash=signed64(h), token_ids=_unpack(tokens), block_size=block_size)
        stored = common_pb2.KvBlocksStored(blocks=[block])
        if parent and parent in tokens_of:
            stored.parent_block_hash = signed64(parent)
        out.append(common_pb2.KvCacheEvent(event_id=0, stored=stored))
    return out


def _unpack(tokens: bytes) -> list[int]:
    arr = array.array("I")
    arr.frombytes(tokens)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def chain_root(model: str, block_size: int, tokenizer: str) -> int:
    return xxhash.xxh3_64_intdigest(f"smg\0{model}\0{block_size}\0{tokenizer}".encode(), seed=HASH_SEED)


def chain_hashes(tokens: bytes, block_size: int, root: int) -> list[int]:
    """The pool keys of a prompt's full blocks: ``h_i = xxh3_64(LE64(h_{i-1}) || block)``, so a
    key names the whole prefix up to its block (never 0: the pool reserves it)."""
    stride = 4 * block_size
    out: list[int] = []
    h = root
    view = memoryview(tokens)
    for i in range(len(tokens) // stride):
        h = xxhash.xxh3_64_intdigest(_LE64.pack(h) + view[i * stride : (i + 1) * stride], seed=HASH_SEED) or 1
        out.append(h)
    return out


def engine_load(s: NodeSnapshot, block_size: int, max_running: int, sample: int, load_only: bool) -> object:
    used = s.in_use_blocks / s.capacity_blocks if s.capacity_blocks else 0.0  # SGLang's: evictable is free
    return common_pb2.EngineLoad(
        running_requests=s.running_requests,
        waiting_requests=s.queued_requests,
        waiting_uncached_tokens=s.queued_tokens,
        token_usage=used,
        gen_throughput=0.0,
        max_running_requests=max_running,
        sample=sample,
        load_only=load_only,
        cache_hit_rate=s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        num_used_tokens=s.in_use_blocks * block_size,
        max_total_num_tokens=s.capacity_blocks * block_size,
    )


def chunked(data: bytes, size: int) -> Iterable[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def first_stop(ids: Sequence[int], stop_ids: frozenset[int]) -> int:
    """Index of the first stop token id in ``ids`` (-1: none)."""
    if stop_ids:
        for i, t in enumerate(ids):
            if t in stop_ids:
                return i
    return -1
