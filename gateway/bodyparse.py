"""JSON bodies parsed in a worker process when they are large.

``orjson`` holds the interpreter lock for the whole parse: a body of a few MB made of hundreds
of thousands of small values takes about a second, and on a worker thread it would still stop
the event loop for all that time. A worker process parses it instead and hands back the body
only once it is within the value bound (``schema.parse_json``), so what crosses back is small;
an oversized body costs the gateway's own process nothing but the bytes it already read.

The worker imports this module alone (``orjson`` and ``gateway.schema``), never the gateway.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from gateway import exceptions
from gateway.schema import parse_json

Outcome = tuple[dict[str, Any] | None, tuple[str, str, str | None, str | None] | None]


def parse_outcome(raw: bytes, max_values: int) -> Outcome:
    """Runs in the worker: the body, or the domain error as plain fields (they pickle)."""
    try:
        return parse_json(raw, max_values), None
    except exceptions.GatewayError as e:
        return None, (type(e).__name__, e.message, e.param, e.code)


def _raise(error: tuple[str, str, str | None, str | None]) -> None:
    name, message, param, code = error
    cls = getattr(exceptions, name, exceptions.InvalidRequest)
    raise cls(message, param=param, code=code)


class BodyParser:
    """Parses bodies at least ``offload_bytes`` long in up to ``workers`` processes."""

    def __init__(self, max_values: int, offload_bytes: int, workers: int = 2) -> None:
        self.max_values = max_values
        self.offload_bytes = offload_bytes
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, raw: bytes) -> dict[str, Any]:
        if len(raw) < self.offload_bytes:
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
