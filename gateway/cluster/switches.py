"""The runtime switches (``PUT /admin/switches``), the same on every replica and gateway worker.

The replica (or worker) that takes a change applies it at once and records the whole set in the
shared store with the time of the change; every replica reads the record on the membership beat
(``Membership``, every ``membership_interval_s``; a gateway's sibling workers at once, told by
``announce``) and takes a newer one, so the last change made anywhere wins within a beat. A
replica started later takes the last change before it serves.
With the embedded store there is one gateway and nothing to follow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from prefixgate.gateway.core.request import Switches
from prefixgate.gateway.state.store import StateStore

log = structlog.get_logger("prefixgate.switches")

NAMES = tuple(f.name for f in dataclasses.fields(Switches))


class SharedSwitches:
    def __init__(self, state: StateStore, switches: Switches) -> None:
        self.state = state
        self.switches = switches
        self.changed_at = 0.0  # wall-clock time of the change in force here (0: the settings')
        #: Called after a change is recorded (``Membership.announce``: sibling workers sync now).
        self.announce: Callable[[], None] = lambda: None

    @property
    def shared(self) -> bool:
        return self.state.backend != "memory"

    def values(self) -> dict[str, bool]:
        return {name: bool(getattr(self.switches, name)) for name in NAMES}

    def _apply(self, values: Mapping[str, bool]) -> None:
        for name, on in values.items():
            if name in NAMES:
                setattr(self.switches, name, on)

    async def change(self, values: Mapping[str, bool]) -> dict[str, bool]:
        """Apply ``values`` (a subset of ``NAMES``) here and record the whole set for the others;
        the switches now. A record that fails holds here and is said in the log."""
        self._apply(values)
        self.changed_at = max(time.time(), self.changed_at + 1e-6)
        now = self.values()
        if self.shared:
            try:
                await self.state.switches_put(now, self.changed_at)
            except Exception as e:  # applied here; the others learn of it with the next change
                log.warning("switches_record_failed", error=repr(e)[:200])
            else:
                self.announce()
        return now

    async def sync(self) -> bool:
        """Take the recorded switches if they were changed after the ones in force here."""
        if not self.shared:
            return False
        record = await self.state.switches_get()
        if record is None or record[1] <= self.changed_at:
            return False
        values, at = record
        self._apply(values)
        self.changed_at = at
        log.info("switches_synced", **self.values())
        return True
