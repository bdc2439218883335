"""Pure longest prefix: the node holding most leading blocks, ties to the least loaded.

Without a load bound a prefix shared by every request (block 0 of a common system prompt)
pulls all traffic onto one node; kept as a baseline to show that.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway.routing.base import Decision, NodeView, RouteInput


class LongestPrefixPolicy:
    name = "longest_prefix"

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        node = max(
            nodes, key=lambda n: (inp.hits.get(n.node_id, 0), -n.outstanding_tokens, -n.outstanding_requests)
        )
        hit = inp.hits.get(node.node_id, 0)
        return Decision(node.node_id, f"longest prefix ({hit} blocks)", hit)
