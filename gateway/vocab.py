"""The gateway's words as enums, so a role, a mode or a stage is never a stray string.

Each is a ``StrEnum``: members compare equal to their string values, so JSON, metrics labels and
log lines keep the values they had when these were plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a node does in the cluster."""

    PREFILL = "prefill"
    DECODE = "decode"
    MONOLITHIC = "monolithic"


class Mode(StrEnum):
    """How a request is served: split over a pair of nodes, or whole on one node."""

    DISAGGREGATED = "disaggregated"
    MONOLITHIC = "monolithic"
    FALLBACK = "fallback"  # served whole because the split could not serve


class Stage(StrEnum):
    """Where along the request path a node's work failed or was timed."""

    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    GENERATE = "generate"
    PROBE = "probe"  # status / health check
    EVENTS = "events"  # the KV event stream
    CACHE = "cache"  # evict, pin


class EventKind(StrEnum):
    """What a node's KV event says about its cache."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    SNAPSHOT = "snapshot"


class BreakerState(StrEnum):
    """Circuit breaker state of a node."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class FailureKind(StrEnum):
    """Why a node could not serve, independent of the wire that said so.

    Decides whether another node is tried: everything but ``INVALID`` is retried before the first
    token; ``OVERLOADED`` everywhere means 429 rather than 503.
    """

    UNAVAILABLE = "unavailable"  # connection refused, node down or draining
    TIMEOUT = "timeout"  # no answer in time (wedged node, slow first byte, stalled stream)
    OVERLOADED = "overloaded"  # the node's queue is full
    HANDLE_GONE = "handle_gone"  # the decode node lost the KV handle
    FORMAT_REFUSED = "format_refused"  # KV pages in a format the decode node does not take
    INVALID = "invalid"  # the request itself is wrong: retrying elsewhere cannot help
    CONSTRAINT = "constraint"  # the request's constraint (grammar) failed on the engine: likewise
    CANCELLED = "cancelled"  # the node or the client cancelled the call
    GONE = "node_gone"  # declared gone (its breaker opened) while the attempt awaited its first token
    INTERNAL = "internal"  # the node failed in an unexpected way

    @property
    def retryable(self) -> bool:
        return self not in (FailureKind.INVALID, FailureKind.CONSTRAINT)
