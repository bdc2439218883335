"""Gateway workers share one stderr: each log line must reach it whole, never cut by a sibling's.
A request's fields are in its lines and its tasks' and not in the next request's."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from prefixgate.gateway.logging import (
    _LineWriter,
    bind_fields,
    bind_request,
    configure_logging,
    current_request_id,
    info_fields,
)

_WRITER = r"""
import sys
import structlog
from prefixgate.gateway.logging import configure_logging
configure_logging("json")
log = structlog.get_logger("lines")
pad = "y" * 3000
for i in range(2000):
    log.info("line", i=i, pad=pad, writer=sys.argv[1])
"""


def test_three_processes_on_one_pipe_write_whole_lines() -> None:
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(k)], stderr=w) for k in range(3)]
    os.close(w)
    seen: dict[str, int] = {}
    with open(r, "rb") as f:
        for raw in f:
            rec = json.loads(raw)  # a line cut by another's would not parse
            seen[rec["writer"]] = seen.get(rec["writer"], 0) + 1
    for p in procs:
        assert p.wait(60) == 0
    assert seen == {"0": 2000, "1": 2000, "2": 2000}


def test_a_stream_without_a_descriptor_still_gets_its_lines() -> None:
    buf = io.StringIO()
    old = sys.stderr
    sys.stderr = buf
    try:
        configure_logging("json")
        structlog.get_logger("lines").info("kept", n=1)
    finally:
        sys.stderr = old
        configure_logging("json")
    (line,) = buf.getvalue().splitlines()
    assert json.loads(line)["event"] == "kept"


class _SignalOnFirstFlush(io.StringIO):
    """A stream that signals this process the first time a line is being written to it: the
    signal's handler runs while that line's writer is still in the middle of it."""

    signalled = False

    def flush(self) -> None:
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)
        super().flush()


def test_a_signal_handler_that_logs_while_a_line_is_being_written_does_not_wait_on_itself() -> None:
    """The gateway supervisor's stop logs from its SIGTERM handler; a SIGTERM that came while
    the supervisor was logging a line hung it (the line's lock held by the thread the handler
    interrupted), with a worker started and no stop sent."""
    buf = _SignalOnFirstFlush()
    log = structlog.get_logger("lines")
    previous = signal.signal(signal.SIGUSR1, lambda *_: log.info("from_the_handler"))
    old = sys.stderr
    sys.stderr = buf
    try:
        configure_logging("json")
        log.info("interrupted")
    finally:
        sys.stderr = old
        signal.signal(signal.SIGUSR1, previous)
        configure_logging("json")
    assert [json.loads(line)["event"] for line in buf.getvalue().splitlines()] == [
        "from_the_handler",
        "interrupted",
    ]


def _lines(run: Callable[[], Coroutine[Any, Any, None]]) -> list[dict[str, object]]:
    buf = io.StringIO()
    old = sys.stderr
    sys.stderr = buf
    try:
        configure_logging("json")
        asyncio.run(run())
    finally:
        sys.stderr = old
        configure_logging("json")
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_a_requests_fields_are_in_its_lines_and_its_tasks_and_not_in_the_next_requests() -> None:
    log = structlog.get_logger("lines")

    async def run() -> None:
        bind_request("first", path="/v1/chat/completions")
        bind_fields(trace_id="t1")
        log.info("one")

        async def later() -> None:
            await asyncio.sleep(0)
            log.info("task")

        task = asyncio.get_running_loop().create_task(later())  # started with the fields it had
        bind_fields(extra="after")  # the task does not see what is bound after it started
        await task
        assert current_request_id() == "first"
        bind_request("second")  # a new request: none of the first one's fields
        log.info("two")

    one, task, two = _lines(run)
    assert (one["request_id"], one["trace_id"], one["path"]) == ("first", "t1", "/v1/chat/completions")
    assert task["request_id"] == "first" and task["trace_id"] == "t1" and "extra" not in task
    assert two["request_id"] == "second" and "trace_id" not in two and "path" not in two


def _written(fmt: str, level: str, log_lines: Callable[[], None]) -> str:
    buf = io.StringIO()
    old = sys.stderr
    sys.stderr = buf
    try:
        configure_logging(fmt, level)
        log_lines()
    finally:
        sys.stderr = old
        configure_logging("json")
    return buf.getvalue()


FIELDS: dict[str, Any] = {"request_id": "r1", "route": "monolithic", "prefill_node": None, "ttft_ms": 1.25}


def test_fields_given_as_a_dict_make_the_line_keywords_make() -> None:
    def both() -> None:
        log = structlog.get_logger("lines")  # a new one: a logger keeps the output it first wrote to
        bind_request("bound", path="/v1/chat/completions")
        log.info("request", **FIELDS)
        info_fields(log, "request", dict(FIELDS))

    for fmt in ("json", "console"):
        kw, fields = _written(fmt, "info", both).splitlines()
        if fmt == "json":
            a, b = json.loads(kw), json.loads(fields)
            assert a.pop("timestamp") <= b.pop("timestamp")
            assert list(a.items()) == list(b.items())  # the same fields, in the same order
            assert b["request_id"] == "r1" and b["path"] == "/v1/chat/completions" and b["level"] == "info"
        else:  # the time first, then the same line
            assert kw.split(" ", 1)[1] == fields.split(" ", 1)[1] and "ttft_ms=1.25" in fields
    # below the configured level, as ``info`` is, nothing is written
    assert _written("json", "warning", both) == ""


def test_fields_reach_a_logger_that_is_not_configured_here_as_keywords() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    class Plain:
        def info(self, event: str, **kw: Any) -> None:
            seen.append((event, kw))

    info_fields(Plain(), "request", dict(FIELDS))
    assert seen == [("request", FIELDS)]


def test_an_event_loop_never_waits_on_a_stalled_pipe_and_says_what_it_dropped() -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    writer = _LineWriter(out, max_held_bytes=20_000)  # 20 lines, not 1 MiB: the drop comes soon
    line = "x" * 999  # a thousand bytes with its newline: the pipe (64 KiB) takes some 65

    async def log_lines() -> None:
        for _ in range(200):
            writer.msg(line)  # would block at the 66th on a blocking write: nobody reads yet

    logging_loop = threading.Thread(target=asyncio.run, args=(log_lines(),), daemon=True)
    logging_loop.start()
    logging_loop.join(10)
    assert not logging_loop.is_alive()  # a blocking write would hold it at the 66th line
    kept = 0
    with os.fdopen(r, "rb") as f:  # the reader reads again: the held lines, then the note
        for got in f:
            if got == line.encode() + b"\n":
                kept += 1
                continue
            note = json.loads(got)
            break
    writer.wait_drained(10)
    out.close()
    assert note == {"event": "log_lines_dropped", "count": 200 - kept, "level": "warning"}
    assert 65 + 20 - 2 <= kept <= 65 + 20  # the pipe's fill and the held bound
