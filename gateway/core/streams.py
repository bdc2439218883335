"""Several async streams read as one, each item tagged with the index of its stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def tagged_merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """``(index, item)`` from every stream as the items come (ties in index order), until all end.

    One read per stream is in flight at a time, so a stream is never read ahead of what was
    yielded; on exit the reads still pending are cancelled, and generators among the streams are
    closed. An error from a stream propagates (the others are then cancelled and closed)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future[T], int] = {}

    def ask(i: int) -> None:
        pending[asyncio.ensure_future(anext(streams[i]))] = i

    try:
        for i in range(len(streams)):
            ask(i)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                ask(i)
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            if isinstance(s, AsyncGenerator):
                await s.aclose()
