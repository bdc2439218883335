"""The launcher's children live as long as the process that started them, whatever thread did."""

from __future__ import annotations

import sys
import threading
import time

from prefixgate.gateway.ops import processes

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def test_a_child_started_from_a_thread_that_ends_keeps_running() -> None:
    """The parent-death signal follows the forking thread: started from a pool or a thread that
    then exits, a child would get SIGTERM at once unless one long-lived thread forks them all."""
    started: list[processes.Child] = []
    t = threading.Thread(target=lambda: started.append(processes.start("sleeper", SLEEPER)))
    t.start()
    t.join(10)
    (child,) = started
    try:
        child.wait_until(processes.printed("^up$"), timeout=30)
        # The signal, had it come, comes when the thread exits: give it time to land.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and child.alive():
            time.sleep(0.05)
        assert child.alive(), f"exited {child.proc.returncode} when its starting thread ended"
    finally:
        assert child.stop(timeout=5) != 0  # stopped by our SIGTERM, not exited by itself
