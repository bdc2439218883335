"""Mistral tool calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

Text before the marker is content; the JSON array after it is the calls, let out once it is
whole; text after it is content. A value after the marker that is not an array of calls is
content, marker and all; one that is not JSON (or nested deeper than ``MAX_DEPTH``, or longer
than ``MAX_CALL_CHARS``) makes the rest of the answer content. ``[TOOL_CALLS]`` is a control
token in Mistral's tokenizers: the output reaches the parser decoded with special tokens shown
when a parser is in use.

The text is read once as it comes: the value by ``JsonScan`` up to where it closes, parsed once
there; a bare number or literal by the JSON decoder on its first characters. Pure.
"""

from __future__ import annotations

import json

from prefixgate.gateway.toolcalls.base import Call, Event, Text, as_call, partial_suffix, whole
from prefixgate.gateway.toolcalls.scan import MAX_CALL_CHARS, Held, JsonScan, loads, skip_ws

MARKER = "[TOOL_CALLS]"
# A number or literal is told from text that is not JSON within its first characters (no JSON
# literal has a proper prefix longer than "-Infinit").
_SCALAR = 16


class MistralParser:
    def __init__(self) -> None:
        self._buf = ""  # out of the calls: at most a marker's start
        self._phase = "out"  # out | ws (after the marker) | value | scalar | dead (all content)
        self._held = Held()  # the text after the marker
        self._scalar = ""  # the start of a bare value
        self._json = JsonScan()

    def _dead(self, out: list[Event], rest: str) -> list[Event]:
        """Not JSON: the marker and all that follows it are content."""
        self._phase = "dead"
        out.append(Text(MARKER + self._held.take() + self._scalar + rest))
        self._scalar = ""
        return out

    def _value(self, out: list[Event]) -> bool:
        """The value after the marker, closed: its calls, or content; False: not JSON."""
        held = self._held.text()
        try:
            value = loads(held[skip_ws(held) :])
        except ValueError:
            return False
        self._held.take()
        calls = [as_call(v) for v in value] if isinstance(value, list) and value else [None]
        if any(c is None for c in calls):
            out.append(Text(MARKER + held))
        else:
            out.extend(e for c in calls if isinstance(c, Call) for e in whole(c))
        return True

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._phase == "out":
                buf, text = self._buf + text, ""
                i = buf.find(MARKER)
                if i < 0:
                    keep = partial_suffix(buf, MARKER)
                    shown, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
                    return [*out, Text(shown)] if shown else out
                if i:
                    out.append(Text(buf[:i]))
                self._buf, text, self._phase = "", buf[i + len(MARKER) :], "ws"
                continue
            if not text:
                return out
            if self._phase == "dead":
                return [*out, Text(text)]
            if self._phase == "ws":
                j = skip_ws(text)
                self._held.add(text[:j])
                text = text[j:]
                if text:
                    self._phase = "value" if text[0] in '[{"' else "scalar"
                    self._json = JsonScan()
                continue
            if self._phase == "scalar":
                head = self._scalar + text
                try:
                    _, end = json.JSONDecoder().raw_decode(head[:_SCALAR])
                except ValueError:
                    if len(head) >= _SCALAR:
                        return self._dead(out, text)
                    self._scalar = head
                    return out
                out.append(Text(MARKER + self._held.take() + head[:end]))
                self._scalar, self._phase, text = "", "out", head[end:]
                continue
            j, what = self._json.scan(text)
            self._held.add(text[:j])
            text = text[j:]
            if what == "deep" or self._held.size > MAX_CALL_CHARS:
                return self._dead(out, text)
            if what != "close":
                return out
            if not self._value(out):
                return self._dead(out, text)
            self._phase = "out"

    def finish(self) -> list[Event]:
        out = self.feed("")
        rest = self._held.take() + self._scalar
        if self._phase == "out" and self._buf:
            out.append(Text(self._buf))
        elif self._phase != "dead" and rest:
            out.append(Text(MARKER + rest))
        self._buf, self._scalar, self._phase = "", "", "out"
        return out
