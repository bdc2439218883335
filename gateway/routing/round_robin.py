"""Round-robin: ignores the cache entirely (the baseline every router beats)."""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway.routing.base import Decision, NodeView, RouteInput


class RoundRobinPolicy:
    """The ``turn``-th node: the caller counts decisions, so this holds no state."""

    name = "round_robin"

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        node = nodes[inp.turn % len(nodes)]
        return Decision(node.node_id, "round robin", inp.hits.get(node.node_id, 0))
