"""Llama 3.x JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}`` (``arguments``
is taken too), optionally after ``<|python_tag|>``, several separated by ``;``.

Whether the answer is calls is decided by its start: a ``{`` (or the tag) begins calls, anything
else is plain content. Each call is let out once its JSON object is whole; a JSON object that is
not a call (or not JSON, nested deeper than ``MAX_DEPTH``, longer than ``MAX_CALL_CHARS``), or
text after the calls, is content, from there to the end.

The text is read once as it comes: what separates the calls (whitespace, ``;``, the tag) by a small
state machine, each object by ``JsonScan`` up to its closing brace, where it is parsed once. Pure.
"""

from __future__ import annotations

from prefixgate.gateway.toolcalls.base import Event, Text, as_call, whole
from prefixgate.gateway.toolcalls.scan import MAX_CALL_CHARS, Held, JsonScan, loads, match_tag, skip_ws

TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")

# Where the text between calls is, as ``lstrip().lstrip(";").lstrip()``, an optional tag and
# whitespace, then ``{``: before the semicolons, in them, after them, in a tag (``_tag`` its
# characters matched), after a tag, in what may be a second tag (content if it is one).
_LEAD, _SEMIS, _AFTER, _IN_TAG, _TAGGED, _TAG_AGAIN = range(6)


class Llama3Parser:
    def __init__(self) -> None:
        self._mode = ""  # "" undecided, "calls", "text"
        self._held = Held()  # the text since the last call: content, if no call follows
        self._where = _LEAD  # in the text between calls
        self._tag = 0  # characters of TAG matched (deciding, and between calls)
        self._json: JsonScan | None = None  # in a call's object, from held position ``_from``
        self._from = 0

    def _text(self, rest: str = "") -> list[Event]:
        text = self._held.take() + rest
        return [Text(text)] if text else []

    def _match_tag(self, text: str, i: int) -> tuple[int, bool | None]:
        """Go on matching TAG at ``text[i:]``: (where it stopped, True whole / False not it /
        None not known yet)."""
        i, self._tag, whole = match_tag(TAG, self._tag, text, i)
        return i, whole

    def _decide(self, text: str) -> str | None:
        """Read the start of the answer; the text to go on with in the mode it settles on (None:
        not known yet)."""
        i = 0
        if not self._tag:
            i = skip_ws(text)
            if i == len(text):
                self._held.add(text)
                return None
            if text[i] != "<":
                self._mode = "calls" if text[i] == "{" else "text"
                return self._held.take() + text
        i, tagged = self._match_tag(text, i)
        if tagged is None:
            self._held.add(text)
            return None
        if not tagged:
            self._mode = "text"
            return self._held.take() + text
        self._held, self._tag, self._mode = Held(), 0, "calls"  # the tag and what led to it are not content
        return text[i:]

    def _between(self, text: str, i: int) -> tuple[int, str]:
        """Go on through the text between calls: (where, "call" a ``{`` is there / "text" not a
        call / "" not known yet)."""
        n = len(text)
        while i < n:
            if self._where in (_IN_TAG, _TAG_AGAIN):
                i, tagged = self._match_tag(text, i)
                if tagged is None:
                    continue
                if not tagged or self._where == _TAG_AGAIN:
                    return i, "text"
                self._where, self._tag = _TAGGED, 0
                continue
            j = skip_ws(text, i)
            if j > i:
                if self._where == _SEMIS:
                    self._where = _AFTER
                i = j
                continue
            c = text[i]
            if c == ";" and self._where in (_LEAD, _SEMIS):
                self._where = _SEMIS
                i += 1
            elif c == "{":
                return i, "call"
            elif c == "<":
                self._where = _TAG_AGAIN if self._where == _TAGGED else _IN_TAG
            else:
                return i, "text"
        return n, ""

    def _calls(self, text: str) -> list[Event]:
        out: list[Event] = []
        i = 0
        while i < len(text):
            if self._json is None:
                j, what = self._between(text, i)
                if what == "text":
                    self._mode = "text"
                    return [*out, *self._text(text[i:])]
                self._held.add(text[i:j])
                i = j
                if what == "call":
                    self._json, self._from = JsonScan(), self._held.size
                continue
            j, what = self._json.scan(text, i)
            self._held.add(text[i:j])
            i = j
            if self._held.size - self._from > MAX_CALL_CHARS or what == "deep":
                self._mode = "text"
                return [*out, *self._text(text[i:])]
            if what != "close":
                continue
            held = self._held.text()
            try:
                call = as_call(loads(held[self._from :]), args_keys=ARGS_KEYS)
            except ValueError:
                call = None
            if call is None:  # not a call (not JSON at all: never one, whatever follows)
                self._mode = "text"
                return [*out, *self._text(text[i:])]
            out.extend(whole(call))
            self._held, self._json, self._where = Held(), None, _LEAD
        return out

    def feed(self, text: str) -> list[Event]:
        if not self._mode:
            rest = self._decide(text)
            if rest is None:
                return []
            text = rest
        if self._mode == "text":
            return [Text(text)] if text else []
        return self._calls(text)

    def finish(self) -> list[Event]:
        self._mode, self._json = "text", None
        return self._text()
