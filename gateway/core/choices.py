"""A request's ``n`` choices: ``n`` independent generations of one prepared prompt.

Choice ``i`` is the prepared request with ``Sampling.choice = i`` (the engine mixes it into its
sampling seed, so choices differ and each is reproducible under a ``seed``) and its own request
id (``ID-i``; choice 0 keeps the request's). Each choice is routed like any request: they share
the prompt's blocks, so once the first is prefilled the others mostly hit the cache. The request
holds one admission slot for all its choices (``n`` is bounded by ``schema.MAX_N``).

All choices are started before anything is sent (a choice that cannot start fails the request,
and the ones started are closed); their deltas are then merged as they come, tagged with their
index. ``n = 1`` is a single execution with no merging.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from prefixgate.gateway.core.runner import Caller, Prepare, RequestRunner, deltas
from prefixgate.gateway.core.streams import tagged_merge

if TYPE_CHECKING:
    from prefixgate.gateway.core.pipeline import Delta, Execution, Pipeline, Prepared


def choice_of(prep: Prepared, i: int) -> Prepared:
    """The prepared request of choice ``i`` (choice 0 is the request itself)."""
    if i == 0:
        return prep
    return replace(prep, request_id=f"{prep.request_id}-{i}", sampling=replace(prep.sampling, choice=i))


class Choices:
    """The started executions of one request, one per choice, in choice order."""

    def __init__(self, executions: list[Execution]) -> None:
        self.executions = executions

    @property
    def first(self) -> Execution:
        return self.executions[0]

    @property
    def request_id(self) -> str:
        return self.first.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.first.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.first.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(ex.completion_tokens for ex in self.executions)

    async def stream(self) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, delta)`` as the choices produce them; ``StreamBroken`` if one breaks."""
        async for i, d in tagged_merge([deltas(ex) for ex in self.executions]):
            yield i, d

    async def close(self) -> None:
        for ex in self.executions:
            await ex.close()


async def start(pipeline: Pipeline, prep: Prepared, n: int) -> Choices:
    """Execute every choice concurrently; on any failure the started ones are closed."""
    if n == 1:
        return Choices([await pipeline.execute(prep)])
    tasks = [asyncio.ensure_future(pipeline.execute(choice_of(prep, i))) for i in range(n)]
    try:
        await asyncio.gather(*tasks)
        return Choices([t.result() for t in tasks])
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await t.result().close()
        raise


@asynccontextmanager
async def run(
    runner: RequestRunner, caller: Caller, prepare: Prepare, count: Callable[[], int]
) -> AsyncIterator[Choices]:
    """``runner.admitted``, then every choice started (``count()`` of them, read once prepared);
    closed and the slot released on exit."""
    async with runner.admitted(caller, prepare) as prep:
        choices = await start(runner.svc.pipeline, prep, count())
        try:
            yield choices
        finally:
            await choices.close()
