"""Gateway workers share one stderr: each log line must reach it whole, never cut by a sibling's.
A request's fields are in its lines and its tasks' and not in the next request's."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import IO, Any

import pytest
import structlog

from prefixgate.gateway.logging import (
    GATHER_BYTES,
    GATHER_S,
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
pad = "y" * int(sys.argv[2])
for i in range(2000):
    log.info("line", i=i, pad=pad, writer=sys.argv[1])
"""


# The same lines from an event loop, as a gateway worker logs its requests: info lines to a pipe
# are gathered and written together, and those writes too must leave every line whole.
_LOOP_WRITER = r"""
import asyncio
import sys
import structlog
from prefixgate.gateway.logging import configure_logging
configure_logging("json")
log = structlog.get_logger("lines")
pad = "y" * int(sys.argv[2])

async def main():
    for i in range(2000):
        log.info("line", i=i, pad=pad, writer=sys.argv[1])
        if i % 50 == 0:
            await asyncio.sleep(0)

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("program", "pad"),
    [(_WRITER, 3000), (_LOOP_WRITER, 3000), (_LOOP_WRITER, 700), (_LOOP_WRITER, 60)],
    ids=["plain", "loop-long-lines", "loop-lines-gathered", "loop-short-lines"],
)
def test_three_processes_on_one_pipe_write_whole_lines(program: str, pad: int) -> None:
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", program, str(k), str(pad)], stderr=w) for k in range(3)]
    os.close(w)
    seen: dict[str, int] = {}
    dropped = 0  # an event loop drops what a stalled pipe cannot take and says how many
    with open(r, "rb") as f:
        for raw in f:
            rec = json.loads(raw)  # a line cut by another's would not parse
            if rec["event"] == "log_lines_dropped":
                dropped += rec["count"]
            else:
                seen[rec["writer"]] = seen.get(rec["writer"], 0) + 1
    for p in procs:
        assert p.wait(60) == 0
    assert sum(seen.values()) + dropped == 6000
    assert dropped == 0 if program == _WRITER else sum(seen.values()) > 3 * 65


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


@contextlib.contextmanager
def _logging_to(stream: IO[str]) -> Iterator[None]:
    """Logging configured for ``stream`` as stderr while the block runs, then for stderr again."""
    old = sys.stderr
    sys.stderr = stream
    try:
        configure_logging("json")
        yield
    finally:
        sys.stderr = old
        configure_logging("json")


def _lines(run: Callable[[], Coroutine[Any, Any, None]]) -> list[dict[str, object]]:
    buf = io.StringIO()
    with _logging_to(buf):
        asyncio.run(run())
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


def _read_available(fd: int) -> bytes:
    got = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return got
        if not chunk:
            return got
        got += chunk


def test_an_event_loops_info_lines_to_a_pipe_are_written_together_and_a_warning_at_once() -> None:
    """Info lines wait to be written together (a write wakes the pipe's reader); a warning
    goes out at once, after them; gathered lines go out by themselves soon, and none is lost."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = os.fdopen(w, "w")
    writer = _LineWriter(out)

    async def log_lines() -> tuple[bytes, bytes, bytes, bytes]:
        writer.info("one")
        writer.info("two")
        gathered = _read_available(r)
        writer.warning("three")
        at_once = _read_available(r)
        writer.info("four")
        before = _read_available(r)
        await asyncio.sleep(GATHER_S * 4)
        return gathered, at_once, before, _read_available(r)

    gathered, at_once, before, later = asyncio.run(log_lines())
    writer.info("five")  # no event loop here: written at once
    plain = _read_available(r)
    out.close()
    os.close(r)
    assert gathered == b""
    assert at_once == b"one\ntwo\nthree\n"
    assert before == b""
    assert later == b"four\n"
    assert plain == b"five\n"


def test_gathered_lines_are_written_in_writes_a_pipe_keeps_whole() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = os.fdopen(w, "w")
    writer = _LineWriter(out)
    sizes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        sizes.append(len(data))
        return real_write(fd, data)

    lines = [f"{i:04d} " + "z" * (i * 37 % 1500) for i in range(60)] + ["x" * (GATHER_BYTES + 10)]

    async def log_lines() -> None:
        for line in lines:
            writer.info(line)

    os.write = counting_write  # type: ignore[assignment]
    try:
        asyncio.run(log_lines())  # the loop ends before the timer: the rest are written at exit
        writer.flush()
    finally:
        os.write = real_write
    got = _read_available(r).decode().splitlines()
    out.close()
    os.close(r)
    assert got == lines
    assert len(sizes) < len(lines) / 3  # gathered
    assert max(sizes[:-1]) <= GATHER_BYTES  # all but the one line longer than a pipe keeps whole


def test_lines_gathered_for_one_output_reach_it_when_logging_is_configured_for_another() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = os.fdopen(w, "w")
    other = io.StringIO()

    async def log_then_reconfigure() -> None:
        structlog.get_logger("lines").info("gathered")
        with _logging_to(other):  # another output: the pipe's lines go first
            structlog.get_logger("lines").info("elsewhere")

    with _logging_to(out):
        asyncio.run(log_then_reconfigure())
    got = _read_available(r)
    out.close()
    os.close(r)
    assert [json.loads(line)["event"] for line in got.splitlines()] == ["gathered"]
    assert [json.loads(line)["event"] for line in other.getvalue().splitlines()] == ["elsewhere"]
