"""The node HTTP endpoint's PD legs, both engines' ways, driven by plain HTTP as the routers do:
SGLang's (same body with a bootstrap room to both nodes at once) and vLLM's (prefill with
``do_remote_decode``, decode with the ``kv_transfer_params`` the prefill answered)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from prefixgate.backends.http_api import HTTPOptions, NodeHTTP, PDLink
from prefixgate.backends.server import NodeServer
from tests.backends.conftest import StartNode

pytestmark = pytest.mark.timeout(60)

BODY: dict[str, Any] = {
    "model": "prefixgate-sim",
    "messages": [{"role": "user", "content": "Where are the pages kept? " * 20}],
    "max_tokens": 8,
    "temperature": 0,
}
VLLM_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Trio:
    mono: NodeServer
    prefill: NodeServer
    decode: NodeServer

    def url(self, ns: NodeServer) -> str:
        assert ns.http is not None
        return ns.http.url + "/v1/chat/completions"


async def _http(ns: NodeServer) -> NodeServer:
    ns.http = NodeHTTP(ns.node, "127.0.0.1", 0, HTTPOptions(), PDLink(lambda: ns.address, ns.bootstrap))
    await ns.http.start()
    return ns


@pytest.fixture
async def trio(nodes: StartNode) -> AsyncIterator[Trio]:
    yield Trio(
        await _http(await nodes("monolithic")),
        await _http(await nodes("prefill", bootstrap_port=0, bootstrap_timeout_s=2.0)),
        await _http(await nodes("decode", bootstrap_timeout_s=2.0)),
    )


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_sglang_legs_at_once_give_the_monolithic_text(trio: Trio) -> None:
    async with httpx.AsyncClient(timeout=20) as c:
        direct = _text(await c.post(trio.url(trio.mono), json=BODY))
        assert trio.prefill.bootstrap is not None
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": trio.prefill.bootstrap.port}
        body = {**BODY, **room, "bootstrap_room": random.randrange(2**63)}
        pre, dec = await asyncio.gather(
            c.post(trio.url(trio.prefill), json=body), c.post(trio.url(trio.decode), json=body)
        )
        assert _text(dec) == direct and pre.status_code == 200
        assert dec.json()["usage"]["completion_tokens"] == 8
        assert trio.decode.node.snapshot().prompt_tokens == 0  # the pages came from the prefill node
        # A decode leg whose prefill leg never comes: an error in OpenAI's format, not a hang.
        alone = await c.post(trio.url(trio.decode), json={**body, "bootstrap_room": 7})
        assert alone.status_code == 504 and alone.json()["error"]["message"]


async def test_vllm_params_relayed_from_prefill_to_decode_give_the_monolithic_text(trio: Trio) -> None:
    async with httpx.AsyncClient(timeout=20) as c:
        direct = _text(await c.post(trio.url(trio.mono), json=BODY))
        pre = await c.post(
            trio.url(trio.prefill), json={**BODY, "max_tokens": 1, "kv_transfer_params": VLLM_PREFILL}
        )
        assert pre.status_code == 200, pre.text
        params = pre.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_port"] == trio.prefill.bootstrap.port  # type: ignore[union-attr]
        first_cached = pre.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        dec = await c.post(trio.url(trio.decode), json={**BODY, "kv_transfer_params": params})
        assert _text(dec) == direct
        # The decode leg reports what the first prefill reused, not the cached second pass.
        assert dec.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == first_cached == 0
        assert trio.decode.node.snapshot().prompt_tokens == 0


async def test_bad_pd_fields_are_openai_4xx(trio: Trio) -> None:
    async with httpx.AsyncClient(timeout=20) as c:
        for extra in (
            {"bootstrap_room": 1},  # no host
            {"bootstrap_room": "x", "bootstrap_host": "127.0.0.1"},
            {"kv_transfer_params": [1]},
            {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"}},  # no port
        ):
            r = await c.post(trio.url(trio.decode), json={**BODY, **extra})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", extra
        # A node without a bootstrap listener cannot be a vLLM prefill leg.
        r = await c.post(trio.url(trio.decode), json={**BODY, "kv_transfer_params": VLLM_PREFILL})
        assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]


async def test_sglang_generate_legs_at_once_give_the_monolithic_text(trio: Trio) -> None:
    body: dict[str, Any] = {
        "text": "Where are the pages kept? " * 20,
        "sampling_params": {"max_new_tokens": 6},
    }
    assert trio.prefill.bootstrap is not None and trio.mono.http is not None
    async with httpx.AsyncClient(timeout=20) as c:
        direct = await c.post(trio.mono.http.url + "/generate", json=body)
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": trio.prefill.bootstrap.port}
        legs = {**body, **room, "bootstrap_room": random.randrange(2**63)}
        urls = [ns.http.url + "/generate" for ns in (trio.prefill, trio.decode) if ns.http is not None]
        pre, dec = await asyncio.gather(*(c.post(u, json=legs) for u in urls))
    assert pre.status_code == dec.status_code == direct.status_code == 200
    assert dec.json()["text"] == direct.json()["text"] and dec.json()["meta_info"]["completion_tokens"] == 6
