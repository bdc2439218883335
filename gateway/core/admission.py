"""Admission: at most ``max_inflight`` requests in flight; the next is refused (``Overloaded``)."""

from __future__ import annotations

from collections.abc import Callable

from prefixgate.gateway.config import Settings
from prefixgate.gateway.metrics import Metrics
from prefixgate.openai.exceptions import Overloaded


class Admission:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.inflight = 0

    def admit(self) -> Callable[[], None]:
        """Take an in-flight slot or refuse (``Overloaded``); returns the (idempotent) release.

        Front ends do not call this directly: ``gateway.core.runner`` pairs it with its release.
        """
        limit = self.settings.max_inflight
        if self.inflight >= limit:
            self.metrics.requests.labels("none", "rejected").inc()
            raise Overloaded(
                f"too many requests in flight ({limit}); retry shortly",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1
                self.metrics.inflight.set(self.inflight)

        return release
