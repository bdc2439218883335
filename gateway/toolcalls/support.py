"""Whether the gateway serves a chat's tools itself, and how: the parser, the tools the template
renders, and the engine features left for the nodes.

The gateway can serve tools when it renders the chat (an engine tokenizer with the model's own
template, ``gateway.tokens``) and that template reads ``tools``, and a parser is set
(``tool_call_parser``) or read from the template (``detect``). Then the model's text is parsed
back into ``tool_calls`` by the gateway, and no node needs to know about tools. Otherwise the
request keeps its ``tools`` need and nodes that do not serve it refuse it, as before.

``tool_choice`` as SGLang treats it: ``none`` renders the template without the tools and parses
nothing; ``auto`` (or absent) renders them and parses the answer. ``required`` and a named
function also constrain the output to calls in the parser's format (``forcing``): the request
then needs constrained decoding (``response_format`` among the node features, asked for by the
field ``tool_choice``), and where the parser's format cannot be forced it gets a 400 naming
``tool_choice`` rather than an answer that may carry no call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any

from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.records import record
from prefixgate.gateway.toolcalls.detect import detect_parser, mentions_tools
from prefixgate.gateway.toolcalls.forcing import forceable, forced_calls
from prefixgate.openai.constraint import Constraint
from prefixgate.openai.features import Feature, refusal


@record
class ToolPlan:
    parser: str = ""  # "" : the gateway parses nothing
    tools: list[Any] | None = None  # what the template renders
    needs: dict[Feature, str] = field(default_factory=dict)  # engine features left for the nodes
    constraint: Constraint | None = None  # the calls ``tool_choice`` forces


def template_sources(tokenizer: object) -> Mapping[str, str]:
    """The chat template texts of an engine tokenizer, by name ({} for any other tokenizer)."""
    template = getattr(tokenizer, "template", None)
    sources = getattr(template, "sources", None)
    return sources if isinstance(sources, Mapping) else {}


_KNOWN: weakref.WeakKeyDictionary[Any, dict[str, str | None]] = weakref.WeakKeyDictionary()


def gateway_parser(tokenizer: object, setting: str) -> str | None:
    """The parser the gateway uses for this tokenizer's chats, None when it cannot serve tools
    (read once per tokenizer and setting: the template does not change)."""
    try:
        known = _KNOWN.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable: read every time
        known = {}
    if setting not in known:
        known[setting] = _parser_for(tokenizer, setting)
    return known[setting]


def _parser_for(tokenizer: object, setting: str) -> str | None:
    if setting == "none" or not hasattr(tokenizer, "encode_chat"):
        return None
    sources = template_sources(tokenizer)
    source = sources.get("tool_use") or sources.get("default") or next(iter(sources.values()), "")
    if not mentions_tools(source):
        return None
    return setting or detect_parser(source)


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    needs: dict[Feature, str],
    tokenizer: object,
    setting: str,
) -> ToolPlan:
    """How a chat request's tools are served (see the module docstring)."""
    if not tools:
        return ToolPlan("", tools, needs)
    parser = gateway_parser(tokenizer, setting)
    if parser is None:
        return ToolPlan("", tools, needs)
    rest: dict[Feature, str] = {f: p for f, p in needs.items() if f != Feature.TOOLS}
    if tool_choice == "none":
        return ToolPlan("", None, rest)
    if tool_choice not in (None, "auto"):
        what = "'required'" if tool_choice == "required" else "a named function"
        if not forceable(parser):
            raise InvalidRequest(
                f"'tool_choice' {what} cannot be forced in the {parser} tool-call format; use 'auto'",
                param="tool_choice",
                code="unsupported_parameter",
            )
        if Feature.RESPONSE_FORMAT in rest:
            raise InvalidRequest(
                f"'tool_choice' {what} and 'response_format' cannot be combined: each constrains the answer",
                param="tool_choice",
            )
        rest[Feature.RESPONSE_FORMAT] = "tool_choice"
        return ToolPlan(parser, tools, rest, forced_calls(tools, tool_choice, parser))
    return ToolPlan(parser, tools, rest)


def passing_through(nodes: Iterable[Any]) -> set[str]:
    """Ids of the nodes that take the OpenAI request whole (``Capabilities.openai_body``): the
    gateway neither renders their prompt nor sees their tool calls, so a request whose tools the
    gateway serves is not sent to them; a 400 when no other node is left."""
    nodes = list(nodes)
    whole = {n.id for n in nodes if n.client.capabilities.openai_body}
    if nodes and len(whole) == len(nodes):
        raise InvalidRequest(refusal(Feature.TOOLS, "OpenAI-compatible HTTP workers"), param="tools")
    return whole
