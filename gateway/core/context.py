"""Which nodes' contexts hold a request, and the one error for a request none holds.

Engines refuse a request longer than their context, each by its own rule: vLLM when the prompt
plus ``max_tokens`` exceeds ``max_model_len``; SGLang when the prompt alone reaches its
``context_length`` (it shortens ``max_new_tokens`` to the room left); our nodes when the prompt
exceeds ``--context-length``. The gateway routes a request only to nodes whose context holds
what the strictest of them would ask (``needed``):

- the prompt plus ``max_tokens``, when the client gave ``max_tokens`` (it asked for that room,
  and it is what vLLM and OpenAI refuse), or when the gateway's default fits on some node;
- else the prompt plus one token: the gateway's default ``max_tokens`` is then lowered to the
  room the chosen nodes leave (``room``), as ``context_window`` lowers it for the gateway's own
  window, so that a long prompt is answered, up to the context, rather than refused.

A node that does not say its context (0) is taken to hold any request; should it refuse one for
length, the request is retried on another node (``gateway.core.execute``). When no node's context
holds the request, the client gets ``exceeded``: a 400 ``context_length_exceeded`` naming the
largest context available, the same words as for the gateway's own limits
(``gateway.core.prepare``).

Pure: numbers in, numbers (or the error) out.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixgate.gateway.core.errors import InvalidRequest

CODE = "context_length_exceeded"


def needed(prompt_tokens: int, max_tokens: int, given: bool, contexts: Iterable[int]) -> int | None:
    """The context a node generating the request must hold, over the contexts of the nodes that
    may generate it (0: one that does not say); None when none holds it."""
    known = list(contexts)
    full = prompt_tokens + max(0, max_tokens)
    if not known or any(c <= 0 or full <= c for c in known):
        return full
    if not given and any(prompt_tokens + 1 <= c for c in known):
        return prompt_tokens + 1
    return None


def room(prompt_tokens: int, max_tokens: int, given: bool, contexts: Iterable[int]) -> int:
    """The ``max_tokens`` to send to nodes of ``contexts``: the client's as it gave it; the
    gateway's default lowered to the room the smallest known context leaves (at least 1)."""
    known = [c for c in contexts if c > 0]
    if given or not known:
        return max_tokens
    return max(1, min(max_tokens, min(known) - prompt_tokens))


def largest(contexts: Iterable[int]) -> int:
    """The largest context known (0: no node says)."""
    return max((c for c in contexts if c > 0), default=0)


def exceeded(
    prompt_tokens: int,
    max_tokens: int,
    limit: int,
    *,
    prompt_param: str,
    max_tokens_param: str = "",
    engine_said: str = "",
) -> InvalidRequest:
    """The client's 400 for a request longer than the largest context available, ``limit``:
    ``max_tokens_param`` names the field that gave ``max_tokens`` when it is what does not fit
    (the prompt alone would); else the prompt's field is named. ``engine_said``: the words of
    the engine that refused it (its own count of the prompt may be larger than the gateway's)."""
    what, param = f"the prompt ({prompt_tokens} tokens)", prompt_param
    if max_tokens_param and prompt_tokens < limit and not engine_said:
        what, param = f"{what} plus {max_tokens_param} ({max_tokens})", max_tokens_param
    message = f"{what} exceeds the largest context available, {limit} tokens"
    if engine_said:
        message += f" (the model server: {engine_said})"
    return InvalidRequest(message, param=param, code=CODE)
