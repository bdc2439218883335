"""What a tool-call parser turns model text into, and the layer every format shares.

A parser is fed the text of one choice as it is decoded and gives events: ``Text`` (content to
show), ``CallStart`` (a tool call's name) and ``CallArgs`` (pieces of its arguments, JSON text
that joined is the arguments object, as OpenAI streams ``function.arguments``). It never
lets out part of a marker: text that may still be the start of a call is held until it is known
not to be. The same parser serves non-streamed answers (fed once), so a stream and a whole answer
of the same output give the same calls, however the text was split. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from prefixgate.gateway.toolcalls.scan import loads, skip_ws, too_deep


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    """A whole tool call (what a finished answer holds)."""

    name: str
    arguments: str  # a JSON object, as a string (as OpenAI sends it)


@dataclass(frozen=True, slots=True)
class CallStart:
    """A new call begins: its name is known; its arguments follow as ``CallArgs`` pieces."""

    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    """The next piece of the current call's arguments (JSON text; joined, the whole object)."""

    text: str


Event = Text | CallStart | CallArgs


def whole(call: Call) -> list[Event]:
    """A call known at once, as its events."""
    return [CallStart(call.name), CallArgs(call.arguments)]


def calls_of(events: list[Event]) -> list[Call]:
    """The calls that ``events`` make, their argument pieces joined."""
    calls: list[tuple[str, list[str]]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append((e.name, []))
        elif isinstance(e, CallArgs) and calls:
            calls[-1][1].append(e.text)
    return [Call(name, "".join(pieces)) for name, pieces in calls]


class FormatParser(Protocol):
    """One format's parser: ``feed`` the decoded text as it comes, ``finish`` at the end."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def call_id() -> str:
    """A fresh id for a tool call, shaped as OpenAI's (``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    i = buf.find(marker[0], max(0, len(buf) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(buf[i:]):
            return len(buf) - i
        i = buf.find(marker[0], i + 1)
    return 0


def as_call(obj: Any, *, args_keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """``{"name": str, "arguments": object}`` (or another key of ``args_keys``) as a ``Call``;
    None when ``obj`` is not shaped so. Arguments given as a JSON string are taken as they are."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args: Any = obj[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def first_json(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends; None while it
    is incomplete, invalid or nested deeper than ``MAX_DEPTH``."""
    start = skip_ws(text)
    if too_deep(text, start):
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return value, end


class Shaped:
    """A format parser with the whitespace policy every format shares: whitespace next to a call
    is not content (so ``"Sure.\\n\\n<tool_call>..."`` has the content ``"Sure."``), held until
    what follows it decides. Counts the calls it let through."""

    def __init__(self, parser: FormatParser) -> None:
        self._parser = parser
        self._pending: list[str] = []  # trailing whitespace not yet shown, as it came
        self._after_call = False  # whitespace right after a call is dropped too
        self.calls = 0

    def _shape(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, CallStart | CallArgs):
                self._pending = []
                self._after_call = True
                self.calls += isinstance(e, CallStart)
                out.append(e)
                continue
            if e.text.isspace() or not e.text:  # decided by what follows: held, not rescanned
                if not self._after_call:
                    self._pending.append(e.text)
                continue
            text = "".join(self._pending) + e.text
            if self._after_call:
                text = text.lstrip()
            body = text.rstrip()
            self._after_call = False
            self._pending = [text[len(body) :]]
            out.append(Text(body))
        return out

    def feed(self, text: str) -> list[Event]:
        return self._shape(self._parser.feed(text)) if text else []

    def finish(self) -> list[Event]:
        out = self._shape(self._parser.finish())
        pending = "".join(self._pending)
        if pending and not self.calls:
            out.append(Text(pending))
        self._pending = []
        return out
