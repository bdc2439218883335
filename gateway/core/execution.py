"""A routed, started request: the first token is ready, the rest streams, watched for stalls.

An ``Execution`` is values for the front ends (route, nodes, cached tokens, attempts, the
request's notes) and the node's token stream; how the front ends show them (HTTP headers, gRPC
metadata) is theirs. When its node fails after the first token, the generation migrates to
another node (``gateway.core.migration``) and the stream goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import structlog

from prefixgate.gateway.cluster.breaker import OPEN
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.core import migration
from prefixgate.gateway.core.errors import StreamBroken
from prefixgate.gateway.core.request import Prepared, Timings
from prefixgate.gateway.nodeclient import NodeFailure, TokenDelta, TokenStream
from prefixgate.gateway.vocab import FailureKind, Stage

log = structlog.get_logger("prefixgate.pipeline")


class Execution:
    """A routed, started request: the first token is ready, the rest streams.

    It owns the node's token stream and its count of the decode node's streams (``Node.streaming``,
    given back when it is closed, however it ends) and nothing of the pipeline: when it is closed
    it reports itself once through ``on_close`` (the pipeline's accounting).
    """

    def __init__(
        self,
        prep: Prepared,
        *,
        route: str,
        reason: str,
        prefill_node: Node | None,
        decode_node: Node,
        stream: TokenStream,
        first: TokenDelta,
        predicted_tokens: int,
        timings: Timings,
        attempts: int,
        on_close: Callable[[Execution], None],
        stall_timeout_s: float = 0.0,
        cache_shared: bool = False,
        notes: dict[str, int] | None = None,
        index_hits: dict[str, int] | None = None,
        migrate: migration.Migrate | None = None,
        max_migrations: int = 0,
        block_size: int = 0,
    ) -> None:
        self.prep = prep
        self.route = route
        self.reason = reason
        self.prefill_node = prefill_node
        self.decode_node = decode_node
        self._stream = stream
        self._first: TokenDelta | None = first
        self.predicted_tokens = predicted_tokens
        self.timings = timings
        self.attempts = attempts
        # What routing knew (request log): the index's longest hit, how much further prefixes
        # routed but not yet in the index reached (tokens), the longest hit passed over.
        self.notes: dict[str, int] = notes or {}
        self.index_hits: dict[str, int] = index_hits or {}  # node -> leading blocks, per the index
        self.prompt_tokens = prep.prompt_tokens
        self.completion_tokens = 0
        self.finish_reason = ""
        self.outcome = "incomplete"
        self.failure: NodeFailure | None = None  # what broke the stream after the first token
        self._on_close = on_close
        self._stall_timeout_s = stall_timeout_s
        # The node's engine cache holds other tenants' prefixes too (``gateway.core.tenancy``).
        self._cache_shared = cache_shared
        self._waiting_since = 0.0  # loop time at which ``_next`` began waiting; 0 when not waiting
        self._waiter: asyncio.Task[object] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        self._done = False
        self._held = contextlib.ExitStack()  # what the execution holds on the nodes until closed
        self._held.enter_context(decode_node.streaming())
        # The nodes of the first token (the request's timings and cache figures are theirs, after
        # a migration too): the prefill node on the split path, and the node that computed the prompt.
        self.first_prefill_node = prefill_node
        self.prompt_node = prefill_node or decode_node
        self._migrate = migrate
        self._migrations_left = max_migrations
        self._block_size = block_size
        self.migrations = 0
        self.sent_ids: list[int] = []  # the output token ids relayed (what a migration continues from)
        self._cached_at_start: int | None = None  # the first stream's cached tokens, once migrated
        self._failed_nodes: set[str] = set()
        self._unwatch_gone_spell: Callable[[], None] | None = None
        self._gone_checked = False  # whether the node's departure is watched (when it may migrate)
        self._gone = False

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    @property
    def engine_cached_tokens(self) -> int:
        """What the node says it served from its cache (operators' figures): the first node's,
        after a migration (the prompt's, not the continuation's)."""
        return self._stream.cached_tokens if self._cached_at_start is None else self._cached_at_start

    @property
    def cached_tokens(self) -> int:
        """The cached tokens the tenant is told of (body, headers, usage): on an engine whose
        cache is shared between tenants, no more than the tenant's own prefixes account for."""
        engine = max(0, self.engine_cached_tokens)
        if self._cache_shared:
            return min(engine, self.predicted_tokens)
        return engine

    async def stream(self) -> AsyncIterator[TokenDelta]:
        """Every delta until the finish, migrating when the node fails mid-stream; raises
        StreamBroken when it fails and the generation cannot migrate."""
        try:
            while not self.finish_reason:
                if self._first is not None:
                    d, self._first = self._first, None
                else:
                    try:
                        d = await self._next()
                    except (StopAsyncIteration, NodeFailure) as e:
                        failure, reason, what = self._failure(e)
                        limit = self.prep.sampling.max_tokens
                        if 0 < limit <= self.completion_tokens and self._migratable():
                            yield self._cut_at_max_tokens()  # all asked for is out: nothing to continue
                            break
                        await self._continue(failure, reason, what)
                        continue
                if self._past_max_tokens(d):  # an engine that goes on past max_tokens is cut
                    yield self._cut_at_max_tokens()
                    break
                self._account(d)
                yield d
        finally:
            await self.close()

    def _failure(self, e: StopAsyncIteration | NodeFailure) -> tuple[NodeFailure, migration.Reason, str]:
        """The streaming node's failure, why it would migrate, and what the error event says."""
        if isinstance(e, NodeFailure):
            return e, migration.reason_of(e), f"failed mid-stream: {e.kind}"
        what = "ended the stream without finishing"
        return (
            NodeFailure(self.decode_node.id, Stage.DECODE, FailureKind.INTERNAL, what),
            migration.Reason.ENDED,
            what,
        )

    async def _continue(self, failure: NodeFailure, reason: migration.Reason, what: str) -> None:
        """Go on from another node after ``failure`` of the streaming node, or raise StreamBroken."""
        node = self.decode_node
        if not self._migratable():
            reports_ids = self._migrate is not None and migration.resumable(node, self.prep)
            if reports_ids and len(self.sent_ids) != self.completion_tokens:
                log.warning(  # a protocol that reports ids should report one a token
                    "stream_not_migrated",
                    request_id=self.request_id,
                    node=node.id,
                    sent_ids=len(self.sent_ids),
                    completion_tokens=self.completion_tokens,
                )
            self.failure = failure  # charged to the node by the accounting
        elif await self._migrated(failure, reason):
            return
        self.outcome = "broken"
        raise StreamBroken(f"decode node {node.id} {what}") from failure

    def _migratable(self) -> bool:
        return (
            self._migrate is not None
            and self._migrations_left > 0
            and migration.resumable(self.decode_node, self.prep)
            and len(self.sent_ids) == self.completion_tokens
        )

    async def _migrated(self, failure: NodeFailure, reason: migration.Reason) -> bool:
        """Start the generation's continuation on another node and adopt its stream (the failed
        node charged with ``failure`` now); False when none started."""
        assert self._migrate is not None
        self._migrations_left -= 1
        failed = self.decode_node
        await self._stream.aclose()
        migration.charge(failed, failure)
        self._failed_nodes.add(failed.id)
        log.warning(
            "stream_migrating",
            request_id=self.request_id,
            node=failed.id,
            reason=reason.value,
            sent_tokens=len(self.sent_ids),
            detail=failure.detail[:200],
        )
        cont = migration.continuation(self.prep, self.sent_ids, self._block_size)
        started = await migration.started(self._migrate, cont, self._failed_nodes, reason)
        if started is None:
            return False
        self._adopt(started)
        return True

    def _adopt(self, other: Execution) -> None:
        """Stream from ``other`` (the continuation's execution) from now on: its stream, its
        nodes and what it holds on them; ``other`` is spent (closing it does nothing)."""
        if self._cached_at_start is None:
            self._cached_at_start = self._stream.cached_tokens
        self._held.close()  # the failed node's stream count
        self._held, other._held = other._held, contextlib.ExitStack()
        self._stream = other._stream
        self._first, other._first = other._first, None
        self.decode_node, self.prefill_node = other.decode_node, other.prefill_node
        self.attempts += other.attempts
        self.migrations += 1
        other._done = True
        self._stalled = False
        self._unwatch_gone()

    async def _next(self) -> TokenDelta:
        """The next delta, or a TIMEOUT failure of the decode node when it stalls, or a GONE one
        when it is declared gone (watched only when the generation may migrate).

        One timer watches the waits (``_watch``), re-armed once a stall period, instead of one
        timer armed and cancelled for every token: that cost more than relaying the token.
        """
        if not self._gone_checked:
            self._gone_checked = True
            if self._migratable():
                self._watch_gone()
        if self._gone:
            raise self._gone_failure()
        if self._stall_timeout_s <= 0 and self._unwatch_gone_spell is None:
            return await self._stream.__anext__()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        self._waiter = task
        if self._stall_timeout_s > 0:
            self._waiting_since = loop.time()
            if self._watchdog is None:
                self._watchdog = loop.call_at(self._waiting_since + self._stall_timeout_s, self._watch)
        cancelling = task.cancelling() if task is not None else 0
        try:
            return await self._stream.__anext__()
        except asyncio.CancelledError:
            if (self._stalled or self._gone) and task is not None and task.uncancel() <= cancelling:
                if self._gone:
                    raise self._gone_failure() from None
                raise NodeFailure(
                    self.decode_node.id,
                    Stage.DECODE,
                    FailureKind.TIMEOUT,
                    f"no token for {self._stall_timeout_s:g}s",
                ) from None
            raise  # cancelled from outside (client gone, shutdown)
        finally:
            self._waiting_since = 0.0
            self._waiter = None

    def _gone_failure(self) -> NodeFailure:
        detail = "node declared gone mid-stream"
        return NodeFailure(self.decode_node.id, Stage.DECODE, FailureKind.GONE, detail)

    def _watch_gone(self) -> None:
        """Wake the wait in progress when the streaming node is declared gone (``Node.gone``),
        as ``_first_unless_gone`` does before the first token: it migrates at once instead of
        after ``stall_timeout_s``."""
        node = self.decode_node
        if node.breaker.state == OPEN:  # declared gone before the watch began
            self._gone = True
            return
        self._unwatch_gone_spell = node.gone.watch(self._on_gone)

    def _on_gone(self) -> None:
        if self._done:
            return
        self._gone = True
        if self._waiter is not None:
            self._waiter.cancel()

    def _unwatch_gone(self) -> None:
        self._gone = False
        self._gone_checked = False
        if self._unwatch_gone_spell is not None:
            self._unwatch_gone_spell()
            self._unwatch_gone_spell = None

    def _watch(self) -> None:
        """Cancel the wait in progress if it has lasted the stall timeout, else watch it on."""
        self._watchdog = None
        if not self._waiting_since or self._done:
            return  # not waiting: the next wait re-arms
        loop = asyncio.get_running_loop()
        due = self._waiting_since + self._stall_timeout_s
        if loop.time() >= due:
            self._stalled = True
            if self._waiter is not None:
                self._waiter.cancel()
        else:
            self._watchdog = loop.call_at(due, self._watch)

    def _past_max_tokens(self, d: TokenDelta) -> bool:
        """``max_tokens`` were relayed and the engine sends more without finishing (its own finish
        right at the limit, ``stop`` or ``length``, passes as it is)."""
        limit = self.prep.sampling.max_tokens
        more = d.completion_tokens > self.completion_tokens  # text held back and flushed is not more
        return 0 < limit <= self.completion_tokens and more and not d.finish_reason

    def _cut_at_max_tokens(self) -> TokenDelta:
        """The finish the engine did not send: ``length`` at ``max_tokens`` (the node's work is
        cancelled when the stream closes; usage counts no more than was asked for)."""
        limit = self.prep.sampling.max_tokens
        log.warning(
            "engine_past_max_tokens",
            request_id=self.request_id,
            node=self.decode_node.id,
            max_tokens=limit,
            completion_tokens=self.completion_tokens,
        )
        self.completion_tokens = limit
        self.finish_reason = "length"
        self.outcome = "ok"
        return TokenDelta(finish_reason="length", completion_tokens=limit)

    def _account(self, d: TokenDelta) -> None:
        if d.token_ids:
            self.sent_ids += d.token_ids
        if d.completion_tokens:
            self.completion_tokens = d.completion_tokens
        if d.prompt_tokens:  # the engine's own count (an HTTP worker tokenizes itself)
            self.prompt_tokens = d.prompt_tokens
        if d.finish_reason:
            self.finish_reason = d.finish_reason
            self.outcome = "ok"

    async def close(self) -> None:
        """End the request: cancels the node's work if it is still running. Idempotent."""
        if self._done:
            return
        self._done = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._unwatch_gone()
        try:
            await self._stream.aclose()
        finally:
            self._held.close()
            self._on_close(self)
