"""Token ids back to text, a chunk at a time, with the request's stop conditions.

Engines that speak the SMG protocol return token ids only; the gateway turns them into text.
Two pieces, used together by ``Detokenizer``:

- ``IncrementalDecoder``: the prefix-window method (SMG's ``sequence.rs``): the text of new ids
  is ``decode(window + new)`` minus ``decode(window)``; it is held back while it ends in U+FFFD (a
  character whose bytes are not all out yet), so no chunk ever carries half a UTF-8 character.
  The step itself is the ``tokenizers`` library's ``DecodeStream`` (the same method, with both
  decodes in Rust and one call an id); the rest is kept here, around it. The ids held back are
  bounded (``PENDING_LIMIT``), so every id costs about the same whatever the engine sends: skipped
  special ids never enter the window (a full decode drops them too), and a tail that stays
  incomplete is settled once ids enough follow it for its bytes to be decided (U+FFFD where they
  never formed a character, as a full decode shows them). ``DecodeStream`` alone would hold
  every id that adds no text, unbounded, and has no end: so the window's ids are mirrored here,
  a held tail is settled and the stream flushed by the window method, and the library's stream
  then starts again from the window (``ids=``, its context).
- ``StopMatcher``: stop strings matched over the emitted text, across chunk boundaries. Text that
  could still be the start of a stop string is held back ("jailed") until it is known not to be;
  on a match the text before it is emitted and the rest dropped.

Ids outside the tokenizer's vocabulary (an engine fault: a padded output layer, a mismatched
tokenizer) show as U+FFFD where they stand and are counted (``out_of_vocabulary``), never
dropped in silence and never raising (``tokenizers`` itself skips ids it does not know): they
never reach the library's stream.

Stop token ids end the text too (hidden): an engine normally stops on them itself, but whatever
follows one is never shown.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

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


@functools.cache
def native_stream() -> Any:
    """The ``tokenizers`` library's incremental decoder (``decoders.DecodeStream``) when it can
    start from a given context (``ids=``, 0.22 on), else None: decoding then goes by windows."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(skip_special_tokens=True, ids=[])
    except (ImportError, TypeError):
        return None
    return DecodeStream


def _is_tokenizers(tokenizer: Decoder) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    return isinstance(tokenizer, Tokenizer)


class IncrementalDecoder:
    """Decodes a growing id sequence into text deltas that never split a character.

    With a ``tokenizers.Tokenizer`` the library's own ``DecodeStream`` does the common step (one
    call an id, both decodes in Rust); this class keeps what it does not: the ids of its window
    (``_ids``: the ids whose text was shown last, then those held back), mirrored after each
    step, so that it can bound what is held (``_settle``), end the stream (``flush``) and break it
    at an unknown id, restarting the library's stream from the window each time (``_restart``).
    Any other decoder goes by windows alone (``_advance_window``), with the same results.
    """

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._vocab = vocabulary(tokenizer)
        self._drop = self._vocab.special if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the window: the ids emitted last (for context), then those held
        self._read = 0  # end of the text already emitted
        self._before: str | None = ""  # decode(ids[:read]), kept while the window stays put
        self._native = native_stream() if _is_tokenizers(tokenizer) else None
        self._stream: Any = None
        if self._native is not None:
            self._stream = self._native(skip_special_tokens=skip_special_tokens)
        self.out_of_vocabulary = 0  # ids the tokenizer does not know, each shown as U+FFFD
        self.first_out_of_vocabulary: int | None = None

    @property
    def held(self) -> int:
        """Ids whose text is held back (at most ``PENDING_LIMIT``)."""
        return len(self._ids) - self._read

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def _context(self) -> str:
        if self._before is None:
            self._before = self._decode(self._ids[: self._read])
        return self._before

    def step(self, ids: Sequence[int]) -> str:
        """The text the new ``ids`` complete (possibly empty while a character is incomplete)."""
        drop, size, added = self._drop, self._vocab.size, self._vocab.added
        if len(ids) == 1:  # one id a step: a streaming engine's usual chunk
            t = ids[0]
            if t in drop:
                return ""
            if 0 <= t < size or t in added:
                return self._advance([t])
        out: list[str] = []
        run: list[int] = []
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
        stream = self._stream
        if stream is None:  # by windows (until the library's stream can start again)
            return self._advance_window(new) + self._restart()
        ids = self._ids
        try:
            text = stream.step(self._tok, new[0] if len(new) == 1 else new)
        except Exception:  # a decoder whose text of more ids does not begin with that of fewer
            ids.extend(new)
            self._stream = None
            return self._emit(self._decode(ids), self._context(), len(ids)) + self._restart()
        ids.extend(new)
        if text is not None:  # the library's window is now the ids since the text before
            del ids[: self._read]
            self._read, self._before = len(ids), None
            return str(text)
        if len(ids) - self._read <= PENDING_LIMIT:
            return ""
        self._stream = None
        return self._settle(self._decode(ids), self._context(), len(ids)) + self._restart()

    def _advance_window(self, new: list[int]) -> str:
        self._ids.extend(new)
        n = len(self._ids)
        before = self._context()
        full = self._decode(self._ids)
        if len(full) > len(before) and not full.endswith(REPLACEMENT):  # as HF ``DecodeStream`` does
            return self._emit(full, before, n)
        if n - self._read <= PENDING_LIMIT:
            return ""
        return self._settle(full, before, n)

    def _restart(self) -> str:
        """The library's stream started again from the window: the ids whose text was shown last
        as its context, then the held ids (their text returned if they complete it). Not while
        that text ends in a broken character: the stream would take the context for held ids,
        and without it a decoder that drops a leading space would drop the next one; the window
        goes on until its text moves past it."""
        if self._native is None or self._stream is not None:
            return ""
        if self._read and self._context().endswith(REPLACEMENT):
            return ""
        stream = self._native(skip_special_tokens=self._skip, ids=self._ids[: self._read])
        held = self._ids[self._read :]
        text = None
        if held:
            try:
                text = stream.step(self._tok, held)
            except Exception:  # as in ``_advance``: the window goes on
                return ""
        self._stream = stream
        if text is None:
            return ""
        del self._ids[: self._read]
        self._read, self._before = len(self._ids), None
        return str(text)

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
        if self._native is not None:
            self._stream = self._native(skip_special_tokens=self._skip)
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


class Piece(NamedTuple):
    """What one step of the engine's output becomes: text to show, and whether it ended the
    choice (``finish_reason`` "stop", with the string or token that matched). A named tuple: one
    is made for every chunk an engine streams."""

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
        stop_ids = self._stop_ids
        if stop_ids and not stop_ids.isdisjoint(ids):
            cut = next(i for i, t in enumerate(ids) if t in stop_ids)
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
