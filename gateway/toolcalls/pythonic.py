"""Pythonic tool calls (Llama 3.2 / Llama 4 style): ``[get_weather(city="Paris"), now()]``,
optionally inside ``<|python_start|>...<|python_end|>``.

Decided by the start of the answer: ``[`` followed by a name begins calls. The list is parsed
with ``ast`` (never evaluated) at the first ``]`` that closes a list of calls whose arguments are
all literals; text after it is content. An answer that starts so but never closes such a list is
content. Pure.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from prefixgate.gateway.toolcalls.base import Call, Event, Text, whole

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
_OPENING = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")
_MAYBE = re.compile(r"\[\s*[A-Za-z_]?[A-Za-z0-9_.]*\s*$")


def _calls(src: str) -> list[Call] | None:
    try:
        tree = ast.parse(src.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out: list[Call] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, SyntaxError, TypeError, RecursionError):
                return None
        try:
            out.append(Call(name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):
            return None
    return out


class PythonicParser:
    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "" undecided, "calls", "text"
        self._scanned = 0  # where the search for a closing ']' goes on

    def _decide(self) -> bool:
        s = self._buf.lstrip()
        if START_TAG.startswith(s) and s != START_TAG:
            return False
        if s.startswith(START_TAG):
            s = s[len(START_TAG) :].lstrip()
        if _OPENING.match(s):
            self._buf, self._mode = s, "calls"
            return True
        if not s or _MAYBE.fullmatch(s):
            return False
        self._mode = "text"
        return True

    def _text(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        return [Text(buf)] if buf else []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if not self._mode and not self._decide():
            return []
        if self._mode == "text":
            return self._text()
        while (j := self._buf.find("]", self._scanned)) >= 0:
            self._scanned = j + 1
            calls = _calls(self._buf[: j + 1])
            if calls is not None:
                rest = self._buf[j + 1 :].lstrip()
                rest = rest.removeprefix(END_TAG)
                self._buf, self._mode = rest, "text"
                return [*(e for c in calls for e in whole(c)), *self._text()]
        return []

    def finish(self) -> list[Event]:
        out = self.feed("")
        return [*out, *self._text()]
