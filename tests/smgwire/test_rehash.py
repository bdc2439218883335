"""Engine KV events re-hashed into the gateway's blocks (``smg_events.ChainRehasher``), for any
engine page size: a chain stored in any number of events names exactly the blocks a prompt of
the same tokens is hashed into, each engine block's removal names the gateway blocks its tokens
completed, and a partial page ends the chain."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2

from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient.smg_events import ChainRehasher
from prefixgate.gateway.vocab import EventKind

ROOT = 0x5EED


def event(blocks: list[tuple[int, list[int], int]], parent: int | None) -> common_pb2.KvCacheEvent:
    stored = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=h, token_ids=ids, block_size=size) for h, ids, size in blocks]
    )
    if parent is not None:
        stored.parent_block_hash = parent
    # through the wire, as the subscription reads it
    return common_pb2.KvCacheEvent.FromString(common_pb2.KvCacheEvent(stored=stored).SerializeToString())


@settings(max_examples=200, deadline=None)
@given(
    page=st.sampled_from([1, 3, 16, 64, 100]),
    block_size=st.sampled_from([4, 16, 64]),
    pages=st.integers(1, 30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    partial=st.integers(0, 2),
    seed=st.integers(0, 1 << 16),
)
def test_a_chain_in_any_events_names_the_blocks_its_tokens_hash_to(
    page: int, block_size: int, pages: int, cuts: list[int], partial: int, seed: int
) -> None:
    tokens = [(seed * 7919 + i * 104729) % 50_000 for i in range(pages * page)]
    handles = [1000 + i for i in range(pages)]
    blocks = [(handles[i], tokens[i * page : (i + 1) * page], page) for i in range(pages)]
    if partial and page > 1:  # a last page not yet full: not cached, the chain ends before it
        blocks.append((9_999, [7] * (page - 1), page))
    points = sorted({c % (len(blocks) + 1) for c in cuts} | {0, len(blocks)})
    rehash = ChainRehasher(block_size, lambda _lora, _salt: ROOT)
    named: list[int] = []
    for a, b in itertools.pairwise(points):
        parent = blocks[a - 1][0] if a else None
        changes = rehash.stored(event(blocks[a:b], parent).stored)
        for ch in changes:
            assert ch.kind == EventKind.STORED
            assert ch.parent == (named[-1] if named else 0)  # the chain goes on from its last block
            named += ch.hashes
    expected = block_hashes(pack_ids(tokens), block_size, ROOT)
    assert named == expected
    for i, h in enumerate(handles):  # each engine block names the gateway blocks it completed
        completed = expected[i * page // block_size : (i + 1) * page // block_size]
        gone = rehash.removed([h])
        assert [x for ch in gone for x in ch.hashes] == completed
    assert len(rehash) == 0


def test_a_block_after_an_unknown_parent_is_skipped() -> None:
    rehash = ChainRehasher(4, lambda _lora, _salt: ROOT)
    assert rehash.stored(event([(2, [1, 2, 3, 4], 4)], parent=1).stored) == []
    assert rehash.skipped == 1 and len(rehash) == 0


def test_removing_names_each_engine_blocks_completed_blocks_once() -> None:
    rehash = ChainRehasher(4, lambda _lora, _salt: ROOT)
    pages = [[i * 4 + j for j in range(4)] for i in range(6)]
    changes = rehash.stored(event([(100 + i, p, 4) for i, p in enumerate(pages)], parent=None).stored)
    (stored,) = changes
    gone = rehash.removed([105, 7, 101, 101, 103])  # unknown and repeated handles name nothing
    assert gone[0].hashes == (stored.hashes[5], stored.hashes[1], stored.hashes[3])
    assert rehash.removed([7]) == [] and len(rehash) == 3
