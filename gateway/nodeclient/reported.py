"""What an engine reports about a generation, checked at the adapter before the gateway uses it.

Usage counts feed the client's ``usage``, the tenants' billing and the cache-hit accounting, and
the finish reason goes to the client as is; an engine (or something posing as one) can send
anything there. So the adapters read them through these functions, which never raise:

- a token count is an ``int`` in ``[0, MAX_TOKEN_COUNT]`` (a bool is not a count); anything else
  (a list, a string, a negative number, a wrapped ``uint32`` -1) is dropped, as if the engine had
  not reported it, so the gateway's own count stands;
- ``cached_tokens`` is at most the prompt (the engine's count when it gives a sane one, else the
  prompt the gateway sent): more is clamped to it;
- a finish reason is one of OpenAI's; the engines' own words for them are mapped, anything else
  becomes ``stop`` (logged once per value); ``abort`` and ``error`` are not finishes at all, the
  engine gave up on the request (``FAILED``), which the adapters report as the node's failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

from prefixgate.gateway.records import record

log = structlog.get_logger("prefixgate.nodeclient")

# Well past any model's context window (the largest are about 10M tokens) and far below what a
# wrapped unsigned -1 (4294967295) or an overflow gives: above it a count is garbage, not usage.
MAX_TOKEN_COUNT = 1 << 24
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
# The engines' own words (TGI, SGLang's internal reasons, Anthropic-style names) for OpenAI's.
FINISH_ALIASES = {
    "eos": "stop",
    "eos_token": "stop",
    "stop_sequence": "stop",
    "stop_token": "stop",
    "end_turn": "stop",
    "max_tokens": "length",
    "max_length": "length",
    "max_new_tokens": "length",
    "model_length": "length",
    "tool_use": "tool_calls",
}
FAILED = frozenset({"abort", "error"})  # the engine did not finish the answer
UNKNOWN_LOGGED_MAX = 64  # distinct unknown finish reasons logged (then no more: no log flood)
_unknown_logged: set[str] = set()


def count(value: Any) -> int | None:
    """A token count as an engine reported it, or None when it is not a sane one."""
    if type(value) is not int:  # bool, float, str, list, None: not a count
        return None
    if 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None


@record
class Usage:
    """Checked usage counts; None: not reported (or not sane, which the gateway treats alike)."""

    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None


def sane(prompt: Any, completion: Any, cached: Any) -> bool:
    """Whether ``checked`` keeps all three as they are (no ``sent_prompt``): each a count, and
    ``cached`` within ``prompt``. The usual case, told without making a ``Usage``."""
    return (
        type(prompt) is int
        and type(completion) is int
        and type(cached) is int
        and 0 <= cached <= prompt <= MAX_TOKEN_COUNT
        and 0 <= completion <= MAX_TOKEN_COUNT
    )


def checked(prompt: Any, completion: Any, cached: Any, *, sent_prompt: int = 0) -> Usage:
    """``count`` of each, ``cached`` at most the prompt: the engine's count when sane, else
    ``sent_prompt`` (the prompt's tokens as the gateway sent them; 0: not known)."""
    p, c, k = count(prompt), count(completion), count(cached)
    bound = p if p else sent_prompt
    if k is not None and bound and k > bound:
        k = bound
    return Usage(p, c, k)


def openai_usage(usage: Any, *, sent_prompt: int = 0) -> Usage:
    """An OpenAI ``usage`` object (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``), whatever shape it came in."""
    if not isinstance(usage, Mapping):
        return Usage()
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return checked(
        usage.get("prompt_tokens"), usage.get("completion_tokens"), cached, sent_prompt=sent_prompt
    )


def finish_reason(raw: Any, node: str = "") -> str:
    """OpenAI's finish reason for an engine's (``""``: none, the choice goes on; a ``FAILED``
    reason is returned as is for the adapter to fail on)."""
    if raw is None or raw == "":
        return ""
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in FINISH_REASONS or word in FAILED:
            return word
        mapped = FINISH_ALIASES.get(word)
        if mapped is not None:
            return mapped
    shown = (raw if isinstance(raw, str) else repr(raw))[:64]
    if shown not in _unknown_logged and len(_unknown_logged) < UNKNOWN_LOGGED_MAX:
        _unknown_logged.add(shown)
        log.warning("engine_finish_reason_unknown", node=node, finish_reason=shown, relayed="stop")
    return "stop"
