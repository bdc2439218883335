"""Token ids in and out of the tiny model. Pure.

In: any uint32 id (the gateway's ``bytes4`` tokenizer makes one of every four UTF-8 bytes) is
hashed onto one of ``vocab`` embedding rows (Fibonacci hashing), so every prompt is valid input.

Out: the model's head scores ``1 + 256`` classes: class 0 is the end token (id 0, never shown),
class ``1 + i`` is the simulated engine's word ``i`` (a space and three letters: four UTF-8
bytes, so its id is exactly what ``bytes4`` makes of its text, and output fed back as a prompt
tokenizes to the same ids).
"""

from __future__ import annotations

import numpy as np
import xxhash
from numpy.typing import NDArray

from backends.sim import textgen

EOS_TOKEN = 0
OUTPUT_IDS: NDArray[np.uint32] = np.array((EOS_TOKEN, *textgen.TOKEN_IDS), dtype=np.uint32)
OUTPUT_CLASSES = len(OUTPUT_IDS)
_TEXT: dict[int, str] = {EOS_TOKEN: "", **textgen.TEXT_OF}
VOCAB_DIGEST = xxhash.xxh3_64_hexdigest(OUTPUT_IDS.tobytes())

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(32)


def token_ids(tokens: bytes) -> NDArray[np.uint32]:
    """Packed little-endian uint32 tokens as an array (no copy)."""
    return np.frombuffer(tokens, dtype="<u4")


def embedding_rows(ids: NDArray[np.uint32], vocab: int) -> NDArray[np.int64]:
    """Row of the embedding table for each token id."""
    mixed = ids.astype(np.uint64) * _GOLDEN  # wraps mod 2**64
    return ((mixed >> _SHIFT) % np.uint64(vocab)).astype(np.int64)


def token_of_class(cls: int) -> int:
    return int(OUTPUT_IDS[cls])


def token_text(token: int) -> str:
    return _TEXT.get(token, "")
