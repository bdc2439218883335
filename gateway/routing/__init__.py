"""Routing policies: pure functions of (prompt hits, node views) -> decision.

One file per policy. The same code runs in the live gateway and in the trace simulator.
"""

from gateway.routing.base import Decision, NodeView, Policy, RouteInput, estimate_ttft
from gateway.routing.consistent_hash import ConsistentHashPolicy
from gateway.routing.least_loaded import LeastLoadedPolicy
from gateway.routing.longest_prefix import LongestPrefixPolicy
from gateway.routing.prefixgate import PrefixGatePolicy
from gateway.routing.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "consistent_hash": ConsistentHashPolicy,
    "longest_prefix": LongestPrefixPolicy,
    "prefixgate": PrefixGatePolicy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None


__all__ = [
    "POLICIES",
    "ConsistentHashPolicy",
    "Decision",
    "LeastLoadedPolicy",
    "LongestPrefixPolicy",
    "NodeView",
    "Policy",
    "PrefixGatePolicy",
    "RoundRobinPolicy",
    "RouteInput",
    "estimate_ttft",
    "make_policy",
]
