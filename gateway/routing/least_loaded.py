"""Least loaded: fewest outstanding prefill tokens, ignoring the cache."""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway.routing.base import Decision, NodeView, RouteInput


class LeastLoadedPolicy:
    name = "least_loaded"

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        node = min(nodes, key=lambda n: (n.outstanding_tokens, n.outstanding_requests, n.node_id))
        return Decision(node.node_id, "least outstanding prefill tokens", inp.hits.get(node.node_id, 0))
