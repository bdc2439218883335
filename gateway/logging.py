"""structlog set-up: JSON lines in production, readable in a terminal.

Every line of a request carries its ``request_id``: the front ends call ``bind_request`` at the
start of each request (HTTP handler, gRPC method), which binds it in the request's log fields;
asyncio tasks started from there (streams, index writes) inherit them. The fields are one
context variable holding a dict that is replaced, never changed in place (``bind_fields`` adds
to it): structlog's own context variables are one variable a key, and its processor walks every
variable of the context on every line, a hundredth of a request's CPU in the gateway.
Standard-library loggers (uvicorn, grpc, asyncio) are rendered the same way.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import logging
import os
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from types import MappingProxyType
from typing import Any

import orjson
import structlog


def _dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def _renderer(fmt: str) -> structlog.typing.Processor:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    if use_json:
        return structlog.processors.JSONRenderer(serializer=_dumps)
    return structlog.dev.ConsoleRenderer(colors=False)


_FIELDS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "prefixgate_log_fields", default=MappingProxyType({})
)


def _merge_fields(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for k, v in _FIELDS.get().items():
        event.setdefault(k, v)
    return event


def _with(fields: Mapping[str, Any]) -> structlog.typing.Processor:
    def add(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for k, v in fields.items():
            event.setdefault(k, v)
        return event

    return add


#: How long an event loop's info lines to a pipe wait to be written together, and how many
#: bytes of them at most: a pipe keeps a write of up to ``PIPE_BUF`` whole (``_LineWriter``).
GATHER_S = 0.05
GATHER_BYTES = select.PIPE_BUF

#: Lines an event loop's thread has held while the output could not take them (a pipe whose
#: reader stalled), at most this many bytes; past it, its new lines are dropped and counted.
MAX_HELD_BYTES = 1024 * 1024


def _on_event_loop() -> bool:
    return asyncio._get_running_loop() is not None


class _LineWriter:
    """Writes each log line, its newline included, in one ``write`` to the file's descriptor:
    gateway workers share one stderr, and a line written in pieces (the text, then its newline,
    as ``print`` does) is cut by a sibling's line. A pipe keeps a write of up to ``PIPE_BUF``
    (4 KiB on Linux) whole, a file opened for appending any write. A line the output cannot
    take (a pipe whose reader went away, a closed file) is dropped: a log line is never worth
    a failed request or a shutdown that cannot finish.

    Nor is it worth the event loop: a pipe whose reader is alive but stalls (a log shipper
    behind, a pager paused) once had every request and ``/healthz`` wait on a full pipe (64 KiB,
    a hundred requests' lines). A line goes through a non-blocking descriptor of the same pipe
    (``_open``); one the pipe has no room for is held, the lines after it behind it, and a
    thread writes them as the reader takes them. An event loop's thread leaves its line there
    and goes on (past ``max_held_bytes`` held, its lines are dropped, and a line says how many
    once the output flows again); any other thread waits until its line is written, as it would
    on a blocking write, so a script that logs faster than its reader reads loses nothing.

    A write to a pipe wakes its reader (a container runtime's, a log shipper), and on the
    two-core benchmark machine not writing the request line at all took 5 % off a request's
    CPU. So an event loop's info and debug lines to a pipe are gathered (``gather``): up to
    ``GATHER_S`` and ``GATHER_BYTES`` (``PIPE_BUF``, so they still arrive whole), then written
    together. A warning or an error is written at once, after the lines gathered before it, as
    is every line of another thread; the lines gathered are written at exit too. What a process
    killed outright loses is at most the last ``GATHER_S`` of info lines."""

    def __init__(self, file: Any, max_held_bytes: int = MAX_HELD_BYTES) -> None:
        self._file = file
        # Reentrant: a signal handler runs in the thread it interrupted, and one that logs (the
        # supervisor's stop) while that thread is writing a line would otherwise wait on itself
        # forever. Its line then goes before the rest of a line longer than a pipe write.
        self._lock = threading.RLock()
        self._written = threading.Condition(self._lock)
        self._max_held = max_held_bytes
        self._fd = -1  # the file's descriptor the next one is for
        self._nb_fd = -1  # a non-blocking descriptor of the same pipe; -1: none (not a pipe)
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._queued = 0  # lines ever held, and of them written (or lost): a waiter's turn
        self._done = 0
        self._dropped = 0
        self._draining = False  # a thread writes the held lines: new ones queue behind them
        self._gathered: list[bytes] = []  # an event loop's info lines not yet written
        self._gathered_bytes = 0
        self._due: asyncio.AbstractEventLoop | None = None  # the loop whose timer writes them

    def msg(self, message: str) -> None:
        """A line written now, after the lines gathered before it."""
        with self._lock:
            try:
                self._write_now(self._output(), message + "\n")
            except (OSError, ValueError):
                pass

    def gather(self, message: str) -> None:
        """An info or debug line: on an event loop's thread writing to a pipe, written with the
        lines after it once ``GATHER_S`` passed or ``GATHER_BYTES`` would be exceeded; else now."""
        loop = asyncio._get_running_loop()
        if loop is None:
            self.msg(message)
            return
        line = message + "\n"
        with self._lock:
            try:
                fd = self._output()
                if fd < 0 or self._nb_fd < 0:  # not a pipe: nobody to wake
                    self._write_now(fd, line)
                    return
                data = line.encode("utf-8", "backslashreplace")
                if self._due is not loop or self._gathered_bytes + len(data) > GATHER_BYTES:
                    self._write_gathered()  # another loop's (it may be gone), or full
                if len(data) > GATHER_BYTES:
                    self._put(fd, data)
                    return
                self._gathered.append(data)
                self._gathered_bytes += len(data)
                if self._due is not loop:
                    self._due = loop
                    loop.call_later(GATHER_S, self._gathered_due, loop)
            except (OSError, ValueError):
                pass

    def flush(self) -> None:
        """Write the lines gathered so far."""
        with self._lock:
            try:
                self._write_gathered()
            except (OSError, ValueError):
                pass

    def _gathered_due(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._due is loop:
                self._due = None
            try:
                self._write_gathered()
            except (OSError, ValueError):
                pass

    def _output(self) -> int:
        """The descriptor lines go to (-1: an in-memory stream), after what the stream itself
        holds; a new one is opened for (``_open``)."""
        self._file.flush()
        try:
            fd: int = self._file.fileno()
        except (OSError, ValueError, AttributeError):
            return -1
        if fd != self._fd:
            self._open(fd)
        return fd

    def _write_now(self, fd: int, line: str) -> None:
        """``line`` written to ``fd`` (-1: the in-memory stream), after the lines gathered before
        it (the lock held)."""
        self._write_gathered()
        if fd < 0:
            self._file.write(line)
        else:
            self._put(fd, line.encode("utf-8", "backslashreplace"))

    def _write_gathered(self) -> None:
        """The lines gathered, in one write (the lock held)."""
        if self._gathered:
            data, lines = b"".join(self._gathered), len(self._gathered)
            self._gathered.clear()
            self._gathered_bytes = 0
            self._put(self._fd, data, lines)

    def _put(self, fd: int, data: bytes, lines: int = 1) -> None:
        """``data`` (``lines`` lines) written to ``fd``, or held for the draining thread when
        the pipe is full (the lock held)."""
        if self._nb_fd < 0:
            while data:
                data = data[os.write(fd, data) :]
            return
        if not self._draining:
            try:
                data = data[os.write(self._nb_fd, data) :]
            except BlockingIOError:
                pass
            if not data:
                return
        if _on_event_loop():
            if self._held_bytes + len(data) > self._max_held:
                self._dropped += lines
            else:
                self._hold(data)
            return
        turn = self._hold(data)
        while self._done < turn and self._draining:
            self._written.wait()

    def _open(self, fd: int) -> None:
        """Take ``fd`` as the output: a pipe gets a non-blocking descriptor of its own (opened
        anew: the flag is not set on the descriptor other processes share)."""
        self._write_gathered()  # to the output they were gathered for
        if self._nb_fd >= 0:
            os.close(self._nb_fd)
        self._fd, self._nb_fd = fd, -1
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                self._nb_fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)

    def _hold(self, data: bytes) -> int:
        """Queue ``data`` for the draining thread (started if none runs); its turn."""
        self._held.append(data)
        self._held_bytes += len(data)
        self._queued += 1
        if not self._draining:
            self._draining = True
            threading.Thread(target=self._drain, name="prefixgate-log-drain", daemon=True).start()
        return self._queued

    def _drain(self) -> None:
        """Write the held lines in order, blocking as the reader allows; then say how many were
        dropped meanwhile, and let callers write again themselves."""
        while True:
            with self._lock:
                if not self._held and self._dropped:
                    note = {"event": "log_lines_dropped", "count": self._dropped, "level": "warning"}
                    self._dropped = 0
                    self._hold(orjson.dumps(note) + b"\n")
                if not self._held:
                    self._draining = False
                    self._written.notify_all()
                    return
                data = self._held.popleft()
                self._held_bytes -= len(data)
                fd = self._fd
            try:
                while data:
                    data = data[os.write(fd, data) :]
            except OSError:  # the reader went away: what is held goes with it
                with self._lock:
                    self._done += len(self._held)
                    self._held.clear()
                    self._held_bytes = 0
            with self._lock:
                self._done += 1
                self._written.notify_all()

    def wait_drained(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the held lines to be written (at exit: a reader
        that is only slow still gets the last lines, the shutdown's)."""
        self.flush()
        deadline = time.monotonic() + timeout
        while self._draining and time.monotonic() < deadline:
            time.sleep(0.01)

    log = debug = info = gather
    warn = warning = fatal = failure = err = error = critical = exception = msg


#: How long a process's exit waits for its held log lines to be written.
EXIT_DRAIN_S = 5.0

_writer: _LineWriter | None = None  # the process's, for the file it was made for


def _writer_for(file: Any) -> _LineWriter:
    """One writer an output for the whole process: configured again (a gateway worker, tests),
    logging keeps its held lines and its descriptor rather than opening another."""
    global _writer
    if _writer is None or _writer._file is not file:
        if _writer is not None:
            _writer.flush()  # its gathered lines, to the output they were logged for
        _writer = _LineWriter(file)
    return _writer


@atexit.register
def _drain_at_exit() -> None:
    if _writer is not None:
        _writer.wait_drained(EXIT_DRAIN_S)


def _forget_gathered_in_child() -> None:
    """A forked child does not write its parent's gathered lines again."""
    if _writer is not None:
        _writer._gathered.clear()
        _writer._gathered_bytes = 0
        _writer._due = None


os.register_at_fork(after_in_child=_forget_gathered_in_child)


def _line_writer_factory(writer: _LineWriter) -> Callable[..., _LineWriter]:
    def make(*_args: Any) -> _LineWriter:
        return writer

    return make


class _WriterHandler(logging.Handler):
    """The standard loggers' lines (uvicorn's, grpc's, asyncio's) through the same writer: in
    order with the rest, and never blocking on a stalled pipe either."""

    def __init__(self, writer: _LineWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.writer.msg(self.format(record))
        except Exception:
            self.handleError(record)


def configure_logging(
    fmt: str = "auto", level: str = "info", every_line: Mapping[str, Any] | None = None
) -> None:
    """structlog and the standard loggers; ``every_line``: fields on every line of this process
    (a gateway worker's index)."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[structlog.typing.Processor] = [
        *([_with(dict(every_line))] if every_line else []),
        _merge_fields,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = _renderer(fmt)
    writer = _writer_for(sys.stderr)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=_with_fields_method(structlog.make_filtering_bound_logger(lvl), lvl),
        logger_factory=_line_writer_factory(writer),
        cache_logger_on_first_use=True,
    )
    handler = _WriterHandler(writer)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.WARNING))


def _with_fields_method(base: type[Any], level: int) -> type[Any]:
    """``base`` (a filtering bound logger class) with ``info_fields``, where ``level`` lets info
    lines through: structlog's ``_process_event``, its documented hook for wrapper classes."""

    def info_fields(self: Any, event: str, fields: dict[str, Any]) -> Any:
        args, kw = self._process_event("info", event, fields)
        return self._logger.info(*args, **kw)

    def nothing(self: Any, event: str, fields: dict[str, Any]) -> None:
        return None

    method = info_fields if level <= logging.INFO else nothing
    return type(base.__name__, (base,), {"info_fields": method})


def info_fields(logger: Any, event: str, fields: dict[str, Any]) -> None:
    """``logger.info(event, **fields)``, the fields handed over as the dict they are. Passed as
    keywords, a line's fields are unpacked and packed again in each of structlog's three calls,
    every name compared with the parameters': half of what the request line of some 25 fields
    cost (117 K instructions, 58 K this way). The same processors write the same line; a
    logger that is not configured here (``info_fields`` missing) takes them as keywords."""
    method = getattr(logger, "info_fields", None)
    if method is None:
        logger.info(event, **fields)
    else:
        method(event, fields)


def bind_request(request_id: str | None, **fields: Any) -> str:
    """Start a request's log context: its id (a new one when the client sent none) and fields."""
    # 128 random bits as 32 hex digits, as a uuid4's hex but without building the UUID (a
    # microsecond of every request)
    rid = request_id or os.urandom(16).hex()
    _FIELDS.set({"request_id": rid, **fields})
    return rid


def bind_fields(**fields: Any) -> None:
    """Add ``fields`` to every later line of this request (and of the tasks it starts)."""
    _FIELDS.set({**_FIELDS.get(), **fields})


def current_request_id() -> str | None:
    rid = _FIELDS.get().get("request_id")
    return rid if isinstance(rid, str) else None
