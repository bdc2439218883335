"""A pinned document stays cached while other traffic fills the node past its capacity.

A dedicated small stack (1 prefill + 1 decode node of 256 KV blocks each) so that a handful
of requests is enough to overflow the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.admin.conftest import MODEL, start_stack, stop_stack
from tests.helpers import document

CAPACITY = 256


@pytest.fixture(scope="module")
def small() -> Iterator[httpx.Client]:
    url, proc = start_stack("--prefill", "1", "--decode", "1", "--capacity-blocks", str(CAPACITY))
    try:
        with httpx.Client(base_url=url.removesuffix("/v1"), timeout=60) as client:
            yield client
    finally:
        stop_stack(proc)


def _body(doc_id: str, seed: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Cite the document."}, {"role": "user", "content": "Go."}],
        "documents": [{"id": doc_id, "text": document(seed, 2500)}],
        "max_tokens": 2,
    }


def test_pinned_document_survives_lru_pressure(small: httpx.Client) -> None:
    pinned, unpinned = _body("pinned", 200), _body("unpinned", 201)
    r = small.post("/admin/cache/pin", json={**pinned, "pin_seconds": 120})
    assert r.status_code == 200, r.text
    blocks = r.json()["blocks"]
    assert r.json()["nodes"][0]["pinned_blocks"] == blocks > 30
    warm = small.post("/v1/prefill", json=unpinned)  # same size, not pinned: the control
    assert warm.status_code == 200, warm.text
    view = {n["id"]: n for n in small.get("/admin/cache").json()["nodes"]}
    assert view["prefill-1"]["pinned_blocks"] >= blocks
    assert view["prefill-1"]["used_blocks"] >= 2 * blocks

    filled = 0
    for i in range(6):  # each about 109 blocks: well past the 256-block pool
        prompt = document(300 + i, 7000)
        fill = small.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert fill.status_code == 200, fill.text
        filled += fill.json()["usage"]["prompt_tokens"] // 64
    assert filled > 2 * CAPACITY

    kept = small.post("/v1/chat/completions", json=pinned).json()["usage"]
    assert kept["prompt_tokens_details"]["cached_tokens"] == blocks * 64
    lost = small.post("/v1/chat/completions", json=unpinned).json()["usage"]
    assert lost["prompt_tokens_details"]["cached_tokens"] == 0
