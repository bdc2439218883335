"""How long an attempt waits for its prefill (or, served whole, its first token): what the gateway
predicts for that request on that node, with a margin. Pure arithmetic, no clock, no I/O.

One fixed timeout cannot fit both ends: a 128K-token prefill behind a queue takes tens of
seconds on a healthy node, a 1K one well under a second, and a hung node should cost the short
request seconds, not the long one's allowance. So the wait follows the prediction::

    limit = max(floor_s, margin * (queue + prefill + transfer))

the queue (tokens ahead on the node) and the uncached prefill at the node's speed (its profile
with its learned slowness, or the rate the gateway measured when it states none), plus the KV
transfer on the split path; capped by ``cap_s`` (``first_token_timeout_s``) and what the request
deadline leaves. A node whose speed nobody knows yet, or a margin of 0, gets ``cap_s`` as before.

The floor keeps scheduler jitter and the decode node's first step out of the verdict, and, at the
default probe interval, leaves the probes time to notice a decode node that went silent (a push
stuck on it is charged to it, not to the prefill node: ``Executor._first``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixgate.gateway.records import record
from prefixgate.gateway.routing import costmodel


@dataclass(frozen=True, slots=True)
class Speed:
    """A node's prefill speed as the gateway believes it (wall-clock figures)."""

    tokens_per_s: float  # linear part; > 0
    attention_coeff_s: float = 0.0  # seconds per (new token x context token)


@record
class Work:
    """What the node computing the prompt has to do before the attempt's prefill is over."""

    queued_tokens: int  # prefill tokens ahead of this request on the node
    uncached_tokens: int
    cached_tokens: int
    transfer_s: float = 0.0  # the KV's trip to the decode node (split path; 0 served whole)


@record
class Rule:
    """The settings that turn a prediction into a limit."""

    margin: float  # first_token_deadline_margin: predicted seconds times this (0: no prediction)
    floor_s: float  # first_token_deadline_floor_s
    cap_s: float  # first_token_timeout_s (0: no cap but the request deadline)


def predicted_s(speed: Speed, work: Work) -> float:
    """Seconds the prefill should take, queue and transfer included."""
    queue = max(0, work.queued_tokens) / speed.tokens_per_s
    prefill = costmodel.prefill_seconds(
        speed.tokens_per_s, speed.attention_coeff_s, work.uncached_tokens, work.cached_tokens
    )
    return queue + prefill + max(0.0, work.transfer_s)


def limit_s(speed: Speed | None, work: Work, rule: Rule, left_s: float) -> float:
    """Seconds the attempt waits for its prefill: the prediction with its margin and floor, at
    most ``rule.cap_s`` and ``left_s`` (the request deadline); ``rule.cap_s`` (or ``left_s``)
    when the speed is unknown or predictions are off."""
    cap = rule.cap_s if rule.cap_s > 0 else math.inf
    limit = cap
    if speed is not None and speed.tokens_per_s > 0 and rule.margin > 0:
        limit = min(cap, max(rule.floor_s, rule.margin * predicted_s(speed, work)))
    return max(0.001, min(limit, left_s))
