"""JSON bodies of many values parsed in a worker process.

``orjson`` holds the interpreter lock for the whole parse, and its cost grows with the number
of values, not bytes: a 7 MB body of 450k small objects takes about a second, a 7 MB prompt
string a few milliseconds. On a worker thread the first would still stop the event loop for
all that time. So a body that may hold more than ``inline_values`` values is parsed by a worker
process, which hands it back only once it is within the value bound (``schema.parse_json``):
what crosses back is small, and an oversized body costs the gateway's own process nothing but
the bytes it already read. Whether a body may hold that many is read off its bytes in
microseconds (``values_bound``).

The worker imports this module alone (``orjson`` and ``prefixgate.openai.schema``), never the gateway.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from prefixgate.gateway.core import errors as exceptions
from prefixgate.openai.schema import parse_json

Outcome = tuple[dict[str, Any] | None, tuple[str, str, str | None, str | None] | None]


def parse_outcome(raw: bytes, max_values: int) -> Outcome:
    """Runs in the worker: the body, or the domain error as plain fields (they pickle)."""
    try:
        return parse_json(raw, max_values), None
    except exceptions.GatewayError as e:
        return None, (type(e).__name__, e.message, e.param, e.code)


def values_bound(raw: bytes) -> int:
    """At least as many as the JSON values in ``raw``: each value but the root follows a ``,``
    or opens a container's contents (a ``[`` or ``{``); those bytes inside strings only add."""
    if len(raw) <= 2:
        return 1
    return len(raw) - len(raw.translate(None, b",[{")) + 1  # one pass over the bytes


def _raise(error: tuple[str, str, str | None, str | None]) -> None:
    name, message, param, code = error
    cls = getattr(exceptions, name, exceptions.InvalidRequest)
    raise cls(message, param=param, code=code)


class BodyParser:
    """Parses bodies of more than ``inline_values`` values in up to ``workers`` processes."""

    def __init__(self, max_values: int, inline_values: int = 16_384, workers: int = 2) -> None:
        self.max_values = max_values
        self.inline_values = inline_values
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def inline(self, raw: bytes) -> bool:
        """Cheap enough to parse on the event loop (a few ms at most). A JSON value takes two
        bytes at least, so a short body needs no counting."""
        return len(raw) <= 2 * self.inline_values or values_bound(raw) <= self.inline_values

    async def parse(self, raw: bytes) -> dict[str, Any]:
        if self.inline(raw):
            return parse_json(raw, self.max_values)
        if self._pool is None:  # spawned, not forked: the gateway runs threads (gRPC, uvloop)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        body, error = await loop.run_in_executor(self._pool, parse_outcome, raw, self.max_values)
        if error is not None:
            _raise(error)
        assert body is not None
        return body

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
