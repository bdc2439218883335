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

import contextvars
import logging
import os
import sys
import threading
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


class _LineWriter:
    """Writes each log line, its newline included, in one ``write`` to the file's descriptor:
    gateway workers share one stderr, and a line written in pieces (the text, then its newline,
    as ``print`` does) is cut by a sibling's line. A pipe keeps a write of up to ``PIPE_BUF``
    (4 KiB on Linux) whole, a file opened for appending any write. A line the output cannot
    take (a pipe whose reader went away, a closed file) is dropped: a log line is never worth
    a failed request or a shutdown that cannot finish."""

    def __init__(self, file: Any) -> None:
        self._file = file
        # Reentrant: a signal handler runs in the thread it interrupted, and one that logs (the
        # supervisor's stop) while that thread is writing a line would otherwise wait on itself
        # forever. Its line then goes before the rest of a line longer than a pipe write.
        self._lock = threading.RLock()

    def msg(self, message: str) -> None:
        line = message + "\n"
        with self._lock:
            try:
                self._file.flush()  # whatever the stream itself holds goes first
                try:
                    fd = self._file.fileno()
                except (OSError, ValueError, AttributeError):  # no descriptor: an in-memory stream
                    self._file.write(line)
                    return
                data = line.encode("utf-8", "backslashreplace")
                while data:
                    data = data[os.write(fd, data) :]
            except (OSError, ValueError):
                pass

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _line_writer_factory(file: Any) -> Callable[..., _LineWriter]:
    writer = _LineWriter(file)

    def make(*_args: Any) -> _LineWriter:
        return writer

    return make


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
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_line_writer_factory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.WARNING))


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
