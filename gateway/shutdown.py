"""Shutdown: the requests in flight on every front end, and the stages that close the rest.

SIGTERM stops the front ends accepting; the requests still running when ``shutdown_grace_s``
ends are cut (:meth:`Inflight.end_all`: their tasks are cancelled and each front end ends them
as it documents, the HTTP one with an SSE error event or a 503, the gRPC one with UNAVAILABLE),
all with one message and code (``CUT_MESSAGE``, ``CUT_CODE``); the cut count, over both front
ends, makes the exit status 4.

Then the gateway's parts are closed in turn as stages (:func:`stage`), each timed, logged and bounded.

Every stage logs one ``shutdown_stage`` line (``stage``, ``seconds``, ``outcome``: ok, error
or timeout), so a slow shutdown names the part that was slow. The bound does not rely on the
stage obeying cancellation: a close that swallows the ``CancelledError`` (``suppress`` around
awaiting a task it cancelled itself) would hold ``asyncio.wait_for`` past its timeout, since
``wait_for`` waits for the task it cancelled. Here a stage past its bound is cancelled, given
``CANCEL_GRACE_S`` to unwind, and then left behind: the process is exiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from prefixgate.cachetier.tasks import stop_tasks

log = structlog.get_logger("prefixgate.shutdown")

#: What a request cut by shutdown is told (both front ends), and its error code.
CUT_MESSAGE = "the gateway shut down before this response was finished"
CUT_CODE = "shutting_down"

#: How long a stage cancelled at its bound is waited for before it is abandoned.
CANCEL_GRACE_S = 0.5


async def stage(name: str, close: Callable[[], Awaitable[object]], bound_s: float) -> str:
    """Run ``close()`` for at most ``bound_s`` (plus ``CANCEL_GRACE_S``); its outcome, logged."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(close())
    outcome = "ok"
    error = ""
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    if not done:
        outcome = "timeout"
        _log_stuck(name)
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error while unwinding is not reported twice
    elif task.cancelled():
        outcome = "cancelled"
    elif (exc := task.exception()) is not None:
        outcome, error = "error", repr(exc)[:200]
    seconds = round(time.monotonic() - t0, 3)
    fields: dict[str, object] = {"stage": name, "seconds": seconds, "outcome": outcome}
    if error:
        fields["error"] = error
    if outcome == "ok":
        log.info("shutdown_stage", **fields)
    else:
        log.warning("shutdown_stage", bound_s=bound_s, **fields)
    return outcome


def await_chain(task: asyncio.Task[object], depth: int = 24) -> list[str]:
    """Where a task waits: its coroutine's ``await`` chain, outermost first, as
    ``function (file:line)``; what a stuck stage is stuck in."""
    out: list[str] = []
    obj: Any = task.get_coro()
    while obj is not None and len(out) < depth:
        frame = (
            getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None) or getattr(obj, "gi_frame", None)
        )
        if frame is not None:
            out.append(
                f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})"
            )
        obj = (
            getattr(obj, "cr_await", None)
            or getattr(obj, "ag_await", None)
            or getattr(obj, "gi_yieldfrom", None)
        )
    return out


def _log_stuck(name: str) -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    waits = {t.get_name(): " <- ".join(reversed(await_chain(t))) for t in tasks[:40]}
    log.warning("shutdown_stage_stuck", stage=name, tasks=waits)


async def end_leftovers(timeout: float = 2.0) -> list[str]:
    """End the tasks still running once everything is closed, each a part that did not stop
    its own work (named in ``shutdown_tasks_left``). The loop's own teardown would cancel them
    once and wait for them without a bound; here they are cancelled until they end
    (``stop_task``), within ``timeout``."""
    current = asyncio.current_task()
    tasks: list[asyncio.Future[Any]] = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    names = sorted(t.get_name() for t in tasks if isinstance(t, asyncio.Task))
    if names:
        log.warning("shutdown_tasks_left", count=len(names), tasks=names[:50])
        stuck = await stop_tasks(tasks, timeout)
        if stuck:
            log.warning("shutdown_tasks_stuck", count=stuck)
    return names


class Tracked:
    """One request in flight: enough to end it cleanly at the end of a shutdown grace."""

    __slots__ = ("complete", "ending", "front", "sse", "started", "task")

    def __init__(self, task: asyncio.Task[object] | None, front: str) -> None:
        self.task = task
        self.front = front
        self.started = False  # its answer has begun (HTTP: the response head is sent)
        self.sse = False
        self.complete = False
        self.ending = False  # cut by shutdown: its task was cancelled for that

    def resume_if_cut(self) -> bool:
        """In a handler's ``except CancelledError``: True (and the task uncancelled, so it can
        write its last words) when the cancellation is the shutdown's cut; False: re-raise."""
        if not self.ending or self.task is None:
            return False
        self.task.uncancel()
        return True


class _Tracking:
    """``Inflight.track``: a class, not a generator's context manager, as every request takes one."""

    __slots__ = ("_req", "_requests")

    def __init__(self, requests: set[Tracked], req: Tracked) -> None:
        self._requests, self._req = requests, req

    def __enter__(self) -> Tracked:
        self._requests.add(self._req)
        return self._req

    def __exit__(self, *exc: object) -> None:
        self._requests.discard(self._req)


class Inflight:
    """The requests in flight on every front end; :meth:`end_all` cuts them."""

    def __init__(self) -> None:
        self.requests: set[Tracked] = set()
        self.cut = 0
        self.cut_by_front: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def track(self, front: str) -> _Tracking:
        """The current task's request, tracked while the block runs (``with ... as req``)."""
        return _Tracking(self.requests, Tracked(asyncio.current_task(), front))

    def end_all(self) -> int:
        """Cancel every request still running; returns how many were cut."""
        n = 0
        for req in list(self.requests):
            if req.complete or req.ending or req.task is None:
                continue
            req.ending = True
            req.task.cancel()
            self.cut_by_front[req.front] = self.cut_by_front.get(req.front, 0) + 1
            n += 1
        self.cut += n
        return n
