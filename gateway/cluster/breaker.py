"""Per-node circuit breaker, pure (the caller passes the clock).

closed --(threshold consecutive failures)--> open --(cooldown)--> half-open
half-open lets one trial at a time through: ``success_threshold`` successes in a row close it, a
failure re-opens it with a longer cooldown (doubling up to ``max_cooldown_s``). A ``threshold``
of 0 keeps failed requests from ever opening it (probes still can). Failed active health probes
``trip`` it open; a probe that passes again moves a breaker the probes opened to half-open, so a
node that comes back rejoins by itself. A breaker opened by failed requests waits out its
cooldown even while probes pass: a node can answer its status and still fail real work.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    threshold: int = 3
    success_threshold: int = 1
    base_cooldown_s: float = 1.0
    max_cooldown_s: float = 30.0
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    cooldown_s: float = 1.0
    trial_in_flight: bool = False
    opens: int = 0
    probe_tripped: bool = False
    trial_successes: int = 0

    def allows(self, now: float) -> bool:
        """May a new request go to this node now?"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
            self.trial_in_flight = False
        return self.state == HALF_OPEN and not self.trial_in_flight

    def on_dispatch(self) -> None:
        if self.state == HALF_OPEN:
            self.trial_in_flight = True

    def on_release(self) -> None:
        """A dispatch that never reached the node (its partner failed first): no verdict on it,
        so a half-open breaker lets another trial through."""
        self.trial_in_flight = False

    def on_success(self) -> None:
        self.trial_in_flight = False
        if self.state == HALF_OPEN:
            self.trial_successes += 1
            if self.trial_successes < self.success_threshold:
                return
        self.state = CLOSED
        self.failures = 0
        self.trial_in_flight = False
        self.cooldown_s = self.base_cooldown_s

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.state == HALF_OPEN:
            self._open(now, min(self.max_cooldown_s, self.cooldown_s * 2))
        elif self.state == CLOSED and self.threshold and self.failures >= self.threshold:
            self._open(now, self.base_cooldown_s)

    def trip(self, now: float) -> None:
        """Open at once (the node is known to be unreachable)."""
        if self.state != OPEN:
            self._open(now, self.cooldown_s if self.state == HALF_OPEN else self.base_cooldown_s)
        self.probe_tripped = True

    def on_probe_ok(self, now: float) -> None:
        """An active health check passed: a breaker the probes opened lets one trial through."""
        if self.state == OPEN and self.probe_tripped:
            self.state = HALF_OPEN
            self.trial_in_flight = False

    def _open(self, now: float, cooldown: float) -> None:
        self.state = OPEN
        self.opened_at = now
        self.cooldown_s = cooldown
        self.trial_in_flight = False
        self.probe_tripped = False
        self.trial_successes = 0
        self.opens += 1
