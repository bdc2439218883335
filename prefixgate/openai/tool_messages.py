"""The shape of tool-related parts of a chat request: ``tools``, assistant ``tool_calls`` and
``tool`` messages, each checked before rendering so a malformed one gets a 400 naming its field
(a chat template would otherwise fail on it obscurely, or render something the model never saw
in training). Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefixgate.gateway.core.errors import invalid


def check_tools(tools: list[Any]) -> None:
    """Each tool is ``{"type": "function", "function": {"name": str, "parameters"?: object}}``."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise invalid("each tool must be an object", where)
        if tool.get("type", "function") != "function":
            raise invalid("only tools of type 'function' are supported", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise invalid("a tool needs a 'function' object", f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid("a tool function needs a string 'name'", f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise invalid("'parameters' must be a JSON schema object", f"{where}.function.parameters")


def _check_call(call: Any, where: str) -> None:
    if not isinstance(call, Mapping):
        raise invalid("each tool call must be an object", where)
    if not isinstance(call.get("id"), str):
        raise invalid("a tool call needs a string 'id'", f"{where}.id")
    if call.get("type", "function") != "function":
        raise invalid("a tool call's 'type' must be 'function'", f"{where}.type")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise invalid("a tool call needs a 'function' object", f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid("a tool call's function needs a string 'name'", f"{where}.function.name")
    args = fn.get("arguments")
    if not isinstance(args, str):
        raise invalid("a tool call's 'arguments' must be a JSON string", f"{where}.function.arguments")
    try:
        value = json.loads(args)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise invalid("a tool call's 'arguments' must be a JSON object", f"{where}.function.arguments")


def check_tool_messages(messages: list[Any]) -> None:
    """Assistant ``tool_calls`` and ``tool`` messages (``tool_call_id``) are well formed."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise invalid("only assistant messages carry 'tool_calls'", f"messages[{i}].tool_calls")
            if not isinstance(calls, list):
                raise invalid("'tool_calls' must be an array", f"messages[{i}].tool_calls")
            for j, call in enumerate(calls):
                _check_call(call, f"messages[{i}].tool_calls[{j}]")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise invalid("a tool message needs a string 'tool_call_id'", f"messages[{i}].tool_call_id")


def template_tool_calls(calls: list[Any]) -> list[Any]:
    """Assistant tool calls as chat templates take them: ``arguments`` as an object, not the JSON
    string OpenAI sends (as vLLM and SGLang give them to the template)."""
    out: list[Any] = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        args = fn.get("arguments") if isinstance(fn, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return out
