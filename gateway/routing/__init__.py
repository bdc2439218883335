"""Routing: pure policies over node views, and the planner that decides a request's whole route.

One file per policy; ``planner.plan`` adds the mode, the decode node and the queue-wait estimate
around them. Nothing here does I/O or keeps state between decisions (the caller passes the
tie-break ``turn``), and the same code runs in the live gateway and in the trace simulator.
"""

from prefixgate.gateway.routing.base import Decision, KVFormat, NodeView, Policy, RouteInput, estimate_ttft
from prefixgate.gateway.routing.consistent_hash import ConsistentHashPolicy
from prefixgate.gateway.routing.least_loaded import LeastLoadedPolicy
from prefixgate.gateway.routing.longest_prefix import LongestPrefixPolicy
from prefixgate.gateway.routing.prefixgate import PrefixGatePolicy
from prefixgate.gateway.routing.registry import POLICIES, parse_policy, policy_parameters
from prefixgate.gateway.routing.round_robin import RoundRobinPolicy

__all__ = [
    "POLICIES",
    "ConsistentHashPolicy",
    "Decision",
    "KVFormat",
    "LeastLoadedPolicy",
    "LongestPrefixPolicy",
    "NodeView",
    "Policy",
    "PrefixGatePolicy",
    "RoundRobinPolicy",
    "RouteInput",
    "estimate_ttft",
    "parse_policy",
    "policy_parameters",
]
