"""``tool_choice`` ``required`` or a named function as a constraint: the output is one or more
tool calls in the format the gateway's parser reads, and nothing else.

The constraint is an xgrammar structural tag (``{"type": "structural_tag", "format": ...}``):
each tool is a ``tag`` whose begin is the call's fixed head (marker, name), whose content is the
tool's ``parameters`` JSON schema and whose end closes the call; the calls are
``tags_with_separator`` with ``at_least_one``, so no text comes before, between or after them.
It is what both runtimes take: SGLang and vLLM hand a structural tag to their grammar backend
(xgrammar by default) as is, while an EBNF grammar could not embed the tools' JSON schemas and a
plain JSON schema could not ask for the markers around the call. A named function is the same
with that one tool. Formats that are not JSON between fixed markers (``pythonic``; ``mistral``,
whose marker is a control token a grammar cannot emit) cannot be forced. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.openai.constraint import Constraint


@dataclass(frozen=True, slots=True)
class CallShape:
    """A parser's call: ``head`` (with ``{name}``) + arguments + ``tail``; calls joined by ``separator``."""

    head: str
    tail: str
    separator: str


SHAPES = {
    "hermes": CallShape('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "qwen25": CallShape('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    "llama3": CallShape('{{"name": {name}, "parameters": ', "}", "; "),
}


def forceable(parser: str) -> bool:
    return parser in SHAPES


def _function(tool: Any) -> Mapping[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    return fn if isinstance(fn, Mapping) else {}


def forced_calls(tools: Sequence[Any], tool_choice: Any, parser: str) -> Constraint:
    """The constraint for ``tool_choice`` (``required``, or ``{"type": "function", ...}``),
    given ``tools`` already validated; ``KeyError`` for a parser that cannot be forced."""
    shape = SHAPES[parser]
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    tags = []
    for tool in tools:
        fn = _function(tool)
        name = fn.get("name")
        if not isinstance(name, str) or (named is not None and name != named):
            continue
        params = fn.get("parameters")
        schema = dict(params) if isinstance(params, Mapping) else {"type": "object"}
        tags.append(
            {
                "type": "tag",
                "begin": shape.head.format(name=json.dumps(name, ensure_ascii=False)),
                "content": {"type": "json_schema", "json_schema": schema},
                "end": shape.tail,
            }
        )
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": shape.separator,
        "at_least_one": True,
        "stop_after_first": named is not None,
    }
    tag = {"type": "structural_tag", "format": calls}
    return Constraint("structural_tag", json.dumps(tag, ensure_ascii=False))
