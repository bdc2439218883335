"""Llama 3.x JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}`` (``arguments``
is taken too), optionally after ``<|python_tag|>``, several separated by ``;``.

Whether the answer is calls is decided by its start: a ``{`` (or the tag) begins calls, anything
else is plain content. Each call is let out once its JSON object is whole; a JSON object that is
not a call, or text after the calls, is content. Pure.
"""

from __future__ import annotations

from prefixgate.gateway.toolcalls.base import Event, Text, as_call, first_json, whole

TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3Parser:
    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "" undecided, "calls", "text"
        self._seen_call = False

    def _decide(self) -> bool:
        """Settle the mode from the start of the answer; False while it cannot be told yet."""
        s = self._buf.lstrip()
        if not s or (TAG.startswith(s) and s != TAG):
            return False
        if s.startswith(TAG):
            self._buf = s[len(TAG) :]
            self._mode = "calls"
        else:
            self._mode = "calls" if s.startswith("{") else "text"
        return True

    def _calls(self) -> list[Event]:
        out: list[Event] = []
        while True:
            s = self._buf.lstrip().lstrip(";").lstrip()
            if s.startswith(TAG):
                s = s[len(TAG) :].lstrip()
            if not s or (TAG.startswith(s) and s != TAG):
                return out
            if not s.startswith("{"):
                self._mode = "text"
                return [*out, *self._text()]
            found = first_json(s)
            if found is None:
                return out  # incomplete (or never valid: shown as text at the finish)
            obj, end = found
            call = as_call(obj, args_keys=ARGS_KEYS)
            if call is None:
                self._mode = "text"
                return [*out, *self._text()]
            out.extend(whole(call))
            self._seen_call = True
            self._buf = s[end:]

    def _text(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        return [Text(buf)] if buf else []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if not self._mode and not self._decide():
            return []
        return self._calls() if self._mode == "calls" else self._text()

    def finish(self) -> list[Event]:
        out = self.feed("")
        return [*out, *self._text()]
