"""Stop strings over streamed text. Pure.

Text that could still be the start of a stop string is held back, so a stop string spanning
several tokens never leaks; when one appears, the text before it is released and the rest
(the stop string included) is dropped. Only the held-back tail is kept, so the cost per token
does not grow with the output.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    __slots__ = ("_pending", "_prefixes", "stop", "stopped")

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._prefixes = {s[:k] for s in self.stop for k in range(1, len(s))}
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add generated text; returns what is now safe to show."""
        if self.stopped:
            return ""
        if not self.stop:
            return piece
        pending = self._pending + piece
        cut = -1
        for s in self.stop:
            i = pending.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        hold = 0
        for k in range(min(len(pending), max(map(len, self.stop)) - 1), 0, -1):
            if pending[-k:] in self._prefixes:
                hold = k
                break
        self._pending = pending[len(pending) - hold :]
        return pending[: len(pending) - hold]

    def flush(self) -> str:
        """Generation ended without a stop string: release the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
