"""Deterministic synthetic text, and block hashes of prompts made of text segments.

Public traces give ids and lengths, never text. A replay needs the same id to always give the
same text, so a segment ``(seg, tokens)`` is the first ``tokens`` tokens of an endless,
id-seeded stream of ASCII words. Under the ``bytes4`` tokenizer a token is four bytes, so a
segment of ``n`` tokens is exactly ``4 n`` bytes of text: a Mooncake block id becomes 2,048
bytes, which are 512 tokens, and block boundaries fall where the trace put them.

The simulator does not render the text: ``span_hashes`` chains a hash over what each block is
made of (segment id and token range), which gives the same equalities between blocks as hashing
the text would (two blocks agree exactly when their content does) at a fraction of the cost.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import xxhash

from prefixgate.cachetier.hashing import HASH_SEED

# 256 words of two letters or more: one byte of the stream picks one word (>= 3 bytes with the space).
_WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is it that for as with was on be by this are from at or an have not "
        "but all they which one you were her she there can would we their been if has when who "
        "will more no out do so up said what its about into than them only other new some could "
        "time these two may then first any my now such like our over man me even most made after "
        "also did many before must through back years where much your way well down should because "
        "each just those people how too little state good very make world still own see men work "
        "long get here between both life being under never day same another know while last might "
        "us great old year off come since against go came right used take three states himself few "
        "house use during without again place around however home small found thought went say part "
        "once general high upon school every does got united left number course war until always "
        "away something fact though water less public put think almost hand enough far took head yet "
        "government system better set told nothing night end why called didn't eyes find going look "
        "asked later knew point next program city business give group toward young days let room "
        "president side social given present several order national possible rather second face per "
        "among form important often things looked early white case john become large big need four "
        "within felt along children saw best church ever least power development light thing seemed "
        "family interest want members mind country area others done turned although open god service "
        "certain kind problem began different door thus help sense means whole matter perhaps itself"
    ).split()
)[:256]
assert len(_WORDS) == 256 and min(map(len, _WORDS)) >= 2

_SEG = struct.Struct("<QII")
_LE64 = struct.Struct("<Q")

Span = tuple[int, int]  # (segment id, tokens)


def segment_text(seg: int, tokens: int, salt: str = "", *, line_words: int = 0) -> str:
    """The first ``tokens`` tokens (``4 * tokens`` ASCII bytes) of segment ``seg``'s stream.

    ``line_words`` > 0 breaks the text into lines of that many words (prose-like input for the
    normalizer); the byte count is unchanged.
    """
    nbytes = tokens * 4
    if nbytes <= 0:
        return ""
    seed = f"prefixgate-bench\0{salt}\0{seg}".encode()
    # Every word takes >= 3 bytes, so nbytes // 3 + 1 words always cover nbytes.
    stream = hashlib.shake_256(seed).digest(nbytes // 3 + 1)
    words = [_WORDS[b] for b in stream]
    if line_words > 0:
        lines = [" ".join(words[i : i + line_words]) for i in range(0, len(words), line_words)]
        text = "\n".join(lines)
    else:
        text = " ".join(words)
    return text[:nbytes]


def spans_text(spans: Iterable[Span], salt: str = "") -> str:
    """The prompt text of a list of segments (each ``4 * tokens`` bytes, so offsets add up)."""
    return "".join(segment_text(seg, n, salt) for seg, n in spans)


def span_hashes(
    spans: Sequence[Span],
    block_size: int,
    root: int,
    memo: dict[tuple[int, int, int], tuple[int, ...]] | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of a prompt made of ``spans``.

    Block ``i``'s hash is ``xxh3_64(LE64(h_{i-1}) || pieces)`` where ``pieces`` lists the
    (segment, start, end) token ranges the block is made of. ``memo`` caches, per (previous hash,
    segment, tokens), the hashes of a block-aligned segment's full blocks: traces repeat the
    same chains request after request.
    """
    out: list[int] = []
    h = root
    fill = 0  # tokens already in the current (open) block
    pieces: list[bytes] = []
    digest = xxhash.xxh3_64_intdigest
    pack = _LE64.pack
    seg_pack = _SEG.pack
    for seg, n in spans:
        off = 0
        if fill == 0 and n >= block_size:
            full = n // block_size
            key = (h, seg, full)
            cached = memo.get(key) if memo is not None else None
            if cached is None:
                hs: list[int] = []
                for j in range(full):
                    h = digest(pack(h) + seg_pack(seg, j * block_size, (j + 1) * block_size), seed=HASH_SEED)
                    hs.append(h)
                cached = tuple(hs)
                if memo is not None:
                    memo[key] = cached
            out.extend(cached)
            h = cached[-1]
            off = full * block_size
        while off < n:
            take = min(n - off, block_size - fill)
            pieces.append(seg_pack(seg, off, off + take))
            off += take
            fill += take
            if fill == block_size:
                h = digest(pack(h) + b"".join(pieces), seed=HASH_SEED)
                out.append(h)
                pieces.clear()
                fill = 0
    return out
