"""Token ids back to text, a chunk at a time, with the request's stop conditions.

Engines that speak the SMG protocol return token ids only; the gateway turns them into text.
Two pieces, used together by ``Detokenizer``:

- ``IncrementalDecoder``: the prefix-window method (HF ``DecodeStream``, SMG's ``sequence.rs``):
  the text of new ids is ``decode(window + new)`` minus ``decode(window)``; it is held back while
  it ends in U+FFFD (a character whose bytes are not all out yet), so no chunk ever carries half
  a UTF-8 character. Decoding is the ``tokenizers`` library's own.
- ``StopMatcher``: stop strings matched over the emitted text, across chunk boundaries. Text that
  could still be the start of a stop string is held back ("jailed") until it is known not to be;
  on a match the text before it is emitted and the rest dropped.

Stop token ids end the text too (hidden): an engine normally stops on them itself, but whatever
follows one is never shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the ``tokenizers`` library's ``Tokenizer`` offers for decoding."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """Decodes a growing id sequence into text deltas that never split a character."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the text already emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def step(self, ids: Iterable[int]) -> str:
        """The text the new ``ids`` complete (possibly empty while a character is incomplete)."""
        self._ids.extend(ids)
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(before) or full.endswith(REPLACEMENT):  # as HF ``DecodeStream`` does
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (the stream ended: incomplete characters are shown as
        U+FFFD, as a full decode would)."""
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(before) :]


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
