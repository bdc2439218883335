"""prefixgate's default: lowest estimated time to first token with cache affinity, under a load bound.

Per node the TTFT estimate is queue wait (outstanding prefill tokens / throughput) + prefill of
the uncached tokens (attention over the cached context included) + KV transfer to decode.

**Load bound.** A node is eligible while it is within either bound:

- requests: outstanding + 1 <= ``max(ceil(load_factor * (total + 1) / n), (total + 1) // n +
  min_headroom)`` — consistent hashing with bounded loads (Mirrokni et al.), with a little
  headroom at low load where one queued request is no imbalance worth a cache miss;
- work: outstanding tokens + this request's uncached tokens there <= ``token_factor`` x the
  mean outstanding tokens (this request included) — many small requests are no overload.

So a prefix every request shares cannot pull all traffic onto one node (ten concurrent
requests sharing a system prompt spread over two nodes at most 7/3), while a request whose
long prefix sits on a node with a longer queue of small work still goes there.

**Cache affinity.** Among eligible nodes the score is the TTFT estimate plus ``affinity`` x
the extra prefill seconds this node costs over the best-cached eligible node. The recomputed
tokens are paid again by every request queued behind them and the duplicated blocks evict
other prefixes, so a session leaves its node only when the queue there is much longer. Ties go
to the longer hit, then the lighter node, then round the nodes (by the caller's ``turn``) so idle
nodes share new work.

Hits include prefixes routed and still computing (``routing.inflight``), which the load bound makes
safe to follow.

Tuned on the Mooncake conversation trace in the simulator (``bench/README.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from prefixgate.gateway.routing.base import Decision, Estimate, NodeView, RouteInput, estimate_ttft


class PrefixGatePolicy:
    name = "prefixgate"
    follows_inflight = True  # the load bound keeps an in-flight shared prefix from pulling everything

    def __init__(
        self,
        load_factor: float = 1.25,
        token_factor: float = 1.5,
        min_headroom: int = 2,
        affinity: float = 20.0,
    ) -> None:
        if load_factor < 1.0 or token_factor < 1.0:
            raise ValueError("load_factor and token_factor must be >= 1")
        if affinity < 0 or min_headroom < 1:
            raise ValueError("affinity must be >= 0 and min_headroom >= 1")
        self.load_factor = load_factor
        self.token_factor = token_factor
        self.min_headroom = int(min_headroom)
        self.affinity = affinity

    def load_bound(self, nodes: Sequence[NodeView], node: NodeView | None = None) -> int:
        """Most outstanding requests ``node`` may have after taking this one.

        Each node's share is weighted by its prefill throughput (equal nodes share equally), so
        a node that runs slower than the others, or than it claims, is not handed a full share.
        """
        total = sum(v.outstanding_requests for v in nodes)
        speed = sum(v.prefill_tokens_per_s for v in nodes)
        return self._bound(total, speed, len(nodes), node)

    def _bound(self, total: int, speed: float, n: int, node: NodeView | None) -> int:
        """``load_bound`` from the nodes' summed requests and speed, taken once per decision
        (summing them again for every node made a decision quadratic in the nodes)."""
        share = (node.prefill_tokens_per_s / speed) if node is not None and speed > 0 else 1 / n
        fair = (total + 1) * share
        return max(1, math.ceil(self.load_factor * fair - 1e-9), int(fair + 1e-9) + self.min_headroom)

    def choose(self, inp: RouteInput, nodes: Sequence[NodeView]) -> Decision:
        if not nodes:
            return Decision(None, "no routable node")
        n = len(nodes)
        speed = sum(v.prefill_tokens_per_s for v in nodes)
        total = sum(v.outstanding_requests for v in nodes)
        # Work bound in seconds of queued prefill: tokens weighed by each node's speed.
        work_cap_s = (
            self.token_factor * (sum(v.outstanding_tokens for v in nodes) + inp.prompt_tokens) / speed
        )
        estimates: list[Estimate] = []
        for v in nodes:
            e = estimate_ttft(v, inp, self._bound(total, speed, n, v))
            work_s = (v.outstanding_tokens + inp.prompt_tokens - e.cached_tokens) / v.prefill_tokens_per_s
            if not e.within_bound and work_s <= work_cap_s:
                e = replace(e, within_bound=True)
            estimates.append(e)
        eligible = [e for e in estimates if e.within_bound] or estimates
        least_prefill = min(e.prefill_s for e in eligible)
        affinity = self.affinity
        turn = inp.turn % n
        best = eligible[0]
        best_key: tuple[float, int, int, int] | None = None
        for i, e in enumerate(estimates):
            if not e.within_bound and eligible is not estimates:
                continue
            key = (
                round(e.ttft_s + affinity * (e.prefill_s - least_prefill), 6),
                -e.hit_blocks,
                e.load,
                (i - turn) % n,
            )
            if best_key is None or key < best_key:
                best, best_key = e, key
        best_hit = max(e.hit_blocks for e in estimates)
        reason = f"lowest estimated TTFT {best.ttft_s * 1000:.1f} ms with {best.hit_blocks} cached blocks"
        if best.hit_blocks < best_hit:
            reason += f" (longest hit {best_hit} blocks is on a node over the load bound or far busier)"
        return Decision(best.node_id, reason, best.hit_blocks, tuple(estimates))
