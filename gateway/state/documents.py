"""Registered documents: stored once, referenced by ``document_ids`` in requests.

Each tenant has its own documents and its own quota (count and bytes); the gateway as a whole has
a byte cap. Nothing is evicted to make room: an upload over a quota is refused (and names the
limit), so one tenant's uploads can never push out another tenant's documents, and a document a
client registered stays until it deletes it.

Bytes are what a document really costs in this process, not its UTF-8 length: the ``str`` object
(1, 2 or 4 bytes a character plus its header), its id, the ``Document`` and the dictionary slot,
and each tenant's own tables. ``document_memory.py`` in ``bench/`` compares the count with the
resident memory of a running gateway.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass

from prefixgate.openai.exceptions import NotFound, QuotaExceeded, TooLarge
from prefixgate.openai.normalize import Document

# The Document, the (document, cost) entry and its dictionary slot: 125 to 173 bytes measured
# with tracemalloc on CPython 3.11 depending on where the table is in its growth;
# ``tests/unit/test_documents.py`` checks that the count never falls below the traced memory.
ENTRY_OVERHEAD = 176
TENANT_OVERHEAD = 512  # a tenant's own table and its entries in the store's tables


@dataclass(frozen=True, slots=True)
class DocumentLimits:
    per_tenant_count: int = 1000
    per_tenant_bytes: int = 64 * 1024 * 1024
    total_bytes: int = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    documents: int
    bytes: int


def stored_cost(doc: Document) -> int:
    """The bytes a stored document holds in memory: text, id, objects, dictionary slot.

    A non-ASCII ``str`` gains a cached UTF-8 copy of itself the first time it is serialized
    (returning the document from ``GET /v1/documents/{id}`` does), so that copy is counted from
    the start: the count is an upper bound that does not move while the document is stored.
    """
    text = doc.text
    utf8_copy = 0 if text.isascii() else len(text.encode("utf-8")) + 1
    return sys.getsizeof(text) + utf8_copy + sys.getsizeof(doc.id) + ENTRY_OVERHEAD


def new_document_id() -> str:
    return f"doc-{uuid.uuid4().hex[:16]}"


def not_found(doc_id: str) -> NotFound:
    return NotFound(f"document {doc_id!r} not found", param="document_ids", code="document_not_found")


# The refusals, the same whichever store holds the documents.


def too_large(cost: int, lim: DocumentLimits) -> TooLarge:
    return TooLarge(
        f"the document takes {cost} bytes in the gateway; a tenant's documents may take "
        f"{lim.per_tenant_bytes} (document_quota_bytes)",
        param="text",
        code="document_too_large",
    )


def count_exceeded(held: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"the tenant already has {held} documents, its quota (document_quota_count); delete some first",
        param="id",
        code="document_quota_exceeded",
    )


def bytes_exceeded(tenant_bytes: int, lim: DocumentLimits) -> QuotaExceeded:
    return QuotaExceeded(
        f"the tenant's documents would take {tenant_bytes} bytes; its quota is "
        f"{lim.per_tenant_bytes} (document_quota_bytes); delete some first",
        param="text",
        code="document_quota_exceeded",
    )


def store_full(stored: int, lim: DocumentLimits) -> QuotaExceeded:
    return QuotaExceeded(
        f"the gateway's document store is full ({stored} of {lim.total_bytes} bytes, document_store_bytes)",
        param="text",
        code="document_store_full",
        retry_after=60,
    )


class DocumentStore:
    """Per-tenant documents under per-tenant quotas and one gateway-wide byte cap."""

    def __init__(self, limits: DocumentLimits | None = None) -> None:
        self.limits = limits or DocumentLimits()
        self._docs: dict[str, dict[str, tuple[Document, int]]] = {}  # tenant -> id -> (doc, cost)
        self._tenant_bytes: dict[str, int] = {}
        self._bytes = 0

    def put(self, tenant: str, text: str, doc_id: str | None = None) -> str:
        """Store (or replace) a document; raises QuotaExceeded or TooLarge naming the limit."""
        lim = self.limits
        doc = Document(doc_id or new_document_id(), text)
        cost = stored_cost(doc)
        docs = self._docs.get(tenant, {})
        old = docs.get(doc.id)
        freed = old[1] if old is not None else 0
        if cost > lim.per_tenant_bytes:
            raise too_large(cost, lim)
        count = len(docs) + (old is None)
        if count > lim.per_tenant_count:
            raise count_exceeded(len(docs))
        prior = self._tenant_bytes.get(tenant, 0)
        tenant_bytes = (prior or TENANT_OVERHEAD) - freed + cost
        if tenant_bytes > lim.per_tenant_bytes:
            raise bytes_exceeded(tenant_bytes, lim)
        total = self._bytes - prior + tenant_bytes
        if total > lim.total_bytes:
            raise store_full(self._bytes, lim)
        self._docs.setdefault(tenant, docs)[doc.id] = (doc, cost)
        self._tenant_bytes[tenant] = tenant_bytes
        self._bytes = total
        return doc.id

    def find(self, tenant: str, doc_id: str) -> Document | None:
        entry = self._docs.get(tenant, {}).get(doc_id)
        return entry[0] if entry is not None else None

    def get(self, tenant: str, doc_id: str) -> Document:
        entry = self._docs.get(tenant, {}).get(doc_id)
        if entry is None:
            raise not_found(doc_id)
        return entry[0]

    def delete(self, tenant: str, doc_id: str) -> bool:
        docs = self._docs.get(tenant)
        entry = docs.pop(doc_id, None) if docs is not None else None
        if docs is None or entry is None:
            return False
        cost = entry[1]
        self._bytes -= cost
        self._tenant_bytes[tenant] -= cost
        if not docs:
            self._bytes -= self._tenant_bytes.pop(tenant)
            del self._docs[tenant]
        return True

    def usage(self, tenant: str) -> Usage:
        return Usage(len(self._docs.get(tenant, ())), self._tenant_bytes.get(tenant, 0))

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return sum(len(d) for d in self._docs.values())
