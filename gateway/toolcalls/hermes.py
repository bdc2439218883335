"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Any number of calls, anywhere in the answer; the text outside them is content. A call the model
left unclosed at the end is taken when its JSON is whole (the engine stopped on end-of-turn right
after it); a block whose JSON is not a call stays content, markers and all, so nothing is lost.
Pure.
"""

from __future__ import annotations

import json

from prefixgate.gateway.toolcalls.base import Event, Text, as_call, first_json, partial_suffix

START = "<tool_call>"
END = "</tool_call>"


class HermesParser:
    def __init__(self, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self._buf = ""
        self._inside = False

    def _block(self, body: str, closed: bool) -> Event:
        try:
            call = as_call(json.loads(body))
        except ValueError:
            call = None
        if call is not None:
            return call
        return Text(self.start + body + (self.end if closed else ""))

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._inside:
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
                self._inside = True
            j = self._buf.find(self.end)
            if j < 0:
                return out
            out.append(self._block(self._buf[:j], True))
            self._buf = self._buf[j + len(self.end) :]
            self._inside = False

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._inside:
            return [Text(buf)] if buf else []
        self._inside = False
        whole = first_json(buf)
        if whole is not None and not buf[whole[1] :].strip():
            call = as_call(whole[0])
            if call is not None:
                return [call]
        return [Text(self.start + buf)]
