"""Registered documents: stored once, referenced by ``document_ids`` in requests."""

from __future__ import annotations

import uuid
from collections import OrderedDict

from gateway.exceptions import NotFound, TooLarge
from gateway.normalize import Document


class DocumentStore:
    """Per-tenant documents, bounded in count and bytes (oldest dropped first)."""

    def __init__(self, max_documents: int = 10_000, max_bytes: int = 512 * 1024 * 1024) -> None:
        self._docs: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._bytes = 0
        self.max_documents = max_documents
        self.max_bytes = max_bytes

    def put(self, tenant: str, text: str, doc_id: str | None = None) -> str:
        doc_id = doc_id or f"doc-{uuid.uuid4().hex[:16]}"
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            raise TooLarge(f"document is {size} bytes; the limit is {self.max_bytes}", param="text")
        key = (tenant, doc_id)
        old = self._docs.pop(key, None)
        if old is not None:
            self._bytes -= len(old.encode("utf-8"))
        self._docs[key] = text
        self._bytes += size
        while len(self._docs) > self.max_documents or self._bytes > self.max_bytes:
            _, dropped = self._docs.popitem(last=False)
            self._bytes -= len(dropped.encode("utf-8"))
        return doc_id

    def get(self, tenant: str, doc_id: str) -> Document:
        text = self._docs.get((tenant, doc_id))
        if text is None:
            raise NotFound(f"document {doc_id!r} not found", param="document_ids", code="document_not_found")
        return Document(doc_id, text)

    def delete(self, tenant: str, doc_id: str) -> bool:
        text = self._docs.pop((tenant, doc_id), None)
        if text is None:
            return False
        self._bytes -= len(text.encode("utf-8"))
        return True

    def __len__(self) -> int:
        return len(self._docs)
