"""Token parity with ``smg``: the gateway with the engine tokenizer and ``smg`` 1.13.0 in front of
the same tiny-engine node give the same prompt token counts and the same greedy text for canonical
chats, so both sent the node the same ids.

``smg`` is found or installed as ``tests/interop`` does; the test skips, saying why, without it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.gateway.ops.processes import Child
from tests.interop.test_smg_interop import BS, MODEL, _node, _smg, _smg_executable

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What does a prefix cache keep, and for how long?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a page size."},
        {"role": "assistant", "content": "Sixteen tokens."},
        {"role": "user", "content": "And why that one?\nGive one reason: 日本, café, 🙂."},
    ],
]


@pytest.fixture(scope="module")
def node_and_smg() -> Iterator[tuple[str, str]]:
    exe = _smg_executable()
    procs: list[Child] = []
    try:
        node_p, node = _node("--role", "monolithic")
        procs.append(node_p)
        address = str(node["address"])
        smg_p, base = _smg(exe, "--worker-urls", f"grpc://{address}", "--policy", "round_robin")
        procs.append(smg_p)
        yield address, base
    finally:
        for p in procs:
            p.stop(timeout=15)


@pytest.fixture
async def gateway(node_and_smg: tuple[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    address, _ = node_and_smg
    settings = Settings(
        model=MODEL, monolithic=[f"grpc://{address}"], block_size=BS, tokenizer_path=str(TOKENIZER_DIR)
    )
    svc = GatewayService(settings)
    await svc.start()
    try:
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
            yield client
    finally:
        await svc.stop()


@pytest.mark.parametrize("chat", range(len(CHATS)))
async def test_the_same_chat_gives_smg_and_the_gateway_the_same_tokens(
    node_and_smg: tuple[str, str], gateway: httpx.AsyncClient, chat: int
) -> None:
    _, smg_base = node_and_smg
    body = {"model": MODEL, "messages": CHATS[chat], "max_tokens": 16, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        theirs = (await http.post(f"{smg_base}/v1/chat/completions", json=body)).json()
    ours_r = await gateway.post("/v1/chat/completions", json=body)
    assert ours_r.status_code == 200, ours_r.text
    ours = ours_r.json()
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"] == 16


async def test_a_chat_that_is_not_canonical_is_normalized_first(
    node_and_smg: tuple[str, str], gateway: httpx.AsyncClient
) -> None:
    _, smg_base = node_and_smg
    messages = [{"role": "user", "content": "Hello there   \r\n"}]  # trailing whitespace, CRLF
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        theirs = (await http.post(f"{smg_base}/v1/chat/completions", json=body)).json()
        canonical = {**body, "messages": [{"role": "user", "content": "Hello there"}]}
        theirs_canonical = (await http.post(f"{smg_base}/v1/chat/completions", json=canonical)).json()
    ours = (await gateway.post("/v1/chat/completions", json=body)).json()
    assert ours["usage"]["prompt_tokens"] == theirs_canonical["usage"]["prompt_tokens"]
    assert ours["usage"]["prompt_tokens"] != theirs["usage"]["prompt_tokens"]
