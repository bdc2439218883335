"""Incremental scanning the parsers share, so a streamed answer costs time in proportion to its
length: each piece of text is looked at once, whatever the number of pieces.

``JsonScan`` follows a JSON value as it is written (bracket depth outside strings, the string and
escape state carried from piece to piece) and says where it closes; the value is parsed once,
then. ``Held`` keeps the text of a call still undecided as its pieces, joined once when read.
``Finder`` finds a marker in text that comes piece by piece. ``loads`` is ``json.loads`` that
refuses nesting deeper than ``MAX_DEPTH`` (a ``ValueError``, never a ``RecursionError``).

The bounds: a call nested deeper than ``MAX_DEPTH`` or longer than ``MAX_CALL_CHARS`` is not
taken as a call; its text is content, as any text that is not a call. Pure.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 256  # brackets a call may nest (far below the recursion limits of json and ast)
MAX_CALL_CHARS = 1 << 22  # characters of one call held whole before it is known to be one

_STRING_STOPS = re.compile(r'["\\]')
_WS = re.compile(r"\s*")


def skip(pattern: re.Pattern[str], text: str, i: int = 0) -> int:
    """Where the run of ``pattern`` at ``text[i:]`` ends."""
    m = pattern.match(text, i)
    return m.end() if m else i


def skip_ws(text: str, i: int = 0) -> int:
    """Where the whitespace at ``text[i:]`` ends (``str.isspace`` whitespace, as ``strip``)."""
    return skip(_WS, text, i)


class JsonScan:
    """Where a JSON value written piece by piece ends. ``stop``: characters outside strings to
    report (a marker's first character); ``limit``: the depth past which it reports ``deep``
    (None: count on, for text that is passed on as it is and never parsed)."""

    __slots__ = ("_stops", "depth", "esc", "in_str", "limit")

    def __init__(self, stop: str = "", limit: int | None = MAX_DEPTH) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.limit = limit
        self._stops = re.compile("[" + re.escape('"{}[]' + stop) + "]")

    def scan(self, text: str, i: int = 0) -> tuple[int, str]:
        """Go on through ``text`` from ``i``: ``(j, "close")`` the value ended just before ``j``;
        ``(j, "stop")`` a stop character at ``j``; ``(j, "deep")`` nesting passed the limit just
        before ``j``; ``(len(text), "")`` not ended yet."""
        n = len(text)
        while i < n:
            if self.in_str:
                if self.esc:
                    self.esc = False
                    i += 1
                    continue
                m = _STRING_STOPS.search(text, i)
                if m is None:
                    return n, ""
                i = m.end()
                if text[i - 1] == "\\":
                    self.esc = True
                    continue
                self.in_str = False
                if self.depth <= 0:  # a string standing alone
                    return i, "close"
                continue
            m = self._stops.search(text, i)
            if m is None:
                return n, ""
            c = text[m.start()]
            i = m.end()
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
                if self.limit is not None and self.depth > self.limit:
                    return i, "deep"
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i, "close"
            else:
                return i - 1, "stop"
        return n, ""


def too_deep(text: str, start: int = 0) -> bool:
    """Whether the JSON text from ``start`` nests deeper than ``MAX_DEPTH`` anywhere."""
    scan = JsonScan()
    i = start
    while i < len(text):
        i, what = scan.scan(text, i)
        if what == "deep":
            return True
        scan.depth = max(scan.depth, 0)  # a value closed: go on with what follows
    return False


def loads(text: str) -> Any:
    """``json.loads``, with nesting past ``MAX_DEPTH`` a ``ValueError`` as any invalid JSON."""
    if too_deep(text):
        raise ValueError("JSON nested too deep")
    try:
        return json.loads(text)
    except RecursionError as e:  # not reached under MAX_DEPTH; kept so a parser never raises
        raise ValueError("JSON nested too deep") from e


class Held:
    """Text kept whole until a decision, as its pieces; ``size`` is its length."""

    __slots__ = ("_parts", "size")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.size = 0

    def add(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self.size += len(text)

    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def take(self) -> str:
        """The text, emptied."""
        text = self.text()
        self._parts, self.size = [], 0
        return text


class Finder:
    """The first place ``marker`` occurs in text given piece by piece, counted from the start of
    the first piece; only the last ``len(marker) - 1`` characters are looked at twice."""

    __slots__ = ("_seen", "_tail", "marker")

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._seen = 0
        self._tail = ""

    def push(self, text: str) -> int:
        """Where the marker starts, once ``text`` completes it; -1 while it has not occurred."""
        window = self._tail + text
        i = window.find(self.marker)
        if i >= 0:
            return self._seen - len(self._tail) + i
        self._seen += len(text)
        keep = len(self.marker) - 1
        self._tail = window[-keep:] if keep else ""
        return -1


def match_tag(tag: str, matched: int, text: str, i: int) -> tuple[int, int, bool | None]:
    """Go on matching ``tag``, of which ``matched`` characters were seen, at ``text[i:]``: (where
    it stopped, characters matched now, True whole / False not it / None not known yet)."""
    k = min(len(tag) - matched, len(text) - i)
    if text[i : i + k] != tag[matched : matched + k]:
        return i, matched, False
    matched += k
    return i + k, matched, (True if matched == len(tag) else None)
