"""An engine's refusal of the client's own request, as the client's 400.

When a node answers that the request itself is wrong (gRPC INVALID_ARGUMENT / OUT_OF_RANGE on the
SMG and prefixgate.v1 protocols, HTTP 400/413/422 from an OpenAI-compatible worker), no other node
can serve it either, but for a refusal for length (``too_long``): a node with a larger context may,
and is tried (``gateway.core.execute``). The client gets OpenAI's ``invalid_request_error`` with
the engine's own words, bounded and without internal addresses, and ``code``
``context_length_exceeded`` when the engine says the prompt does not fit its context (the code
OpenAI's clients look for). An engine that
says the request's constraint failed (FAILED_PRECONDITION with trailer ``smg-constraint-failed``)
gives a 422 naming the field that asked for the constraint.
"""

from __future__ import annotations

import re

from prefixgate.gateway.core.errors import InvalidRequest, Unprocessable
from prefixgate.gateway.nodeclient import NodeFailure
from prefixgate.gateway.vocab import FailureKind, Stage

MAX_MESSAGE = 300
# Stages at which a node judged the request (CACHE and PROBE refusals are the gateway's own asks).
JUDGED = frozenset({Stage.GENERATE, Stage.PREFILL, Stage.DECODE})
# SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
# vLLM: "This model's maximum context length is M tokens. However, you requested N tokens ..." and
# "The decoder prompt (length N) is longer than the maximum model length of M."
# Our nodes: "prompt has N tokens, the context holds M".
_CONTEXT = re.compile(
    r"longer than the model's context length|maximum context length|longer than the maximum model"
    r" length|the context holds \d+|context length exceeded|context_length_exceeded",
    re.IGNORECASE,
)
_STATUS_PREFIX = re.compile(r"^(?:[A-Z_]+|HTTP \d{3}):\s*")
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+"  # URLs
    r"|\[[0-9a-f:.]+\](?::\d+)?"  # [ipv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # ipv4[:port]
    r"|\b(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+):\d{2,5}\b",  # host:port
    re.IGNORECASE,
)


def engine_words(error: NodeFailure) -> str:
    """The engine's message, bounded and without internal addresses."""
    message = _ADDRESS.sub("<node>", _STATUS_PREFIX.sub("", error.detail.strip()))
    return message[:MAX_MESSAGE] or "the request is invalid"


def too_long(error: NodeFailure) -> bool:
    """A node's refusal of the request for its length (at any stage it judges the prompt,
    receiving its KV pages included): a node with a larger context may still serve it."""
    judged = error.stage in JUDGED or error.stage == Stage.TRANSFER
    return error.kind == FailureKind.INVALID and judged and _CONTEXT.search(error.detail) is not None


def refusal(error: NodeFailure, constraint_param: str | None = None) -> InvalidRequest | None:
    """The client's 400 for a node's refusal of the request, its 422 when the engine could not
    follow the request's constraint (``constraint_param``: the field that asked for it); None
    when it is no such refusal."""
    if error.kind not in (FailureKind.INVALID, FailureKind.CONSTRAINT) or error.stage not in JUDGED:
        return None
    message = engine_words(error)
    if error.kind == FailureKind.CONSTRAINT:
        return Unprocessable(
            f"the model server could not follow the constraint: {message}", param=constraint_param
        )
    code = "context_length_exceeded" if _CONTEXT.search(error.detail) else None
    return InvalidRequest(f"the model server refused the request: {message}", code=code)
