"""Pins over the SMG engine protocol (``grpc://``), which has no pin: keep-warm re-prefill.

The same pressure as ``test_pin_pressure`` on our own protocol, with the gateway talking to our
nodes as SGLang workers (``prefixgate up --protocol smg``; 1 prefill + 1 decode node of 256 KV
blocks): the pin answers ``"action": "keep-warm"`` and the pinned document is still cached after
traffic several times the pool's size went through the node; an unpinned one of the same size
is not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixgate.gateway.core.keepwarm import MAX_PINS
from tests.admin.conftest import MODEL, start_stack, stop_stack
from tests.helpers import document

CAPACITY = 256
BLOCK = 64


@pytest.fixture(scope="module")
def smg_small() -> Iterator[httpx.Client]:
    url, proc = start_stack(
        "--protocol", "smg", "--prefill", "1", "--decode", "1", "--capacity-blocks", str(CAPACITY)
    )
    try:
        with httpx.Client(base_url=url.removesuffix("/v1"), timeout=60) as client:
            yield client
    finally:
        stop_stack(proc)


def _body(doc_id: str, seed: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Cite the document."}, {"role": "user", "content": "Go."}],
        "documents": [{"id": doc_id, "text": document(seed, 1200)}],  # ~44 blocks of the shipped tokenizer
        "max_tokens": 2,
    }


def test_pin_on_a_flush_only_engine_is_kept_warm_under_lru_pressure(smg_small: httpx.Client) -> None:
    client = smg_small
    pinned, unpinned = _body("pinned", 200), _body("unpinned", 201)
    r = client.post("/admin/cache/pin", json={**pinned, "pin_seconds": 120})
    assert r.status_code == 200, r.text
    node = r.json()["nodes"][0]
    blocks = r.json()["blocks"]
    assert node["action"] == "keep-warm" and node["error"] is None, node
    assert node["pinned_blocks"] == blocks > 20 and node["pinned_until"] > time.time() + 100
    warm = client.post("/v1/prefill", json=unpinned)  # same size, not pinned: the control
    assert warm.status_code == 200, warm.text
    assert warm.json()["nodes"][0]["action"] == "re-prefill"

    filled = 0
    for i in range(6):  # together several times the 256-block pool
        prompt = document(300 + i, 3000)  # ~110 blocks
        fill = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert fill.status_code == 200, fill.text
        filled += fill.json()["usage"]["prompt_tokens"] // BLOCK
        time.sleep(0.5)  # the gateway re-prefills the pin once the node's traffic calls for it
    assert filled > 2 * CAPACITY

    kept = client.post("/v1/chat/completions", json=pinned).json()["usage"]
    assert kept["prompt_tokens_details"]["cached_tokens"] >= blocks * BLOCK - BLOCK, kept
    lost = client.post("/v1/chat/completions", json=unpinned).json()["usage"]
    assert lost["prompt_tokens_details"]["cached_tokens"] == 0, lost


def test_evict_on_a_flush_only_engine_says_what_it_did(smg_small: httpx.Client) -> None:
    one = smg_small.post("/admin/cache/evict", json={"block_hashes": ["00000000000000ff"]})
    assert one.status_code == 200, one.text
    assert {n["action"] for n in one.json()["nodes"].values()} == {"index only"}, one.json()


def test_keep_warm_pins_are_bounded(smg_small: httpx.Client) -> None:
    """At most ``MAX_PINS`` prefixes kept warm per gateway: the next pin is refused with 429."""
    refused = None
    for i in range(MAX_PINS + 1):  # the module's other pins count too
        body = {"model": MODEL, "prompt": f"keep {i} " + document(900 + i, 80), "max_tokens": 1}
        r = smg_small.post("/admin/cache/pin", json={**body, "pin_seconds": 60})
        if r.status_code != 200:
            refused = r
            break
        assert r.json()["nodes"][0]["action"] == "keep-warm", r.json()
    assert refused is not None and refused.status_code == 429, refused and refused.text
    assert f"keeps {MAX_PINS} prefixes warm" in refused.json()["error"]["message"]
    assert refused.headers.get("retry-after")
    # a whole-node flush on purpose ends the keep-warm pins of the flushed nodes: room again
    flushed = smg_small.post("/admin/cache/evict", json={"all": True})
    assert {n["action"] for n in flushed.json()["nodes"].values()} == {"whole-node flush"}, flushed.text
    again = smg_small.post("/admin/cache/pin", json={**body, "pin_seconds": 60})
    assert again.status_code == 200 and again.json()["nodes"][0]["action"] == "keep-warm", again.text
