"""Round-robin: ignores the cache entirely (the baseline every router beats)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Decision, NodeView, RouteInput


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        node = nodes[self._next % len(nodes)]
        self._next += 1
        return Decision(node.node_id, "round robin", inp.hits.get(node.node_id, 0))
