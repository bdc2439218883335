"""Token ids back to text, a chunk at a time, with the request's stop conditions.

Engines that speak the SMG protocol return token ids only; the gateway turns them into text.
Two pieces, used together by ``Detokenizer``:

- ``IncrementalDecoder``: the prefix-window method (HF ``DecodeStream``, SMG's ``sequence.rs``):
  the text of new ids is ``decode(window + new)`` minus ``decode(window)``; it is held back while
  it ends in U+FFFD (a character whose bytes are not all out yet), so no chunk ever carries half
  a UTF-8 character. Decoding is the ``tokenizers`` library's own. The ids held back are bounded
  (``PENDING_LIMIT``), so every id costs about the same whatever the engine sends: skipped special
  ids never enter the window (a full decode drops them too), and a tail that stays incomplete is
  settled once ids enough follow it for its bytes to be decided (U+FFFD where they never formed a
  character, as a full decode shows them).
- ``StopMatcher``: stop strings matched over the emitted text, across chunk boundaries. Text that
  could still be the start of a stop string is held back ("jailed") until it is known not to be;
  on a match the text before it is emitted and the rest dropped.

Ids outside the tokenizer's vocabulary (an engine fault: a padded output layer, a mismatched
tokenizer) show as U+FFFD where they stand and are counted (``out_of_vocabulary``), never
dropped in silence and never raising. ``tokenizers`` itself skips ids it does not know, and
``DecodeStream`` holds every id that adds no text, so neither is used as is.

Stop token ids end the text too (hidden): an engine normally stops on them itself, but whatever
follows one is never shown.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT = "\ufffd"
PENDING_LIMIT = 8  # ids held back at most: twice the bytes of the longest UTF-8 character
SETTLE = 3  # ids that must follow a forced boundary: the bytes before it are then decided
SEARCH = 4  # boundaries tried back from there: one of 4 in a row starts a character


class Decoder(Protocol):
    """What the ``tokenizers`` library's ``Tokenizer`` offers for decoding."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Which ids a tokenizer decodes, and which of them a decode skipping special tokens drops."""

    size: int  # the model's ids: 0 .. size - 1
    added: frozenset[int] = frozenset()  # added tokens' ids (possibly above ``size``)
    special: frozenset[int] = frozenset()

    def known(self, token_id: int) -> bool:
        return 0 <= token_id < self.size or token_id in self.added


UNKNOWN_VOCABULARY = Vocabulary(1 << 32)  # a decoder that tells nothing: what decode can take
_VOCABULARIES: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Decoder) -> Vocabulary:
    """``tokenizer``'s ids (read once per tokenizer object: it is the same for every request)."""
    with contextlib.suppress(KeyError, TypeError):
        return _VOCABULARIES[tokenizer]
    found = _read_vocabulary(tokenizer)
    with contextlib.suppress(TypeError):  # not weakly referenceable: read again next time
        _VOCABULARIES[tokenizer] = found
    return found


def _read_vocabulary(tokenizer: Decoder) -> Vocabulary:
    size = getattr(tokenizer, "get_vocab_size", None)
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if not callable(size) or not callable(added):
        return UNKNOWN_VOCABULARY
    tokens: dict[int, Any] = dict(added())
    return Vocabulary(
        int(size(with_added_tokens=False)),
        frozenset(int(i) for i in tokens),
        frozenset(int(i) for i, t in tokens.items() if getattr(t, "special", False)),
    )


