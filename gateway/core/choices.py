"""A request's ``n`` choices: ``n`` independent generations of one prepared prompt.

Choice ``i`` is the prepared request with ``Sampling.choice = i`` (the engine mixes it into its
sampling seed, so choices differ and each is reproducible under a ``seed``) and its own request
id (``ID-i``; choice 0 keeps the request's). Each choice is routed like any request: they share
the prompt's blocks, so once the first is prefilled the others mostly hit the cache. The request
holds one admission slot for all its choices (``n`` is bounded by ``schema.MAX_N``).

All choices are started before anything is sent (a choice that cannot start fails the request,
and the ones started are closed); their deltas are then merged as they come, tagged with their
index. ``n = 1`` is a single execution with no merging: a streamed token passes the execution's
stream and ``Choices.stream``, nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from prefixgate.gateway.core.errors import StreamBroken
from prefixgate.gateway.core.streams import tagged_merge
from prefixgate.gateway.records import record

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

    @property
    def migrations(self) -> int:
        """How many times a choice's generation moved to another node (``gateway.core.migration``)."""
        return sum(ex.migrations for ex in self.executions)

    async def stream(self) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, delta)`` as the choices produce them. Each choice migrates on its own
        when its node fails after the first token; one that cannot is ``StreamBroken``, with the
        one message both front ends send (HTTP: an SSE error event or a 502; gRPC: UNAVAILABLE)."""
        try:
            if len(self.executions) == 1:
                deltas = self.first.stream()
                try:
                    async for d in deltas:
                        yield 0, d
                finally:
                    if isinstance(deltas, AsyncGenerator):
                        await deltas.aclose()
            else:
                async with aclosing(tagged_merge([ex.stream() for ex in self.executions])) as merged:
                    async for item in merged:
                        yield item
        except StreamBroken as e:
            raise StreamBroken(f"generation failed after it started: {e}") from e

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


@record
class Generate:
    """The runner's job (``gateway.core.runner.Job``) of a completion: its ``n`` choices."""

    pipeline: Pipeline
    n: int = 1

    async def start(self, prepared: Prepared) -> Choices:
        return await start(self.pipeline, prepared, self.n)

    def max_output_tokens(self, prepared: Prepared) -> int:
        """Every choice may generate its ``max_tokens`` (the effective one, clamped)."""
        return self.n * prepared.sampling.max_tokens

    async def close(self, started: Choices) -> None:
        await started.close()
