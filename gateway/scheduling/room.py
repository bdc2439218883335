"""Whether a node can start another prefill now: the gateway keeps the rest in its own queue.

A node given every request at once orders them itself (first come, first served, in chunks);
the gateway, which knows each one's tenant, class and predicted cost, orders better. So it sends
a node prefill work only while what it already holds is short: fewer than ``min_requests``
outstanding (2: one computing, one behind it, so the node computes the next prompt while the
last one's KV travels to its decode node), or fewer than ``max_requests`` that its speed says
are done within ``window_s``. That keeps the node busy between two of the gateway's decisions
(the next request is already there when one finishes) and binds each waiting request late,
to the picture of load and cache at the moment a node can take it. A node whose speed is
unknown (0) is held to ``max_requests``.
Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.gateway.routing.base import NodeView


@dataclass(frozen=True, slots=True)
class RoomRule:
    window_s: float = 0.05  # predicted seconds of prefill a node may hold
    max_requests: int = 8  # requests outstanding on a node at most (0: the queue is off)
    min_requests: int = 2  # a node holding fewer always takes one more


DEFAULT_ROOM = RoomRule()


def has_room(view: NodeView, rule: RoomRule = DEFAULT_ROOM) -> bool:
    """Whether ``view``'s node may be given one more prefill now."""
    if not view.routable:
        return False
    if rule.max_requests <= 0 or view.outstanding_requests < min(rule.min_requests, rule.max_requests):
        return True
    if view.outstanding_requests >= rule.max_requests:
        return False
    rate = view.prefill_tokens_per_s
    if rate <= 0:
        return True
    return view.outstanding_tokens / rate < rule.window_s
