"""A request's ``n`` choices running at once on this node, whatever leg of a request they are:
started together or not at all, their chunks merged as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import TypeVar

from prefixgate.backends.generation import Chunk
from prefixgate.gateway.core.streams import tagged_merge

Gen = AsyncGenerator[Chunk, None]
Started = tuple[Gen, Chunk]  # a started choice: its chunks, and the first one already read
T = TypeVar("T")


async def start_all(starts: Sequence[Awaitable[T]]) -> list[T]:
    """Start choices at once; when one cannot start, the others are stopped (the started ones'
    chunks closed) and its error raised."""
    tasks = [asyncio.ensure_future(s) for s in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            done = t.result() if not t.cancelled() and t.exception() is None else None
            if isinstance(done, tuple):
                await done[0].aclose()
        raise


def merged(started: Sequence[Started]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """The chunks after each choice's first, tagged with the choice's index, as they come."""
    return tagged_merge([g for g, _ in started])


async def close_all(started: Sequence[Started]) -> None:
    for gen, _ in started:
        await gen.aclose()


async def nothing_after(chunk: Chunk) -> Gen:
    """The chunks of a leg after its first (and only) one: none."""
    return
    yield chunk
