"""Policies by name, and the one parser of policy specs (``prefixgate:affinity=5,token_factor=2``).

The gateway's settings (``--policy``, ``PREFIXGATE_POLICY``, the TOML ``policy``) and ``bench
replay --policies`` take the same specs, so a policy tuned in the simulator runs as is live.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

from prefixgate.gateway.routing.base import Policy
from prefixgate.gateway.routing.consistent_hash import ConsistentHashPolicy
from prefixgate.gateway.routing.least_loaded import LeastLoadedPolicy
from prefixgate.gateway.routing.longest_prefix import LongestPrefixPolicy
from prefixgate.gateway.routing.prefixgate import PrefixGatePolicy
from prefixgate.gateway.routing.round_robin import RoundRobinPolicy
from prefixgate.gateway.routing.uniform import RandomPolicy

POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "least_loaded": LeastLoadedPolicy,
    "consistent_hash": ConsistentHashPolicy,
    "longest_prefix": LongestPrefixPolicy,
    "prefixgate": PrefixGatePolicy,
}


def policy_parameters(name: str) -> dict[str, float]:
    """The numeric parameters the policy ``name`` takes, with their defaults."""
    factory = _factory(name)
    return {
        p.name: p.default
        for p in inspect.signature(factory).parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD or p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def parse_policy(spec: str, defaults: Mapping[str, float] | None = None) -> Policy:
    """``name`` or ``name:key=value,key=value`` (numbers) -> a fresh policy.

    ``defaults`` fill the parameters the spec leaves out, for the policies that take them (the
    gateway's ``load_factor`` setting is one). Raises ValueError naming what is wrong: an unknown
    policy, a parameter the policy does not take, a value that is not a number or out of range.
    """
    name, _, args = spec.strip().partition(":")
    name = name.strip()
    params = policy_parameters(name)
    kwargs: dict[str, float] = {k: float(v) for k, v in (defaults or {}).items() if k in params}
    for part in filter(None, (a.strip() for a in args.split(","))):
        key, eq, raw = (x.strip() for x in part.partition("="))
        if key not in params:
            takes = ", ".join(sorted(params)) if params else "no parameters"
            raise ValueError(f"policy {name!r} has no parameter {key!r} (it takes {takes})")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not eq or not math.isfinite(value):
            raise ValueError(f"policy {name!r}: {key} must be a number, got {raw!r}")
        kwargs[key] = value
    try:
        return POLICIES[name](**kwargs)
    except ValueError as e:
        raise ValueError(f"policy {spec.strip()!r}: {e}") from None


def _factory(name: str) -> Callable[..., Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None
