"""Random: a uniform pick, blind to cache and load (smg's ``random``).

The pick is a hash of the caller's decision count, not a draw from a generator: as uniform over
the nodes as a random choice, and reproducible, so a replay in the simulator decides as the
live gateway did.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from prefixgate.gateway.routing.base import Decision, NodeView, RouteInput


class RandomPolicy:
    name = "random"

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        node = nodes[xxhash.xxh3_64_intdigest(inp.turn.to_bytes(8, "little")) % len(nodes)]
        return Decision(node.node_id, "random", inp.hits.get(node.node_id, 0))
