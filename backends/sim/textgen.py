"""Deterministic text for the simulated engine. Pure.

Output tokens are 256 three-letter English words, each with a leading space: four UTF-8 bytes,
so a token id is exactly what ``cachetier.tokenizer.Bytes4Tokenizer`` makes of its text.

The sampling state is a 64-bit digest: ``s_0`` = digest of the prompt, ``s_{i+1}`` = digest of
``(s_i, token_i)``. At step ``i`` the words are ranked by a permutation drawn from ``s_i``; rank
``r`` has weight ``(r + 1) ** (-1 / temperature)`` (Zipf-like; temperature 0 = rank 0, greedy),
``top_p`` keeps the smallest leading set of ranks reaching that mass, and the rank is drawn with a
uniform number derived from ``(seed, i)`` (seed: the request's, or else the prompt digest). The
sequence ends by itself with ``EOS_TOKEN`` after a length of 16-255 tokens drawn the same way.
Every path (one node, or prefill on one node and decode on another) computes the same thing.
"""

from __future__ import annotations

import bisect
import struct
from functools import lru_cache

import xxhash

from prefixgate.backends.engine import Sampling

_WORDS = """
    the and for are but not you all any can had her was one our out day get has him his how man new
    now old see two way who boy did its let put say she too use sky sea sun red big top low far few
    end yes run cat dog fox owl bee ant elk hen cow pig ram yak eel cod fig nut pea oak elm ash ivy
    bud hay mud ice fog dew air gas oil ore tin gem art act age aim arm bag bar bat bed bet bin bit
    bow box bus cab cap car cup cut dam den dig dip dot dry due ear eat egg ego era eve eye fan fat
    fee fit fix fly fun fur gap god gum gun guy hat hit hop hot hub hue hug hum hut ink inn jam jar
    jaw jet job jog joy key kid kin kit lab lad lap law lay leg lid lip lit log lot map mat max mix
    mob mop mug nap net nod oar odd off opt orb owe own pad pal pan pat paw pay pen pet pie pin pit
    pod pop pot pro pub pun pup raw ray rib rid rim rip rod rot row rub rug sad sat saw set sew shy
    sin sip sir sit six ski sly sob sod son sow soy spa spy sub sum tab tag tan tap tar tax tea ten
    tie tip toe ton tow toy try tub tug urn van vat vet via vow wax
""".split()

VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS)
VOCAB_SIZE = len(VOCAB)
assert VOCAB_SIZE == 256 and all(len(w.encode()) == 4 for w in VOCAB)
TOKEN_IDS: tuple[int, ...] = tuple(int.from_bytes(w.encode(), "little") for w in VOCAB)
TEXT_OF: dict[int, str] = dict(zip(TOKEN_IDS, VOCAB, strict=True))
EOS_TOKEN = 0
VOCAB_DIGEST = xxhash.xxh3_64_hexdigest("\n".join(VOCAB).encode())

MIN_LENGTH = 16
LENGTH_SPAN = 240

_STATE_SEED = 0x73696D  # "sim"
_LE64 = struct.Struct("<Q")
_LE64_32 = struct.Struct("<QI")
_TWO64 = float(1 << 64)


def token_text(token: int) -> str:
    return TEXT_OF.get(token, "")


def prompt_state(tokens: bytes) -> int:
    """``s_0``: the digest of the whole prompt."""
    return xxhash.xxh3_64_intdigest(tokens, seed=_STATE_SEED)


def advance(state: int, token: int) -> int:
    """``s_{i+1}`` from ``s_i`` and the token chosen at step i."""
    return xxhash.xxh3_64_intdigest(_LE64_32.pack(state, token), seed=_STATE_SEED)


@lru_cache(maxsize=64)
def rank_cdf(temperature: float, top_p: float) -> tuple[float, ...]:
    """Cumulative probability over ranks after temperature and top-p (normalized to 1)."""
    if temperature <= 0:
        return (1.0,)
    weights = [(r + 1) ** (-1.0 / temperature) for r in range(VOCAB_SIZE)]
    total = sum(weights)
    cdf: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w / total
        cdf.append(acc)
        if acc >= top_p:
            break
    return tuple(c / acc for c in cdf)


class Sampler:
    """Picks the token at each step from the state; same inputs, same token, on any node."""

    __slots__ = ("_base", "_cdf", "natural_length")

    def __init__(self, sampling: Sampling, prompt_digest: int) -> None:
        self._base = prompt_digest if sampling.seed is None else sampling.seed & 0xFFFFFFFFFFFFFFFF
        if sampling.choice:  # choice i of n: its own draws, reproducible under a seed
            mixed = _LE64_32.pack(self._base, sampling.choice)
            self._base = xxhash.xxh3_64_intdigest(mixed, seed=_STATE_SEED)
        self._cdf = rank_cdf(sampling.temperature, sampling.top_p)
        key = _LE64.pack(self._base) + _LE64.pack(prompt_digest) + b"len"
        self.natural_length = MIN_LENGTH + xxhash.xxh3_64_intdigest(key, seed=_STATE_SEED) % LENGTH_SPAN

    def pick(self, state: int, step: int) -> int:
        if step >= self.natural_length:
            return EOS_TOKEN
        rank = 0
        if len(self._cdf) > 1:
            u = xxhash.xxh3_64_intdigest(_LE64_32.pack(self._base, step), seed=_STATE_SEED) / _TWO64
            rank = min(bisect.bisect_right(self._cdf, u), len(self._cdf) - 1)
        mul = ((state >> 8) | 1) & 0xFF
        return TOKEN_IDS[(mul * rank + (state & 0xFF)) & 0xFF]


def first_token(tokens: bytes, sampling: Sampling, resumed: int = 0) -> tuple[int, int]:
    """(first token, state after it) for a prompt; ``resumed``: the last ``resumed`` of
    ``tokens`` are output already produced, and the token is the one the unbroken run picks next
    (step ``resumed``, the state advanced through them, the prompt the rest)."""
    n = len(tokens) - 4 * resumed
    s0 = prompt_state(tokens[:n])
    state = s0
    for (token,) in struct.iter_unpack("<I", tokens[n:]):
        state = advance(state, token)
    tok = Sampler(sampling, s0).pick(state, resumed)
    return tok, advance(state, tok)
