"""KV event batches in columns (``gateway.tokenpool.kvcolumns``): a tokenizer child reads a
batch's bytes into the columns the gateway reads itself, the columns survive the frame, parts
that do not fit are refused, and a long prompt's batch read by a child names the same blocks
through a real subscription (the gateway's process never parses it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2

from prefixgate.gateway.nodeclient.smg_common import REHASH_OFF_LOOP_BYTES, SmgNodeClient, SmgOptions
from prefixgate.gateway.tokenpool import kvcolumns
from prefixgate.gateway.tokenpool.pool import TokenizerPool
from prefixgate.gateway.vocab import EventKind
from tests.smgwire import doubles
from tests.smgwire.conftest import BS, HF, root_of
from tests.smgwire.test_events_and_vllm import gw, take
from tests.tokenpools import started_pool

HANDLE = st.integers(-(2**63), 2**63 - 1)  # the engine's int64 block hashes


@st.composite
def events(draw: Any) -> common_pb2.KvCacheEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())
    if kind == "removed":
        removed = common_pb2.KvBlocksRemoved(block_hashes=draw(st.lists(HANDLE, max_size=5)))
        if draw(st.booleans()):
            removed.tier = draw(st.sampled_from([1, 2]))
        return common_pb2.KvCacheEvent(removed=removed)
    blocks = [
        common_pb2.KvBlock(
            block_hash=draw(HANDLE),
            token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)),
            block_size=draw(st.sampled_from([0, 4, 16])),
        )
        for _ in range(draw(st.integers(0, 6)))
    ]
    stored = common_pb2.KvBlocksStored(blocks=blocks)
    optional = ["parent_block_hash", "tier", "locality", "kv_cache_spec_kind", "lora_name", "cache_salt"]
    for name in draw(st.sets(st.sampled_from(optional))):
        setattr(stored, name, {"parent_block_hash": 7, "tier": 2, "locality": 1}.get(name, "x"))
    return common_pb2.KvCacheEvent(stored=stored)


@st.composite
def pages(draw: Any) -> common_pb2.KvCacheEvent:
    """A prompt stored in pages of one size (SGLang's default is one token), as many as a long
    prompt has (more than ``FEW_BLOCKS``), the last perhaps partial, a field perhaps left out."""
    page = draw(st.sampled_from([1, 1, 2, 3, 16]))
    count = draw(st.integers(1, 2 * kvcolumns.FEW_BLOCKS + 8))
    ids = st.integers(0, 2**32 - 1)
    blocks = [
        common_pb2.KvBlock(
            block_hash=draw(HANDLE),
            token_ids=draw(st.lists(ids, min_size=page, max_size=page)),
            block_size=page,
        )
        for _ in range(count)
    ]
    if draw(st.booleans()):
        del blocks[-1].token_ids[draw(st.integers(0, page - 1)) :]  # a partial last page
    if draw(st.integers(0, 5)) == 0:
        blocks[draw(st.integers(0, count - 1))].block_hash = 0  # proto3 leaves a 0 out
    return common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(blocks=blocks, parent_block_hash=3))


@st.composite
def batches(draw: Any) -> bytes:
    b = common_pb2.KvEventBatch(
        sequence_number=draw(st.integers(0, 10**6)),
        events=draw(st.lists(st.one_of(events(), pages()), max_size=4)),
    )
    if draw(st.booleans()):
        b.dp_rank = draw(st.integers(0, 7))
    if draw(st.booleans()):
        b.snapshot.CopyFrom(common_pb2.KvSnapshotChunk())
    raw: bytes = b.SerializeToString()
    return raw


@pytest.fixture(scope="module")
def pool() -> Iterator[TokenizerPool]:
    with started_pool(1) as p:
        yield p


@settings(max_examples=80, deadline=None)
@given(batches())
def test_a_child_reads_a_batch_into_the_columns_the_gateway_reads(pool: TokenizerPool, raw: bytes) -> None:
    here = kvcolumns.parse_batch(raw)
    assert kvcolumns.from_parts(kvcolumns.to_parts(here)) == here
    assert pool.kv_batch(raw) == here


@settings(max_examples=150, deadline=None)
@given(batches())
def test_a_batch_read_through_the_wire_messages_is_what_the_engines_messages_give(raw: bytes) -> None:
    assert kvcolumns.parse_batch(raw) == kvcolumns.of_batch(common_pb2.KvEventBatch.FromString(raw))


@pytest.mark.parametrize("page", [1, 3])
def test_whole_pages_are_read_without_a_message_a_block(page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    count = 3 * kvcolumns.FEW_BLOCKS  # past the few blocks counted one by one
    blocks = [
        common_pb2.KvBlock(block_hash=i + 1, token_ids=range(i * page, (i + 1) * page), block_size=page)
        for i in range(count)
    ]
    stored = common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(blocks=blocks))
    raw = common_pb2.KvEventBatch(sequence_number=1, events=[stored]).SerializeToString()
    expected = kvcolumns.of_batch(common_pb2.KvEventBatch.FromString(raw))

    def per_block(m: Any) -> kvcolumns.Stored:
        raise AssertionError("read a message a block")

    monkeypatch.setattr(kvcolumns, "of_stored", per_block)
    got = kvcolumns.parse_batch(raw)
    assert got == expected
    (ev,) = got.events
    assert isinstance(ev, kvcolumns.Stored) and ev.sizes == [page] * count and ev.handles[-1] == count


def test_bytes_that_are_no_batch_fail_as_the_engines_messages_do() -> None:
    for raw in (b"\xff\xff\xff", b"\x1a\x05\x12\x03\x0a\x01"):  # no field; a block cut short
        with pytest.raises(DecodeError):
            common_pb2.KvEventBatch.FromString(raw)
        with pytest.raises(DecodeError):
            kvcolumns.parse_batch(raw)


def test_parts_that_do_not_fit_are_refused() -> None:
    stored = kvcolumns.Stored(0, 0, "", None, "", "", [0, 0], [1, 1], [0, 0], b"\0" * 8)
    parts = kvcolumns.to_parts(kvcolumns.Batch(1, 0, False, [stored]))
    assert kvcolumns.from_parts(parts).events == [stored]
    for bad in (parts[:-1], [*parts, b""], [parts[0], parts[1][:8], *parts[2:]], [b"{", *parts[1:]]):
        with pytest.raises(kvcolumns.BadColumns):
            kvcolumns.from_parts(bad)
    wrong_sizes = [parts[0], parts[1], b"\2\0\0\0" * 2, *parts[3:]]
    with pytest.raises(kvcolumns.BadColumns):
        kvcolumns.from_parts(wrong_sizes)


async def test_a_long_prompts_batch_is_read_by_a_child_and_named_alike(pool: TokenizerPool) -> None:
    pages, big, last = doubles.long_prompt_batches()
    assert big.ByteSize() >= REHASH_OFF_LOOP_BYTES
    server, addr = await doubles.serve(doubles.add_sglang(doubles.ScriptedSglang(lambda n: [big, last])))
    options = SmgOptions(block_size=BS, root_of=root_of, codec=HF, kv_batch_far=pool.kv_batch)
    c = SmgNodeClient(f"grpc://{addr}", addr, options)
    calls = pool.stats.calls
    try:
        got = await take(c, 1 + len(pages))
    finally:
        await c.close()
        await server.stop(0)
    assert got[0].kind is EventKind.SNAPSHOT
    named = [h for e in got[1:] for h in e.hashes]
    assert named == gw(pages)
    assert got[-1].parent == named[-2] and got[-1].hashes == (named[-1],)
    assert pool.stats.calls == calls + 1  # the long batch, not the short one
