"""Token ids in and out of the tiny model. Pure (the vocabulary is read once, at import).

In: any uint32 id (the shipped tokenizer's ids, or the ``bytes4`` tokenizer's of the native
protocol) is hashed onto one of ``vocab`` embedding rows (Fibonacci hashing), so every prompt is
valid input.

Out: the model's vocabulary is the shipped Hugging Face tokenizer's (``backends.hftok``): the
head scores class 0 = the end token (``<|im_end|>``, never shown) and one class per id whose text
stands alone (no partial UTF-8, not special), so output text is the tokenizer's decode of the
output ids and any client holding that tokenizer reads the same text.
"""

from __future__ import annotations

import numpy as np
import xxhash
from numpy.typing import NDArray

from prefixgate.backends.hftok import load

_TOKENIZER = load()
EOS_TOKEN = _TOKENIZER.eos_token_id
OUTPUT_IDS: NDArray[np.uint32] = np.array((EOS_TOKEN, *_TOKENIZER.clean_ids()), dtype=np.uint32)
OUTPUT_CLASSES = len(OUTPUT_IDS)
CLASS_OF: dict[int, int] = {int(t): c for c, t in enumerate(OUTPUT_IDS)}  # token id -> class
_TEXT: tuple[str, ...] = _TOKENIZER.texts
VOCAB_DIGEST = xxhash.xxh3_64_hexdigest(OUTPUT_IDS.tobytes() + "\0".join(_TEXT).encode())

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
    return _TEXT[token] if 0 <= token < len(_TEXT) and token != EOS_TOKEN else ""
