"""Pythonic tool calls (Llama 3.2 / Llama 4 style): ``[get_weather(city="Paris"), now()]``,
optionally inside ``<|python_start|>...<|python_end|>``.

Decided by the start of the answer: ``[`` followed by a name begins calls. The list is parsed
with ``ast`` (never evaluated) once, at the ``]`` that closes it, and taken when it is a list of
calls whose arguments are all literals; what follows it is content, but for ``<|python_end|>``
(however it is split). An answer that starts so but whose list is not such calls (or nests deeper
than ``MAX_DEPTH``, or is longer than ``MAX_CALL_CHARS``) is content.

The text is read once as it comes: the start by a small state machine (the patterns in the
comments below), the list by ``_ListScan``, which follows Python's strings and comments to find
the bracket that closes it. Pure.
"""

from __future__ import annotations

import ast
import json
import re
import string
from typing import Any

from prefixgate.gateway.toolcalls.base import Call, Event, Text, whole
from prefixgate.gateway.toolcalls.scan import MAX_CALL_CHARS, MAX_DEPTH, Held, match_tag, skip, skip_ws

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
# The start of an answer of calls: ``\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(``; while it may still be
# one, ``\[\s*[A-Za-z_]?[A-Za-z0-9_.]*\s*$``. The states between: before the tag, in it, after
# it, just after ``[``, in a name (``_NAME_OK`` one that may be a call's), after the name.
_LEAD, _IN_TAG, _TAGGED, _BRACKET, _NAME_OK, _NAME_NOT, _AFTER_OK, _AFTER_NOT = range(8)
_FIRST = string.ascii_letters + "_"
_NAME_CHARS = _FIRST + string.digits + "."
_NAME_RUN = re.compile(r"[A-Za-z0-9_.]*")
_CODE_STOPS = re.compile(r"""[][(){}"'#]""")
_STRING_STOPS = {q: re.compile("[\\\\\n" + q + "]") for q in "'\""}
_PARSE_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)


def _calls(src: str) -> list[Call] | None:
    try:
        return _calls_of(ast.parse(src.strip(), mode="eval"))
    except _PARSE_ERRORS:  # MemoryError: the parser's own stack, on a too deep expression
        return None


def _calls_of(tree: ast.Expression) -> list[Call] | None:
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
            args[kw.arg] = ast.literal_eval(kw.value)
        out.append(Call(name, json.dumps(args, ensure_ascii=False)))
    return out


class _ListScan:
    """Where a Python list written piece by piece closes: bracket depth outside strings (single,
    double, triple quoted; a backslash escapes the next character) and comments."""

    __slots__ = ("_quote", "depth")

    def __init__(self) -> None:
        self.depth = 0
        self._quote = ""  # "" in code, "#" in a comment, else the quote that ends the string

    def scan(self, text: str, i: int = 0) -> tuple[int, str]:
        """``(j, "close")`` the list closed just before ``j``; ``(j, "deep")`` nesting passed
        ``MAX_DEPTH``; ``(j, "")`` not yet, ``text[j:]`` (a quote or backslash whose meaning the
        next characters decide) to be given again with what follows."""
        n = len(text)
        while i < n:
            q = self._quote
            if q == "#":
                j = text.find("\n", i)
                if j < 0:
                    return n, ""
                self._quote, i = "", j + 1
            elif q:
                m = _STRING_STOPS[q[0]].search(text, i)
                if m is None:
                    return n, ""
                k = m.start()
                c = text[k]
                if c == "\\":
                    if k + 1 >= n:
                        return k, ""
                    i = k + 2
                elif c == "\n" and len(q) == 1:  # not a string: the parse will say so
                    self._quote, i = "", k + 1
                elif c == "\n":
                    i = k + 1
                elif len(q) == 3 and k + 3 > n:
                    return k, ""
                elif text.startswith(q, k):
                    self._quote, i = "", k + len(q)
                else:
                    i = k + 1
            else:
                m = _CODE_STOPS.search(text, i)
                if m is None:
                    return n, ""
                k = m.start()
                c = text[k]
                if c in "([{":
                    self.depth += 1
                    if self.depth > MAX_DEPTH:
                        return k + 1, "deep"
                    i = k + 1
                elif c in ")]}":
                    self.depth -= 1
                    if self.depth <= 0:
                        return k + 1, "close"
                    i = k + 1
                elif c == "#":
                    self._quote, i = "#", k + 1
                elif k + 3 > n:
                    return k, ""  # one quote, two (empty) or three (triple)?
                elif text.startswith(c * 3, k):
                    self._quote, i = c * 3, k + 3
                elif text[k + 1] == c:
                    i = k + 2
                else:
                    self._quote, i = c, k + 1
        return n, ""


