"""Tenants: API keys map to tenants, and one tenant's prompts never hit another's cache."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from tests.faults.cluster import Cluster

MODEL = "prefixgate-sim"
DOC = "Quarterly revenue grew in every region except the north. " * 450


@pytest.fixture(scope="module")
def keyed() -> Iterator[Cluster]:
    c = Cluster.create(
        2,
        2,
        ["--time-scale", "0.05"],
        gateway_args=[
            "--api-key",
            "key-a=tenant-a",
            "--api-key",
            "key-b=tenant-b",
            "--api-key",
            "key-a2=tenant-a",
        ],
    )
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def ask(c: Cluster, key: str, question: str) -> int:
    client = OpenAI(base_url=c.url + "/v1", api_key=key, max_retries=0)
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": question}],
        extra_body={"documents": [{"id": "report", "text": DOC}]},
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def test_tenant_a_document_never_hits_for_tenant_b(keyed: Cluster) -> None:
    assert ask(keyed, "key-a", "first question") == 0
    assert ask(keyed, "key-a", "second question") > 0
    assert ask(keyed, "key-a2", "same tenant, other key") > 0  # tenants, not keys, own the cache
    assert ask(keyed, "key-b", "first question") == 0
    assert ask(keyed, "key-b", "another question") > 0  # B's own cache works


def test_keys_are_required_when_configured(keyed: Cluster) -> None:
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list() and ask(
            keyed, "wrong", "q"
        )
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
