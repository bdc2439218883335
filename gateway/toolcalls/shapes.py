"""Parsed tool calls in OpenAI's shapes: the whole message, and the streamed deltas.

Whole: ``content`` is the text outside the calls (null when there is none and calls were made),
``tool_calls`` the calls with fresh ``call_...`` ids, and ``finish_reason`` is ``tool_calls``
when the model called a tool. Streamed: content deltas as the text is known not to be part of a
call, then for each call a delta with its ``index``, ``id``, ``type`` and ``function.name`` (and
empty arguments) followed by ``function.arguments`` pieces as the model writes them, as OpenAI
streams them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from prefixgate.gateway.toolcalls import Call, CallStart, Event, Text, call_id, new_parser, parse_text

log = structlog.get_logger("prefixgate.toolcalls")


def parser_of(execution: object) -> str:
    """The tool-call parser of a started choice ("" none): its prepared request's, when it has one."""
    parser = getattr(getattr(execution, "prep", None), "tool_parser", "")
    return parser if isinstance(parser, str) else ""


def tool_call(call: Call) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message(parser: str, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole answer, and whether it called tools (a parser that
    fails leaves the answer as its content)."""
    try:
        content, calls = parse_text(parser, text)
    except Exception as e:  # a parser is total; this keeps a bug in one from failing the answer
        log.error("tool_parser_failed", parser=parser, exc_info=e)
        calls = []
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [tool_call(c) for c in calls],
    }, True


def finish_reason(called: bool, reason: str) -> str:
    return "tool_calls" if called and reason in ("stop", "") else reason


class ToolDeltas:
    """One streamed choice: its text in, the chat deltas to send out. Should the parser fail,
    the text from there on is content: the stream goes on to its end."""

    def __init__(self, parser: str) -> None:
        self._name = parser
        self._parser = new_parser(parser)
        self._failed = False
        self.calls = 0

    def _events(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = [Text(text)] if text else []
        if not self._failed:
            events = self._safely(lambda: self._parser.feed(text), events)
        if final and not self._failed:
            events = events + self._safely(self._parser.finish, [])
        return events

    def _safely(self, parse: Callable[[], list[Event]], instead: list[Event]) -> list[Event]:
        try:
            return parse()
        except Exception as e:  # a parser is total; this keeps a bug in one from cutting the stream
            log.error("tool_parser_failed", parser=self._name, exc_info=e)
            self._failed = True
            return instead

    def step(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Deltas for the next text (``final``: the choice ended with it); consecutive pieces of
        the same kind are sent as one delta."""
        events = self._events(text, final)
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Text):
                if out and "content" in out[-1]:
                    out[-1]["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif isinstance(e, CallStart):
                head = {"index": self.calls, "id": call_id(), "type": "function"}
                out.append({"tool_calls": [{**head, "function": {"name": e.name, "arguments": ""}}]})
                self.calls += 1
            elif e.text:
                last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
                if last is not None and "id" not in last:
                    last["function"]["arguments"] += e.text
                else:
                    piece = {"index": self.calls - 1, "function": {"arguments": e.text}}
                    out.append({"tool_calls": [piece]})
        return out

    def finish_reason(self, reason: str) -> str:
        return finish_reason(self.calls > 0, reason)
