"""After the request: the blocks now on the nodes, the index's predictions checked, a stream
broken mid-way charged to its node, metrics and the request's log line, then the tenant's usage
(``on_finished``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.memory import MemoryIndex
from prefixgate.cachetier.writer import IndexWriter
from prefixgate.gateway import tracing
from prefixgate.gateway.cluster.nodes import Node
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.execution import Execution
from prefixgate.gateway.core.request import Prepared
from prefixgate.gateway.logging import info_fields
from prefixgate.gateway.metrics import Metrics

log = structlog.get_logger("prefixgate.pipeline")

MISPREDICTIONS_BEFORE_RESYNC = 3


def _ttft(ex: Execution) -> tuple[float, float]:
    """The request's time to first token, and the part of it after the node's queue, prefill and
    transfer (seconds)."""
    t, node_t = ex.timings, ex.timings.node
    ttft = (t.first_token_at - t.start) if t.first_token_at else 0.0
    return ttft, max(0.0, ttft - node_t.queue_s - node_t.prefill_s - node_t.transfer_s)


class Accounting:
    def __init__(self, settings: Settings, index: BlockIndex, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.writer = IndexWriter(index)
        # The embedded index is a dict in this process: a request's blocks go in at the loop's
        # next turn (a few microseconds; a long prompt's 2,000 blocks on a full index, evictions
        # and all, under a millisecond), instead of through the batching writer, whose task woke
        # for every request's blocks (1.7 % of a request's instructions) and left them unseen
        # for its batching interval. A subclass keeps its own ``store``.
        self._store_now = index.core.store if type(index) is MemoryIndex else None
        self.on_mispredict: Callable[[Node], None] | None = None
        self.on_finished: Callable[[Execution], None] | None = None  # tenant accounting

    def record(self, prep: Prepared, *nodes: str) -> None:
        """Record the blocks now on these nodes, off the request's own path: into the embedded
        index at the loop's next turn, else queued for the batching writer (a shared index is a
        round trip away)."""
        if prep.hashes:
            chain = tuple(prep.hashes)
            if self._store_now is not None:  # after the first token is on its way
                asyncio.get_running_loop().call_soon(self._store_now, [StoreOp(n, chain) for n in nodes])
            else:
                self.writer.submit_many(StoreOp(n, chain) for n in nodes)

    def _check_prediction(self, node: Node, predicted: int, reported: int) -> None:
        """A node whose reported hits keep falling short of the index's prediction gets resynced:
        this is how a silently emptied cache (a node restart the events missed) is caught. A node
        without KV events has nothing to resync from (and may not report cached tokens at all)."""
        if not node.client.capabilities.kv_events:
            return
        if predicted >= 2 * self.settings.block_size and reported < predicted // 2:
            node.mispredictions += 1
            if node.mispredictions >= MISPREDICTIONS_BEFORE_RESYNC and self.on_mispredict is not None:
                node.mispredictions = 0
                self.metrics.resyncs.labels("mispredicted").inc()
                log.warning("index_mispredicts_node", node=node.id, predicted=predicted, reported=reported)
                self.on_mispredict(node)
        else:
            node.mispredictions = 0

    def finished(self, ex: Execution) -> None:
        """A closed execution's accounting: its node charged and its span's stages now; metrics,
        the request's log line and the tenant's usage once the answer is on its way (``report``)."""
        if ex.failure is not None:  # broke after the first token: the node's fault all the same
            ex.decode_node.breaker.on_failure(time.monotonic())
            ex.decode_node.last_error = str(ex.failure)[:500]
            ex.decode_node.settle()
        if tracing.recording():  # the request's span ends with its answer: its stages first
            t, node_t = ex.timings, ex.timings.node
            first_token = _ttft(ex)[1]
            tracing.stages(
                t.start,
                (
                    ("prefixgate.queue", node_t.queue_s),
                    ("prefixgate.prefill", node_t.prefill_s),
                    ("prefixgate.kv_transfer", node_t.transfer_s),
                    ("prefixgate.first_token", first_token),
                ),
                {
                    "prefixgate.route": ex.route,
                    "prefixgate.prefill_node": ex.prefill_node.id if ex.prefill_node else "",
                    "prefixgate.decode_node": ex.decode_node.id,
                    "prefixgate.prompt_tokens": ex.prompt_tokens,
                    "prefixgate.cached_tokens": ex.engine_cached_tokens,
                    "prefixgate.predicted_cached_tokens": ex.predicted_tokens,
                    "prefixgate.completion_tokens": ex.completion_tokens,
                    "prefixgate.attempts": ex.attempts,
                    "prefixgate.migrations": ex.migrations,
                    "prefixgate.outcome": ex.outcome,
                },
            )
        asyncio.get_running_loop().call_soon(self.report, ex)

    def report(self, ex: Execution) -> None:
        """What a finished request reports, where its client does not wait for it: the callback
        runs after the answer is written and before anything read after it (the next request of
        a client or a tenant, a scrape)."""
        t, node_t = ex.timings, ex.timings.node
        ttft, first_token = _ttft(ex)
        m = self.metrics
        node = ex.prompt_node.id
        m.observe_request(
            ex.route,
            ex.outcome,
            ttft=ttft,
            queue_s=node_t.queue_s,
            prefill_s=node_t.prefill_s,
            transfer_s=node_t.transfer_s,
            node=node,
            transfer_node=ex.first_prefill_node.id if ex.first_prefill_node is not None else None,
        )
        m.observe_hit(node, ex.prompt_tokens, ex.engine_cached_tokens, ex.predicted_tokens)
        self._check_prediction(ex.prompt_node, ex.predicted_tokens, ex.engine_cached_tokens)
        info_fields(
            log,
            "request",
            {
                "request_id": ex.request_id,
                "route": ex.route,
                "prefill_node": ex.prefill_node.id if ex.prefill_node else None,
                "decode_node": ex.decode_node.id,
                "prompt_tokens": ex.prompt_tokens,
                "cached_tokens": ex.engine_cached_tokens,
                "predicted_cached_tokens": ex.predicted_tokens,
                **ex.notes,
                "index_chosen_tokens": ex.index_hits.get(node, 0) * self.settings.block_size,
                "computed_tokens": ex.prompt_tokens - ex.engine_cached_tokens,
                "completion_tokens": ex.completion_tokens,
                "outcome": ex.outcome,
                "attempts": ex.attempts,
                "migrations": ex.migrations,
                "ttft_ms": round(ttft * 1000, 2),
                "queue_ms": round(node_t.queue_s * 1000, 2),
                "prefill_ms": round(node_t.prefill_s * 1000, 2),
                "transfer_ms": round(node_t.transfer_s * 1000, 2),
                "first_token_ms": round(first_token * 1000, 2),
                "total_ms": round((time.perf_counter() - t.start) * 1000, 2),
                "reason": ex.reason,
            },
        )
        if self.on_finished is not None:
            self.on_finished(ex)

    async def close(self) -> None:
        await self.writer.close(timeout=2.0)
