"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Any number of calls, anywhere in the answer; the text outside them is content. A call starts as
soon as its name and the opening brace of its arguments are out; its arguments then stream as
the model writes them (the JSON object's own text, scanned string-aware, so a brace or a marker
inside a string does not end it), up to the brace that closes them (or the end marker, when the
model breaks off). A block in another shape (arguments before the name, arguments as a string) is
taken whole at its end marker; a block whose JSON is not a call stays content, markers and all,
so nothing is lost. A call left unclosed at the end is taken when its JSON is whole. Pure.
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

START = "<tool_call>"
END = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesParser:
    def __init__(self, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self._buf = ""
        self._phase = "out"  # out | head (before the name) | args (streaming them) | tail
        self._depth = 0
        self._in_str = False
        self._esc = False

    def _block(self, body: str, closed: bool) -> list[Event]:
        try:
            call = as_call(json.loads(body))
        except ValueError:
            call = None
        if call is not None:
            return whole(call)
        return [Text(self.start + body + (self.end if closed else ""))]

    def _head(self) -> str | None:
        """The call's name once it and the brace opening its arguments are out (None: not yet,
        or not in this shape)."""
        m = _HEAD.match(self._buf)
        if m is None or m.end() >= len(self._buf) or self._buf[m.end()] != "{":
            return None
        j = self._buf.find(self.end)
        if 0 <= j < m.end():
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        if not isinstance(name, str) or not name:
            return None
        self._buf = self._buf[m.end() :]
        return name

    def _scan(self) -> tuple[int, str]:
        """How much of the buffer is arguments, and what ended them: "" (nothing yet), "closed"
        (their object closed), "end" (the end marker came first)."""
        buf = self._buf
        for i, c in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                continue
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1, "closed"
            elif c == "<":
                rest = buf[i:]
                if rest.startswith(self.end):
                    return i, "end"
                if self.end.startswith(rest):
                    return i, ""  # maybe the end marker: wait (scanning resumes at '<')
        return len(buf), ""

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
                self._phase = "head"
            elif self._phase == "head":
                name = self._head()
                if name is not None:
                    out.append(CallStart(name))
                    self._phase, self._depth, self._in_str, self._esc = "args", 0, False, False
                    continue
                j = self._buf.find(self.end)
                if j < 0:
                    return out
                out.extend(self._block(self._buf[:j], True))
                self._buf = self._buf[j + len(self.end) :]
                self._phase = "out"
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
        buf, phase = self._buf, self._phase
        self._buf, self._phase = "", "out"
        if phase == "out":
            return [*out, Text(buf)] if buf else out
        if phase != "head":
            return out  # a call broken off: it stands with the arguments it has
        found = first_json(buf)
        if found is not None and not buf[found[1] :].strip():
            call = as_call(found[0])
            if call is not None:
                return [*out, *whole(call)]
        return [*out, Text(self.start + buf)]
