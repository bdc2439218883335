"""The gateway's seam to its nodes: transport-neutral types (``base``), one adapter per node
protocol (``prefixgate_grpc``; ``http_openai`` for OpenAI-compatible HTTP workers) and a
scripted fake for tests (``fake``).

``connect`` picks the adapter from a node's address.
"""

from __future__ import annotations

from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    CostProfile,
    FailedStream,
    Handoff,
    KVEvent,
    KVFormat,
    NodeClient,
    NodeFailure,
    NodeStatus,
    OpenAIBody,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenStream,
)
from prefixgate.gateway.nodeclient.http_openai import HttpOpenAIClient
from prefixgate.gateway.nodeclient.prefixgate_grpc import GrpcNodeClient

SCHEMES = ("grpc", "http", "https")


def split_address(address: str) -> tuple[str, str]:
    """(scheme, HOST:PORT); a bare HOST:PORT is today's protocol, ``grpc``."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return "grpc", address
    if scheme not in SCHEMES:
        raise ValueError(f"unknown node protocol {scheme!r} in {address!r}; known: {', '.join(SCHEMES)}")
    if not rest:
        raise ValueError(f"no HOST:PORT in node address {address!r}")
    return scheme, rest


def connect(address: str) -> NodeClient:
    """A client for the node at ``address`` (``HOST:PORT`` or ``grpc://HOST:PORT``; an
    OpenAI-compatible HTTP worker at ``http://HOST:PORT``)."""
    scheme, target = split_address(address)
    if scheme in ("http", "https"):
        return HttpOpenAIClient(address)
    return GrpcNodeClient(target)


__all__ = [
    "Capabilities",
    "CostProfile",
    "FailedStream",
    "Handoff",
    "KVEvent",
    "KVFormat",
    "NodeClient",
    "NodeFailure",
    "NodeStatus",
    "OpenAIBody",
    "PrefillReport",
    "Prompt",
    "StageTimings",
    "TokenDelta",
    "TokenStream",
    "connect",
    "split_address",
]
