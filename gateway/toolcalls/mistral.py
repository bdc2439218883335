"""Mistral tool calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

Text before the marker is content; the JSON array after it is the calls, let out once it is
whole; text after it is content. ``[TOOL_CALLS]`` is a control token in Mistral's tokenizers:
the output reaches the parser decoded with special tokens shown when a parser is in use. Pure.
"""

from __future__ import annotations

from prefixgate.gateway.toolcalls.base import Call, Event, Text, as_call, first_json, partial_suffix, whole

MARKER = "[TOOL_CALLS]"


class MistralParser:
    def __init__(self) -> None:
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        if not self._inside:
            i = self._buf.find(MARKER)
            if i < 0:
                keep = partial_suffix(self._buf, MARKER)
                shown, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return [Text(shown)] if shown else []
            if i:
                out.append(Text(self._buf[:i]))
            self._buf, self._inside = self._buf[i + len(MARKER) :], True
        found = first_json(self._buf)
        if found is None:
            return out
        value, end = found
        calls = [as_call(v) for v in value] if isinstance(value, list) and value else [None]
        self._inside = False
        if any(c is None for c in calls):
            out.append(Text(MARKER + self._buf[:end]))
        else:
            out.extend(e for c in calls if isinstance(c, Call) for e in whole(c))
        self._buf = self._buf[end:]
        return [*out, *self.feed("")]

    def finish(self) -> list[Event]:
        out = self.feed("")
        if self._buf:
            out.append(Text(MARKER + self._buf if self._inside else self._buf))
        self._buf, self._inside = "", False
        return out
