"""The tool-call parser a chat template calls for, read from the template's own text.

A template that renders tool calls writes them in its model's format, so the format's markers
are in its text: ``<tool_call>`` (Hermes, Qwen2.5), ``<|python_tag|>`` (Llama 3.1+ JSON calls),
``[TOOL_CALLS]`` (Mistral), ``<|python_start|>`` (Llama 4 pythonic). Only when exactly one
format's markers are there is it taken; otherwise the ``tool_call_parser`` setting must say. Pure.
"""

from __future__ import annotations

_SIGNS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "pythonic": ("<|python_start|>",),
}


def mentions_tools(source: str) -> bool:
    """Whether a template reads the ``tools`` variable at all (else tools would be dropped)."""
    return "tools" in source


def detect_parser(source: str) -> str | None:
    """The one parser whose markers the template writes, or None."""
    if not mentions_tools(source):
        return None
    found = [name for name, signs in _SIGNS.items() if all(s in source for s in signs)]
    return found[0] if len(found) == 1 else None