class PythonicParser:
    def __init__(self) -> None:
        self._mode = ""  # "" undecided, "calls", "text", "after" (the calls: an end tag may follow)
        self._held = Held()  # undecided: all of it; calls: the list from its '['
        self._state = _LEAD
        self._tag = 0  # characters of a tag matched
        self._bracket = 0  # undecided: where the '[' is in what is held
        self._list = _ListScan()
        self._carry = ""  # the end of the list's text the scan looks at again

    def _match(self, tag: str, text: str, i: int) -> tuple[int, bool | None]:
        i, self._tag, whole = match_tag(tag, self._tag, text, i)
        return i, whole

    def _decide(self, text: str) -> str | None:
        """Read the start of the answer: the text to go on with in the mode it settles on (None:
        not known yet)."""
        i, n, state = 0, len(text), self._state
        while i < n:
            if state == _IN_TAG:
                i, tagged = self._match(START_TAG, text, i)
                if tagged is None:
                    break
                if not tagged:
                    return self._settle("text", text)
                state, self._tag = _TAGGED, 0
                continue
            if state in (_NAME_OK, _NAME_NOT):
                i = skip(_NAME_RUN, text, i)
                if i == n:
                    break
            j = skip_ws(text, i)
            if j > i:
                i = j
                if state in (_NAME_OK, _NAME_NOT):
                    state = _AFTER_OK if state == _NAME_OK else _AFTER_NOT
                continue
            c = text[i]
            if state == _LEAD and c == "<":
                state = _IN_TAG
            elif state in (_LEAD, _TAGGED) and c == "[":
                state, self._bracket, i = _BRACKET, self._held.size + i, i + 1
            elif state == _BRACKET and c in _FIRST:
                state, i = _NAME_OK, i + 1
            elif state == _BRACKET and c in _NAME_CHARS:
                state, i = _NAME_NOT, i + 1
            elif state in (_NAME_OK, _AFTER_OK) and c == "(":
                self._state = state
                return self._settle("calls", text)
            else:
                return self._settle("text", text)
        self._state = state
        self._held.add(text)
        return None

    def _settle(self, mode: str, text: str) -> str:
        self._mode = mode
        held = self._held.take() + text
        return held[self._bracket :] if mode == "calls" else held

    def _calls(self, text: str) -> list[Event]:
        """The list, as it comes; once it closes, its calls or (not calls) content."""
        self._held.add(text)
        buf = self._carry + text
        j, what = self._list.scan(buf)
        self._carry = buf[j:] if not what else ""
        size = self._held.size - len(buf) + j  # of the list, up to where the scan is
        if what == "deep" or size > MAX_CALL_CHARS:
            return self._to_text("")
        if what != "close":
            return []
        held = self._held.take()
        calls = _calls(held[:size])
        if calls is None:  # the bracket closing the list ends it: never calls after it
            self._held.add(held)
            return self._to_text("")
        self._mode = "after"
        return [*(e for c in calls for e in whole(c)), *self._after(held[size:])]

    def _after(self, text: str) -> list[Event]:
        """Right after the calls: whitespace, then ``<|python_end|>``, are not content."""
        i = 0 if self._tag else skip_ws(text)
        if i == len(text):
            return []
        at, tagged = self._match(END_TAG, text, i)
        if tagged is None:
            self._held.add(text[i:])  # held while it may be the end tag
            return []
        self._mode = "text"
        rest = text[at:] if tagged else text[i:]
        return self._to_text(rest, keep=not tagged)

    def _to_text(self, rest: str, keep: bool = True) -> list[Event]:
        self._mode, self._tag = "text", 0
        held = self._held.take()
        text = (held if keep else "") + rest
        return [Text(text)] if text else []

    def feed(self, text: str) -> list[Event]:
        if not self._mode:
            rest = self._decide(text)
            if rest is None:
                return []
            text = rest
        if self._mode == "text":
            return [Text(text)] if text else []
        if self._mode == "after":
            return self._after(text)
        return self._calls(text)

    def finish(self) -> list[Event]:
        out = self.feed("")
        return [*out, *self._to_text("")]
