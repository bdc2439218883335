"""Tokenize a long prompt without redoing the parts seen before.

A rendered chat is cut where the tokenizer itself cuts: at the added (special) tokens of the
template, such as ``<|im_start|>``. A ``tokenizers`` pipeline splits those out of the text first
and runs normalization, pre-tokenization and BPE on the pieces between them separately, so no
merge, regex or normalizer can reach across one. Each segment starts at such a token (the first
one starts at the text's beginning) and runs to the next, so a segment is tokenized in the same
context it has inside the whole prompt: ``ids(prompt) == ids(seg_0) + ids(seg_1) + ...``.

Not every added token is a safe cut: one with ``lstrip`` takes the whitespace before it, one with
``single_word`` matches depending on its neighbours, and a ``normalized`` one is matched after
normalization. The text is never cut before those. Matches are found leftmost-longest over every
non-normalized added token, as the tokenizer finds them, so the cuts are real split points.

Segment ids are kept in an LRU bounded by bytes, keyed by the segment's text: a system prefix or
a document that comes again is not tokenized again. The segments not in the cache are tokenized
in one batch, in parallel on the tokenizer's threads and with the GIL released
(``cachetier.tokenizer.hf_ids_many``). When they are long (``REMOTE_FROM`` characters together)
and the encoder has tokenizer processes (``remote``: ``gateway.tokenpool``), a child process
tokenizes them instead and hands back their ids packed, as the cache keeps them: the gateway's
process then never builds the Python list of a long prompt's ids, nor spends its cores on the
encoding. Cutting pays even cold: encoding the pieces costs less than encoding the whole text
at once.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixgate.cachetier.fastbpe import FastBPE, longest_first
from prefixgate.cachetier.tokenizer import hf_ids, hf_ids_many, pack_ids

ENTRY_OVERHEAD = 160  # bytes an entry costs beyond its key and value (dict slot, node, objects)
# Characters of uncached text from which a tokenizer process is asked (about 8K tokens): below,
# the ids' list and packing hold the interpreter lock for well under a millisecond, less than
# the round trip to a child costs.
REMOTE_FROM = 32 * 1024


class Remote(Protocol):
    """Where long texts are tokenized instead (``gateway.tokenpool.TokenizerPool``): each text's
    packed ids, or None when the caller must tokenize them itself."""

    def encode_many(self, texts: Sequence[str]) -> list[bytes] | None: ...


@dataclass(frozen=True, slots=True)
class AddedToken:
    content: str
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = False

    @property
    def cuttable(self) -> bool:
        return not (self.lstrip or self.single_word or self.normalized)


def added_tokens(tokenizer_json: dict[str, Any]) -> list[AddedToken]:
    """The ``added_tokens`` of a parsed ``tokenizer.json``."""
    out = []
    for t in tokenizer_json.get("added_tokens") or ():
        if isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"]:
            out.append(
                AddedToken(
                    t["content"],
                    bool(t.get("lstrip")),
                    bool(t.get("rstrip")),
                    bool(t.get("single_word")),
                    bool(t.get("normalized")),
                )
            )
    return out


class CutFinder:
    """Where a text may be cut: before each cuttable added token (never at 0)."""

    def __init__(self, tokens: Iterable[AddedToken]) -> None:
        matched = [t for t in tokens if not t.normalized]  # split out before normalization
        self._cuttable = {t.content for t in matched if t.cuttable}
        self._pattern = longest_first(t.content for t in matched)

    @property
    def active(self) -> bool:
        return self._pattern is not None and bool(self._cuttable)

    def cuts(self, text: str) -> list[int]:
        if self._pattern is None or not self._cuttable:
            return []
        keep = self._cuttable
        return [m.start() for m in self._pattern.finditer(text) if m.start() > 0 and m.group() in keep]

    def split(self, text: str) -> list[str]:
        bounds = [0, *self.cuts(text), len(text)]
        return [text[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0  # UTF-8-ish size of the text served from the cache
    entries: int = 0
    bytes: int = 0


class SegmentCache:
    """Segment text -> packed ids, least recently used dropped first, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.max_entry = self.max_bytes // 4  # one huge one-off segment cannot flush the rest
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @staticmethod
    def cost(text: str, ids: bytes) -> int:
        return sys.getsizeof(text) + len(ids) + ENTRY_OVERHEAD

    def get(self, text: str) -> bytes | None:
        with self._lock:
            ids = self._items.get(text)
            if ids is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(text)
            self.stats.hits += 1
            self.stats.hit_bytes += len(text)
            return ids

    def put(self, text: str, ids: bytes) -> None:
        cost = self.cost(text, ids)
        if cost > self.max_entry:
            return
        with self._lock:
            old = self._items.pop(text, None)
            if old is not None:
                self.stats.bytes -= self.cost(text, old)
            self._items[text] = ids
            self.stats.bytes += cost
            while self.stats.bytes > self.max_bytes and self._items:
                k, v = self._items.popitem(last=False)
                self.stats.bytes -= self.cost(k, v)
            self.stats.entries = len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.stats = CacheStats()


class SegmentEncoder:
    """``encode(text)`` equal to the tokenizer's ``encode(text, add_special_tokens=False)``,
    reusing the ids of segments met before."""

    def __init__(
        self, hf: Any, tokens: Iterable[AddedToken], cache_bytes: int, fast: FastBPE | None = None
    ) -> None:
        self._hf = hf
        self.fast = fast  # tiktoken, where it gives ``hf`` 's ids (``cachetier.fastbpe.build``)
        self.finder = CutFinder(tokens)
        self.cache = SegmentCache(cache_bytes)
        self.remote: Remote | None = None  # tokenizer processes, for long texts

    def plain(self, text: str) -> bytes:
        if self.remote is not None and len(text) >= REMOTE_FROM:
            return self.fresh([text])[0]
        if self.fast is not None:
            return self.fast.packed(text)
        return pack_ids(hf_ids(self._hf, text))

    def fresh(self, texts: list[str]) -> list[bytes]:
        """Packed ids of each text, without the cache: in a tokenizer process when they are
        long and one takes them, else here: by tiktoken one after the other where it serves,
        else by the tokenizer (in parallel when they are long: ``hf_ids_many``)."""
        if self.remote is not None and sum(len(t) for t in texts) >= REMOTE_FROM:
            done = self.remote.encode_many(texts)
            if done is not None:
                return done
        if self.fast is not None:
            return [self.fast.packed(t) for t in texts]
        return [pack_ids(ids) for ids in hf_ids_many(self._hf, texts)]

    def encode(self, text: str) -> bytes:
        if not text:
            return b""
        if not self.finder.active:
            return self.plain(text)
        segments = self.finder.split(text)
        parts: list[bytes | None] = [self.cache.get(segment) for segment in segments]
        missing = list(dict.fromkeys(seg for seg, ids in zip(segments, parts, strict=True) if ids is None))
        if missing:  # tokenized together (``fresh``)
            fresh = dict(zip(missing, self.fresh(missing), strict=True))
            for seg, ids in fresh.items():
                self.cache.put(seg, ids)
            parts = [fresh[seg] if ids is None else ids for seg, ids in zip(segments, parts, strict=True)]
        return b"".join(p for p in parts if p is not None)
