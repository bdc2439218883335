"""prefixgate's default: lowest estimated time to first token under a bounded load.

TTFT estimate per node = queue wait (outstanding prefill tokens / throughput) + prefill of the
uncached tokens (attention over the cached context included) + KV transfer to decode. A node
is eligible only while its outstanding requests stay within ``ceil(c * (total + 1) / n)``
(consistent hashing with bounded loads, Mirrokni et al.), so a prefix every request shares
cannot pull all traffic onto one node. Ties go to the longer hit, then to the lighter node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.routing.base import Decision, Estimate, NodeView, RouteInput, estimate_ttft


class PrefixGatePolicy:
    name = "prefixgate"

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self.load_factor = load_factor

    def load_bound(self, nodes: Sequence[NodeView]) -> int:
        total = sum(n.outstanding_requests for n in nodes)
        return max(1, math.ceil(self.load_factor * (total + 1) / len(nodes)))

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        bound = self.load_bound(nodes)
        estimates = [estimate_ttft(n, inp, bound) for n in nodes]
        eligible = [e for e in estimates if e.within_bound] or estimates

        def rank(e: Estimate) -> tuple[float, int, int, str]:
            return (round(e.ttft_s, 6), -e.hit_blocks, e.load, e.node_id)

        best = min(eligible, key=rank)
        best_hit = max(e.hit_blocks for e in estimates)
        reason = f"lowest estimated TTFT {best.ttft_s * 1000:.1f} ms with {best.hit_blocks} cached blocks"
        if best.hit_blocks < best_hit:
            reason += f" (longest hit {best_hit} blocks is on a node over the load bound or slower)"
        return Decision(best.node_id, reason, best.hit_blocks, tuple(estimates))
