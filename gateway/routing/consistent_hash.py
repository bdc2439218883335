"""Consistent hash of the first block: sticky by prefix root, blind to load."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from prefixgate.gateway.routing.base import Decision, NodeView, RouteInput


class ConsistentHashPolicy:
    name = "consistent_hash"

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        # Rendezvous hashing: the same key keeps its node while that node stays.
        key = inp.first_block.to_bytes(8, "little")
        node = max(nodes, key=lambda n: xxhash.xxh3_64_intdigest(key + n.node_id.encode()))
        return Decision(node.node_id, "rendezvous hash of the first block", inp.hits.get(node.node_id, 0))
