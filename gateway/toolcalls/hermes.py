"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Any number of calls, anywhere in the answer; the text outside them is content. A call starts as
soon as its name and the opening brace of its arguments are out; its arguments then stream as
the model writes them (the JSON object's own text, scanned string-aware, so a brace or a marker
inside a string does not end it), up to the brace that closes them (or the end marker, when the
model breaks off). A block in another shape (arguments before the name, arguments as a string) is
taken whole at its end marker; a block whose JSON is not a call stays content, markers and all,
so nothing is lost. A call left unclosed at the end is taken when its JSON is whole.

Each piece of text is looked at once: the head (up to the brace opening the arguments) is matched
as it comes, the arguments scanned with their string state carried over, and a block held whole
is searched for the end marker only where it grew. A block held whole that is nested deeper than
``MAX_DEPTH`` or longer than ``MAX_CALL_CHARS`` is content (streamed as it comes, once it is that
long). Pure.
"""

from __future__ import annotations

import json
import re

from prefixgate.gateway.toolcalls.base import (
    CallArgs,
    CallStart,
    Event,
    Text,
    as_call,
    first_json,
    partial_suffix,
    whole,
)
from prefixgate.gateway.toolcalls.scan import MAX_CALL_CHARS, Finder, Held, JsonScan, loads, skip_ws

START = "<tool_call>"
END = "</tool_call>"
# the head, as the pattern ``\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{``:
# the literals in order, whitespace allowed before each, the name's string in the middle
_LITERALS = ("{", '"name"', ":", "", ",", '"arguments"', ":", "{")
_NAME = _LITERALS.index("")
_NAME_STOPS = re.compile(r'["\\]')


class _Head:
    """The head of a block in the streaming shape, matched as it comes: ``push`` gives where in
    the piece the brace opening the arguments is, once it is there; ``failed`` once the block
    cannot be in that shape."""

    __slots__ = ("_esc", "_name", "_off", "_quoted", "_step", "failed")

    def __init__(self) -> None:
        self.failed = False
        self._step = 0  # which of _LITERALS is being matched
        self._off = 0  # characters of it matched
        self._quoted = False  # inside the name's string
        self._esc = False  # just after a backslash in the name
        self._name: list[str] = []

    def push(self, text: str) -> int:
        i, n = 0, len(text)
        while i < n and not self.failed:
            if self._step == _NAME:
                i = self._name_part(text, i)
                continue
            lit = _LITERALS[self._step]
            if self._off == 0:
                i = skip_ws(text, i)
                if i == n:
                    break
            if text[i] != lit[self._off]:
                self.failed = True
                break
            self._off += 1
            i += 1
            if self._off == len(lit):
                if self._step == len(_LITERALS) - 1:
                    return i - 1
                self._step, self._off = self._step + 1, 0
        return -1

    def _name_part(self, text: str, i: int) -> int:
        if not self._quoted:
            i = skip_ws(text, i)
            if i < len(text):
                self._quoted = text[i] == '"'
                self.failed = not self._quoted
                i += 1
            return i
        if self._esc:  # a backslash takes any character but a newline
            self._esc = False
            self.failed = text[i] == "\n"
            self._name.append(text[i])
            return i + 1
        m = _NAME_STOPS.search(text, i)
        if m is None:
            self._name.append(text[i:])
            return len(text)
        self._name.append(text[i : m.start()])
        if text[m.start()] == "\\":
            self._esc = True
            self._name.append("\\")
        else:
            self._step, self._off = self._step + 1, 0
        return m.end()

    def name(self) -> str | None:
        """The name, decoded (None: not a JSON string, or empty)."""
        try:
            name = json.loads('"' + "".join(self._name) + '"')
        except ValueError:
            return None
        return name if isinstance(name, str) and name else None


class HermesParser:
    def __init__(self, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self._buf = ""  # text not looked at yet (out of a block: at most a marker's start)
        # out | head (before the name) | block (not in the streaming shape: held to the end
        # marker) | args (streaming them) | tail | spill (a block too long: content)
        self._phase = "out"
        self._held = Held()  # the block's text, in head and block
        self._find = Finder(end)  # the end marker in the held block
        self._head = _Head()
        self._json = JsonScan(stop="<", limit=None)  # the streamed arguments are never parsed

    def _block(self, body: str, closed: bool) -> list[Event]:
        call = None
        if len(body) <= MAX_CALL_CHARS:
            try:
                call = as_call(loads(body))
            except ValueError:
                call = None
        if call is not None:
            return whole(call)
        return [Text(self.start + body + (self.end if closed else ""))]

    def _take(self, out: list[Event]) -> bool:
        """The next piece of a block held whole (head, block); False: wait for more text."""
        piece, self._buf = self._buf, ""
        before = self._held.size
        self._held.add(piece)
        brace = self._head.push(piece) if self._phase == "head" else -1
        j = self._find.push(piece)
        if brace >= 0:
            at = before + brace
            name = self._head.name() if at <= MAX_CALL_CHARS else None
            if name is not None and (j < 0 or j + len(self.end) > at):  # no end marker in the head
                out.append(CallStart(name))
                self._phase, self._buf, self._held = "args", piece[brace:], Held()
                self._json = JsonScan(stop="<", limit=None)
                return True
            self._phase = "block"
        elif self._head.failed:
            self._phase = "block"
        if j >= 0:
            body = self._held.take()
            out.extend(self._block(body[:j], True))
            self._buf, self._phase = body[j + len(self.end) :], "out"
            return True
        if self._held.size > MAX_CALL_CHARS:  # too long to be a call: content, from now on as it comes
            body = self._held.take()
            keep = len(self.end) - 1  # may begin the end marker
            out.append(Text(self.start + body[:-keep]))
            self._buf, self._phase = body[-keep:], "spill"
            return True
        return False

    def _scan(self) -> tuple[int, str]:
        """How much of the buffer is arguments, and what ended them: "" (nothing yet), "closed"
        (their object closed), "end" (the end marker came first)."""
        buf, i = self._buf, 0
        while True:
            i, what = self._json.scan(buf, i)
            if what == "close":
                return i, "closed"
            if what != "stop":
                return i, ""
            if buf.startswith(self.end, i):
                return i, "end"
            if len(buf) - i < len(self.end) and self.end.startswith(buf[i:]):
                return i, ""  # maybe the end marker: wait (scanning resumes at '<')
            i += 1

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._phase == "out":
                i = self._buf.find(self.start)
                if i < 0:
                    keep = partial_suffix(self._buf, self.start)
                    shown = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(shown) :]
                    if shown:
                        out.append(Text(shown))
                    return out
                if i:
                    out.append(Text(self._buf[:i]))
                self._buf = self._buf[i + len(self.start) :]
                self._phase, self._held, self._find, self._head = "head", Held(), Finder(self.end), _Head()
            elif self._phase in ("head", "block"):
                if not self._buf or not self._take(out):
                    return out
            elif self._phase == "args":
                n, ended = self._scan()
                if n:
                    out.append(CallArgs(self._buf[:n]))
                self._buf = self._buf[n:]
                if not ended:
                    return out
                if ended == "end":
                    self._buf = self._buf[len(self.end) :]
                self._phase = "out" if ended == "end" else "tail"
            elif self._phase == "spill":  # content up to and with the end marker
                j = self._buf.find(self.end)
                if j >= 0:
                    out.append(Text(self._buf[: j + len(self.end)]))
                    self._buf, self._phase = self._buf[j + len(self.end) :], "out"
                    continue
                keep = partial_suffix(self._buf, self.end)
                shown, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                if shown:
                    out.append(Text(shown))
                return out
            else:  # tail: what follows the arguments up to the end marker is not shown
                j = self._buf.find(self.end)
                if j < 0:
                    keep = partial_suffix(self._buf, self.end)
                    self._buf = self._buf[len(self._buf) - keep :] if keep else ""
                    return out
                self._buf = self._buf[j + len(self.end) :]
                self._phase = "out"

    def finish(self) -> list[Event]:
        out = self.feed("")
        buf, phase, body = self._buf, self._phase, self._held.take()
        self._buf, self._phase = "", "out"
        if phase in ("out", "spill"):
            return [*out, Text(buf)] if buf else out
        if phase not in ("head", "block"):
            return out  # a call broken off: it stands with the arguments it has
        found = first_json(body)
        if found is not None and not body[found[1] :].strip():
            call = as_call(found[0])
            if call is not None:
                return [*out, *whole(call)]
        return [*out, Text(self.start + body)]
