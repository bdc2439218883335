"""Tool calls for engines the gateway tokenizes for: the parsers that turn a model's text back
into OpenAI ``tool_calls``, one module per format, and the choice of parser.

API:

``PARSERS``: the parser names, as vLLM and SGLang name them (``hermes``, ``qwen25``, ``llama3``,
``mistral``, ``pythonic``).
``new_parser(name) -> Shaped``: a fresh parser for one choice (``feed(text)``, ``finish()`` give
``Text``, ``CallStart`` and ``CallArgs`` events).
``detect_parser(template_source) -> str | None``: the parser a chat template's own tool-call
format calls for, when exactly one fits.
``parse_text(name, text) -> (content, calls)``: a whole answer at once.

``support.plan_tools`` decides whether the gateway serves a request's tools (the pipeline calls
it); ``shapes`` turns parsed calls into OpenAI's message and streamed deltas (the responses).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixgate.gateway.toolcalls.base import (
    Call,
    CallArgs,
    CallStart,
    Event,
    FormatParser,
    Shaped,
    Text,
    call_id,
    calls_of,
)
from prefixgate.gateway.toolcalls.detect import detect_parser
from prefixgate.gateway.toolcalls.hermes import HermesParser
from prefixgate.gateway.toolcalls.llama3 import Llama3Parser
from prefixgate.gateway.toolcalls.mistral import MistralParser
from prefixgate.gateway.toolcalls.pythonic import PythonicParser

_FACTORIES: dict[str, Callable[[], FormatParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
PARSERS = tuple(_FACTORIES)


def new_parser(name: str) -> Shaped:
    """A parser for one choice's output; ``KeyError`` for an unknown name."""
    return Shaped(_FACTORIES[name]())


def parse_text(name: str, text: str) -> tuple[str, list[Call]]:
    """``text`` (a whole answer) as its content and its calls."""
    p = new_parser(name)
    events = [*p.feed(text), *p.finish()]
    content = "".join(e.text for e in events if isinstance(e, Text))
    return content, calls_of(events)


__all__ = [
    "PARSERS",
    "Call",
    "CallArgs",
    "CallStart",
    "Event",
    "Shaped",
    "Text",
    "call_id",
    "calls_of",
    "detect_parser",
    "new_parser",
    "parse_text",
]
