"""The ``x-prefixgate-*`` response headers: how a started execution is shown on the wire
(HTTP headers; the gRPC front sends the same as its initial metadata)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixgate.gateway.core.execution import Execution


def execution_headers(ex: Execution) -> dict[str, str]:
    """The request id, the nodes, the route and the cached tokens the tenant is told of."""
    return {
        "x-prefixgate-request-id": ex.request_id,
        "x-prefixgate-prefill-node": ex.prefill_node.id if ex.prefill_node else "",
        "x-prefixgate-decode-node": ex.decode_node.id,
        "x-prefixgate-route": ex.route,
        "x-prefixgate-cached-tokens": str(ex.cached_tokens),
    }
