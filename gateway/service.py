"""The gateway as one object: settings, nodes, index, pipeline, metrics. Front ends share it."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from cachetier.index import BlockIndex
from cachetier.memory import MemoryIndex
from cachetier.tokenizer import load_tokenizer
from gateway.config import Settings
from gateway.documents import DocumentStore
from gateway.events import EventSync
from gateway.metrics import Metrics
from gateway.nodes import NodePool
from gateway.pipeline import Pipeline

log = structlog.get_logger("prefixgate.gateway")


def open_index(settings: Settings) -> BlockIndex:
    if not settings.redis:
        return MemoryIndex()
    try:
        from cachetier import open_index as _open  # type: ignore[attr-defined]
    except ImportError as e:  # pragma: no cover - until the Redis index lands
        raise RuntimeError("the Redis index is not available in this build") from e
    index: BlockIndex = _open(settings.redis, prefix=settings.redis_prefix)
    return index


class GatewayService:
    def __init__(self, settings: Settings, index: BlockIndex | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.index = index if index is not None else open_index(settings)
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.pool = NodePool(settings.stats_interval_s)
        self.documents = DocumentStore()
        self.pipeline = Pipeline(
            settings, self.pool, self.index, self.tokenizer, self.metrics, self.documents
        )
        self.events = EventSync(self.pool, self.index, self.metrics)
        self.draining = False
        self._started = False

    @property
    def models(self) -> set[str]:
        return {self.settings.model}

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        s = self.settings
        self.pool.extend("prefill", s.prefill)
        self.pool.extend("decode", s.decode)
        self.pool.extend("monolithic", s.monolithic)
        for node in self.pool.nodes.values():
            self.events.watch(node)
        await self.pool.wait_ready(timeout=5.0)
        log.info(
            "gateway_started",
            prefill=len(s.prefill),
            decode=len(s.decode),
            monolithic=len(s.monolithic),
            index=self.index.backend,
        )

    async def stop(self) -> None:
        await self.pipeline.close()
        await self.events.close()
        await self.pool.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.index.close(), 2.0)
