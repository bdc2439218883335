"""The document registry: per-tenant quotas, no cross-tenant eviction, memory counted as held."""

from __future__ import annotations

import gc
import sys
import tracemalloc

import orjson
import pytest

from prefixgate.gateway.state.documents import DocumentLimits, DocumentStore
from prefixgate.openai.exceptions import QuotaExceeded, TooLarge


def test_one_tenant_flooding_the_registry_never_evicts_another_tenants_document() -> None:
    store = DocumentStore(DocumentLimits(per_tenant_count=100, per_tenant_bytes=10**6, total_bytes=10**7))
    store.put("victim", "the victim's contract", "contract")
    stored = 0
    for i in range(10_000):
        try:
            store.put("flooder", "x", f"d{i}")
            stored += 1
        except QuotaExceeded as e:
            assert e.code == "document_quota_exceeded" and "document_quota_count" in e.message
            break
    assert stored == 100
    assert store.get("victim", "contract").text == "the victim's contract"
    assert store.usage("flooder").documents == 100


def test_the_byte_quota_names_its_setting_and_replacing_a_document_reuses_its_bytes() -> None:
    store = DocumentStore(DocumentLimits(per_tenant_count=10, per_tenant_bytes=20_000, total_bytes=10**7))
    store.put("t", "a" * 9_000, "one")
    with pytest.raises(QuotaExceeded) as e:
        store.put("t", "b" * 12_000, "two")
    assert "document_quota_bytes" in e.value.message
    store.put("t", "c" * 12_000, "one")  # a replacement only pays the difference
    assert store.get("t", "one").text.startswith("c") and store.usage("t").documents == 1
    with pytest.raises(TooLarge):
        store.put("t", "d" * 30_000, "big")
    assert store.delete("t", "one") and store.usage("t").bytes == 0 == store.stored_bytes


def test_a_full_store_refuses_instead_of_evicting() -> None:
    store = DocumentStore(DocumentLimits(per_tenant_count=10, per_tenant_bytes=10_000, total_bytes=25_000))
    store.put("a", "a" * 9_000, "a1")
    store.put("b", "b" * 9_000, "b1")
    with pytest.raises(QuotaExceeded) as e:
        store.put("c", "c" * 9_000, "c1")
    assert e.value.code == "document_store_full" and "document_store_bytes" in e.value.message
    assert store.get("a", "a1") and store.get("b", "b1") and len(store) == 2


@pytest.mark.parametrize(
    ("count", "size", "char"), [(10_000, 1, "x"), (2_000, 1_000, "é"), (50, 200_000, "x")]
)
def test_counted_bytes_cover_the_memory_a_document_really_holds(count: int, size: int, char: str) -> None:
    """Tiny documents cost mostly bookkeeping and wide characters cost 2 bytes each: the count
    must never be below what the process really holds, nor far above it."""
    texts = [char * (size - 1) + chr(65 + i % 26) for i in range(count)]  # as a parsed body gives them
    ids = [f"doc-{i:016x}" for i in range(count)]
    store = DocumentStore(DocumentLimits(per_tenant_count=count, per_tenant_bytes=10**10, total_bytes=10**10))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text, doc_id in zip(texts, ids, strict=True):
            store.put("t", text, doc_id)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    sizes = sum(sys.getsizeof(t) + sys.getsizeof(i) for t, i in zip(texts, ids, strict=True))
    held += sizes
    utf8 = sum(len(t.encode()) for t in texts)
    if char.isascii():
        assert held <= store.stored_bytes <= 1.25 * held
    else:  # counted with the UTF-8 copy CPython attaches to a str serialized once
        assert held + utf8 <= store.stored_bytes <= 1.25 * held + utf8
        for doc_id in ids:
            orjson.dumps({"text": store.get("t", doc_id).text})  # what GET /v1/documents/{id} does
        grown = sum(sys.getsizeof(t) + sys.getsizeof(i) for t, i in zip(texts, ids, strict=True))
        assert grown == sizes + utf8 + count  # the copies are really held now, and were counted
    if size == 1:
        assert store.stored_bytes > 100 * utf8  # what the old UTF-8 count missed