class IncrementalDecoder:
    """Decodes a growing id sequence into text deltas that never split a character."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._vocab = vocabulary(tokenizer)
        self._drop = self._vocab.special if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the window: the ids emitted last (for context), then those held
        self._read = 0  # end of the text already emitted
        self._before: str | None = ""  # decode(ids[:read]), kept while the window stays put
        self.out_of_vocabulary = 0  # ids the tokenizer does not know, each shown as U+FFFD
        self.first_out_of_vocabulary: int | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def _context(self) -> str:
        if self._before is None:
            self._before = self._decode(self._ids[: self._read])
        return self._before

    def step(self, ids: Iterable[int]) -> str:
        """The text the new ``ids`` complete (possibly empty while a character is incomplete)."""
        out: list[str] = []
        run: list[int] = []
        drop, size, added = self._drop, self._vocab.size, self._vocab.added
        for t in ids:
            if t in drop:
                continue  # a skipped special token: a full decode drops it too
            if 0 <= t < size or t in added:
                run.append(t)
                continue
            # an id the tokenizer does not know breaks the text where it stands
            self._ids.extend(run)
            run = []
            out += (self.flush(), REPLACEMENT)
            self.out_of_vocabulary += 1
            if self.first_out_of_vocabulary is None:
                self.first_out_of_vocabulary = t
        out.append(self._advance(run))
        return "".join(out)

    def _advance(self, new: list[int]) -> str:
        if not new:
            return ""
        self._ids.extend(new)
        n = len(self._ids)
        before = self._context()
        full = self._decode(self._ids)
        if len(full) > len(before) and not full.endswith(REPLACEMENT):  # as HF ``DecodeStream`` does
            return self._emit(full, before, n)
        if n - self._read <= PENDING_LIMIT:
            return ""
        return self._settle(full, before, n)

    def _settle(self, full: str, before: str, n: int) -> str:
        """Too many ids held: emit up to a boundary ``SETTLE`` ids or more back, where the text so
        far is a prefix of ``full`` (each id carries a byte at least, so whatever follows cannot
        change the bytes before it: U+FFFD there is final, as in a full decode)."""
        for s in range(n - SETTLE, max(self._read, n - SETTLE - SEARCH), -1):
            text = self._decode(self._ids[:s])
            if len(text) > len(before) and full.startswith(text):
                return self._emit(text, before, s)
        # no boundary settles (ids that add no text, a decoder unlike UTF-8's): show what there is
        return self.flush()

    def _emit(self, text: str, before: str, end: int) -> str:
        """``text`` (the decode of the window up to ``end``) past ``before``; the window moves on."""
        del self._ids[: self._read]
        self._read, self._before = end - self._read, None
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (the stream ended: incomplete characters are shown as
        U+FFFD, as a full decode would); the next ids start afresh."""
        out = ""
        if len(self._ids) > self._read:
            out = self._decode(self._ids)[len(self._context()) :]
        self._ids.clear()
        self._read = 0
        self._before = ""
        return out


class StopMatcher:
    """Finds the first stop string in a stream of text pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held) that is safe to show; after a match, nothing."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        if best >= 0:
            self._held = ""
            return buf[:best]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """The held text, once the stream ended without a match."""
        out, self._held = ("" if self.matched is not None else self._held), ""
        return out


@dataclass(frozen=True, slots=True)
class Piece:
    """What one step of the engine's output becomes: text to show, and whether it ended the
    choice (``finish_reason`` "stop", with the string or token that matched)."""

    text: str
    stopped: bool = False
    matched_stop: str | int | None = None


class Detokenizer:
    """One choice's output ids -> text, honouring stop strings and stop token ids."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
        hidden_token_ids: Iterable[int] = (),
    ) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopMatcher(stop)
        self._stop_ids = frozenset(stop_token_ids)
        # never shown, nor ending anything (the end-of-turn tokens when special tokens are shown)
        self._hidden = frozenset(hidden_token_ids)
        self.stopped = False
        self.matched_stop: str | int | None = None

    @property
    def out_of_vocabulary(self) -> int:
        """Ids the tokenizer does not know so far (each shown as U+FFFD): the engine's fault."""
        return self._decoder.out_of_vocabulary

    @property
    def first_out_of_vocabulary(self) -> int | None:
        return self._decoder.first_out_of_vocabulary

    def push(self, ids: Sequence[int]) -> Piece:
        """Text for the engine's next ``ids``; once stopped, every later push is empty."""
        if self.stopped:
            return Piece("", True, self.matched_stop)
        if self._hidden:
            ids = [t for t in ids if t not in self._hidden]
        cut = next((i for i, t in enumerate(ids) if t in self._stop_ids), -1)
        if cut >= 0:
            text = self._decoder.step(ids[:cut]) + self._decoder.flush()
            shown = self._stops.feed(text)
            self.stopped = True
            self.matched_stop = self._stops.matched if self._stops.matched is not None else int(ids[cut])
            if self._stops.matched is None:
                shown += self._stops.flush()
            return Piece(shown, True, self.matched_stop)
        shown = self._stops.feed(self._decoder.step(ids))
        if self._stops.matched is not None:
            self.stopped = True
            self.matched_stop = self._stops.matched
            return Piece(shown, True, self.matched_stop)
        return Piece(shown)

    def finish(self) -> Piece:
        """The held-back text once the engine finished the choice."""
        if self.stopped:
            return Piece("", True, self.matched_stop)
        shown = self._stops.feed(self._decoder.flush())
        if self._stops.matched is not None:
            self.stopped = True
            self.matched_stop = self._stops.matched
            return Piece(shown, True, self.matched_stop)
        return Piece(shown + self._stops.flush())
