"""Block hashing: chained, namespaced, full blocks only."""

from __future__ import annotations

import struct

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.cachetier.hashing import HASH_SEED, Namespace, block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer, pack_ids, unpack_ids

TOK = Bytes4Tokenizer()


def test_chain_formula_matches_the_definition() -> None:
    tokens = pack_ids(list(range(40)))
    root = Namespace("m", block_size=8).root()
    hs = block_hashes(tokens, 8, root)
    assert len(hs) == 5
    h = root
    for i in range(5):
        h = xxhash.xxh3_64_intdigest(struct.pack("<Q", h) + tokens[i * 32 : (i + 1) * 32], seed=HASH_SEED)
        assert hs[i] == h


def test_only_full_blocks_are_hashed() -> None:
    root = Namespace("m", block_size=4).root()
    assert block_hashes(pack_ids(list(range(7))), 4, root) == block_hashes(pack_ids(list(range(4))), 4, root)
    assert block_hashes(pack_ids([1, 2, 3]), 4, root) == []


def test_namespace_separates_models_tenants_and_block_sizes() -> None:
    roots = {
        Namespace("m").root(),
        Namespace("m2").root(),
        Namespace("m", tenant="a").root(),
        Namespace("m", block_size=32).root(),
        Namespace("m", tokenizer="hf:x").root(),
    }
    assert len(roots) == 5
    tokens = TOK.encode("x" * 1024)
    a = block_hashes(tokens, 64, Namespace("m", tenant="a").root())
    b = block_hashes(tokens, 64, Namespace("m", tenant="b").root())
    assert not set(a) & set(b)


@given(st.binary(min_size=0, max_size=600), st.binary(min_size=0, max_size=600))
def test_a_hash_names_the_whole_prefix(x: bytes, y: bytes) -> None:
    """Equal i-th hashes iff the first i+1 blocks are equal (no collisions expected)."""
    bs = 4
    tx, ty = TOK.encode(x.decode("latin-1")), TOK.encode(y.decode("latin-1"))
    root = Namespace("m", block_size=bs).root()
    hx, hy = block_hashes(tx, bs, root), block_hashes(ty, bs, root)
    for i in range(min(len(hx), len(hy))):
        same_prefix = tx[: (i + 1) * bs * 4] == ty[: (i + 1) * bs * 4]
        assert (hx[i] == hy[i]) == same_prefix


def test_bytes4_tokenizer_round_trips_and_counts() -> None:
    text = "héllo wörld, 你好"
    tokens = TOK.encode(text)
    assert len(tokens) % 4 == 0
    assert len(tokens) // 4 == -(-len(text.encode()) // 4)
    assert TOK.decode(tokens) == text
    assert unpack_ids(pack_ids([1, 2**32 - 1])) == [1, 2**32 - 1]
