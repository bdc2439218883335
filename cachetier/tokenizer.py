"""Tokenizers: text -> packed little-endian uint32 token ids.

Tokens travel and are hashed as packed LE uint32 (``bytes``, four bytes a token): hashing a
block is then hashing a slice, with no per-token Python work. The gateway and every node use
the same tokenizer, so counts and block boundaries agree everywhere.

``Bytes4Tokenizer`` (the default) makes one token of every four UTF-8 bytes: about the
density of a BPE tokenizer on English text, zero vocabulary, and a 128K-token prompt tokenizes
in microseconds. ``HFTokenizer`` loads a Hugging Face ``tokenizer.json`` from a local path.
"""

from __future__ import annotations

import array
import sys
from typing import Any, Protocol, runtime_checkable

_LITTLE = sys.byteorder == "little"


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> bytes:
        """Packed LE uint32 token ids of ``text``."""
        ...

    def decode(self, tokens: bytes) -> str:
        """Text of packed LE uint32 token ids (inverse of ``encode`` up to padding)."""
        ...


def count_tokens(tokens: bytes) -> int:
    return len(tokens) // 4


def pack_ids(ids: list[int]) -> bytes:
    arr = array.array("I", ids)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack_ids(tokens: bytes) -> list[int]:
    arr = array.array("I")
    arr.frombytes(tokens)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


class Bytes4Tokenizer:
    """One token per four UTF-8 bytes; the id is those bytes read as LE uint32."""

    name = "bytes4"

    def encode(self, text: str) -> bytes:
        raw = text.encode("utf-8")
        pad = -len(raw) % 4
        return raw + b"\0" * pad if pad else raw

    def decode(self, tokens: bytes) -> str:
        return tokens.rstrip(b"\0").decode("utf-8", errors="replace")


RELEASED_FROM = 256  # characters: below, the thread pool's hand-off costs more than the GIL is held


def hf_ids(tok: Any, text: str) -> list[int]:
    """``tok.encode(text, add_special_tokens=False).ids`` of a ``tokenizers.Tokenizer``, with the
    GIL released while it runs.

    ``encode`` holds the GIL throughout: a 254K-token text took 375 ms during which no other
    thread ran, the event loop included. ``encode_batch_fast`` releases it and skips the character
    offsets nothing here reads (211 ms); the same ids. Tiny texts keep ``encode`` (15 against
    33 us at 50 characters)."""
    if len(text) < RELEASED_FROM:
        ids: list[int] = tok.encode(text, add_special_tokens=False).ids
        return ids
    ids = tok.encode_batch_fast([text], add_special_tokens=False)[0].ids  # a new list already
    return ids


def hf_ids_many(tok: Any, texts: list[str]) -> list[list[int]]:
    """``hf_ids`` of each text, in one ``encode_batch_fast`` call when that pays: the tokenizer
    encodes the texts of a batch in parallel on its own threads (all the cores), the GIL
    released. The 37 segments of a cold 128K-token chat took 60-76 ms so against 100-115 ms
    one by one on two cores; the same ids."""
    if len(texts) < 2 or sum(len(t) for t in texts) < RELEASED_FROM:
        return [hf_ids(tok, t) for t in texts]
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded from a local file (``tokenizers`` is a core dependency)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(path)
        self.name = f"hf:{path}"

    def encode(self, text: str) -> bytes:
        return pack_ids(hf_ids(self._tok, text))

    def decode(self, tokens: bytes) -> str:
        return str(self._tok.decode(unpack_ids(tokens)))


def load_tokenizer(spec: str = "bytes4") -> Tokenizer:
    """``bytes4`` or ``hf:/path/to/tokenizer.json``."""
    if spec in ("", "bytes4"):
        return Bytes4Tokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    raise ValueError(f"unknown tokenizer {spec!r}: use 'bytes4' or 'hf:/path/to/tokenizer.json'")
