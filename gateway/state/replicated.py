"""Documents and tenants' pins as every replica sees them: policy over a ``StateStore``.

``open_state`` picks the store: Redis (single or Cluster) when the gateway has ``--redis``, so
every replica pointed at the same Redis shares them; the embedded store otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prefixgate.gateway.config import Settings
from prefixgate.gateway.state.documents import DocumentLimits, new_document_id, not_found, stored_cost
from prefixgate.gateway.state.memory import MemoryState
from prefixgate.gateway.state.quotas import PinLimits
from prefixgate.gateway.state.store import DocumentUsage, PinHold, PinRow, StateStore
from prefixgate.openai.normalize import Document
from prefixgate.openai.schema import ParsedRequest


def open_state(settings: Settings) -> StateStore:
    if not settings.redis:
        return MemoryState()
    from prefixgate.gateway.state.redis_store import RedisState

    return RedisState(
        settings.redis,
        prefix=settings.redis_prefix,
        document_ttl_s=settings.document_ttl_s,
        membership_ttl_s=settings.membership_ttl_s,
        usage_ttl_s=settings.usage_ttl_s,
    )


class DocumentRegistry:
    """``/v1/documents`` and ``document_ids``: each tenant sees only its own documents."""

    def __init__(self, state: StateStore, limits: DocumentLimits) -> None:
        self.state = state
        self.limits = limits

    async def put(self, tenant: str, text: str, doc_id: str | None = None) -> str:
        doc = Document(doc_id or new_document_id(), text)
        await self.state.doc_put(tenant, doc.id, text, stored_cost(doc), self.limits)
        return doc.id

    async def get_many(self, tenant: str, doc_ids: Sequence[str]) -> list[Document]:
        """The documents in order; NotFound names the first that is missing."""
        ids = list(dict.fromkeys(doc_ids))
        texts = dict(zip(ids, await self.state.doc_get(tenant, ids), strict=True))
        out = []
        for doc_id in doc_ids:
            text = texts[doc_id]
            if text is None:
                raise not_found(doc_id)
            out.append(Document(doc_id, text))
        return out

    async def get(self, tenant: str, doc_id: str) -> Document:
        return (await self.get_many(tenant, [doc_id]))[0]

    async def delete(self, tenant: str, doc_id: str) -> bool:
        return await self.state.doc_delete(tenant, doc_id)

    async def usage(self, tenant: str) -> DocumentUsage:
        return await self.state.doc_usage(tenant)

    async def resolve(self, tenant: str, req: ParsedRequest) -> None:
        """Fetch the request's registered documents (one round trip) into ``req.documents``, after
        its inline ones, as the pipeline would have placed them; nothing is left to look up."""
        if req.document_ids:
            req.documents = [*req.documents, *await self.get_many(tenant, req.document_ids)]
            req.document_ids = []


class PinRegistry:
    """Tenants' pins under their quotas (``gateway.state.quotas``), with their expiry, for every replica."""

    def __init__(self, state: StateStore, limits: PinLimits) -> None:
        self.state = state
        self.limits = limits

    async def reserve(
        self, tenant: str, capacities: Mapping[str, int], hashes: Sequence[int], seconds: float
    ) -> PinHold:
        return await self.state.pin_reserve(tenant, capacities, hashes, seconds, time.time(), self.limits)

    async def cancel(self, hold: PinHold, node_id: str) -> None:
        await self.state.pin_cancel(hold, node_id)

    async def cancel_all(self, hold: PinHold) -> None:
        for node_id in list(hold.before):
            await self.state.pin_cancel(hold, node_id)

    async def rows(self, tenant: str | None = None) -> list[PinRow]:
        return await self.state.pins(tenant, time.time())
