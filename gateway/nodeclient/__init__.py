"""The gateway's seam to its nodes: transport-neutral types (``base``), one adapter per node
protocol (``prefixgate_grpc``; ``smg_common`` for the SMG engine protocol; ``http_openai`` for
OpenAI-compatible HTTP workers, ``http_pd`` when they serve split), the split-serving handoffs
written once over every transport (``handoff``) and a scripted fake for tests (``fake``).

``connect`` picks the adapter from a node's address: bare ``HOST:PORT`` is our own protocol,
``grpc://`` the SMG engine protocol (``smg_common``, ``smg_sglang``, ``smg_vllm``), ``http://``
an HTTP worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    PrefillWatched,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenStream,
)
from prefixgate.gateway.nodeclient.prefixgate_grpc import GrpcNodeClient

BARE = "prefixgate"  # a bare HOST:PORT: prefixgate's own node protocol


def _prefixgate(address: str, target: str, options: dict[str, Any]) -> NodeClient:
    return GrpcNodeClient(target)


def _smg(address: str, target: str, options: dict[str, Any]) -> NodeClient:
    from prefixgate.gateway.nodeclient.smg_common import SmgNodeClient, SmgOptions

    smg = options.get("smg")
    return SmgNodeClient(address, target, smg if isinstance(smg, SmgOptions) else None)


def _http(address: str, target: str, options: dict[str, Any]) -> NodeClient:
    # imported here: a gateway without HTTP workers never loads aiohttp (0.2 s of its start)
    from prefixgate.gateway.nodeclient.http_openai import HttpOpenAIClient
    from prefixgate.gateway.nodeclient.http_pd import HttpPDClient, HttpPDOptions

    pd = options.get("http_pd")
    priority = str(options.get("engine_priority", "off"))
    api_key = str(options.get("api_key", ""))
    if isinstance(pd, HttpPDOptions):  # a prefill or decode worker: split serving, its engine's way
        return HttpPDClient(address, pd, priority, api_key)
    return HttpOpenAIClient(address, priority, api_key)


# One line a protocol: scheme -> adapter factory ``(address, HOST:PORT, options) -> NodeClient``.
ADAPTERS: dict[str, Callable[[str, str, dict[str, Any]], NodeClient]] = {
    BARE: _prefixgate,
    "grpc": _smg,  # the SMG engine protocol: SGLang or vLLM, detected per worker
    "http": _http,  # an OpenAI-compatible HTTP worker
    "https": _http,
}
SCHEMES = tuple(ADAPTERS)


def split_address(address: str) -> tuple[str, str]:
    """(scheme, HOST:PORT); a bare HOST:PORT is our own protocol, ``prefixgate``."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return BARE, address
    if scheme not in ADAPTERS:
        raise ValueError(f"unknown node protocol {scheme!r} in {address!r}; known: {', '.join(ADAPTERS)}")
    if not rest:
        raise ValueError(f"no HOST:PORT in node address {address!r}")
    return scheme, rest


def connect(address: str, **options: Any) -> NodeClient:
    """A client for the node at ``address``: ``HOST:PORT`` (prefixgate.v1) or ``grpc://HOST:PORT``
    (SGLang/vLLM over the SMG protocol; ``smg=SmgOptions(...)`` configures it) or
    ``http://HOST:PORT`` (an OpenAI-compatible HTTP worker; ``http_pd=HttpPDOptions(...)`` makes
    it a prefill or decode worker, ``http_pd``; ``engine_priority=`` how its bodies carry a
    request's priority, ``openai_body.with_priority``; ``api_key=`` the worker's own key)."""
    scheme, target = split_address(address)
    return ADAPTERS[scheme](address, target, options)


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
    "PrefillWatched",
    "Prompt",
    "StageTimings",
    "TokenDelta",
    "TokenStream",
    "connect",
    "split_address",
]
