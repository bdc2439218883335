"""The node's OpenAI-compatible HTTP endpoint, driven by the OpenAI client and plain HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.backends.http_api import HTTPOptions, NodeHTTP, shipped_tokenizer
from prefixgate.backends.server import NodeServer, start_node
from prefixgate.cachetier.hashing import Namespace, block_hashes

MODEL = "prefixgate-sim"
SYSTEM = "You answer from the manual. " * 40  # ~1,100 bytes: several 64-token blocks


@pytest.fixture(scope="module")
async def node() -> AsyncIterator[tuple[NodeServer, NodeHTTP]]:
    ns = await start_node("monolithic", "127.0.0.1", 0, time_scale=0.0)
    http = NodeHTTP(ns.node, "127.0.0.1", 0, HTTPOptions())
    await http.start()
    ns.http = http
    try:
        yield ns, http
    finally:
        await ns.stop(grace=0.2)


def client(http: NodeHTTP) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_chat_non_stream_and_stream_with_cached_tokens(node: tuple[NodeServer, NodeHTTP]) -> None:
    _, http = node
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How do I reset it?"},
    ]
    async with client(http) as c:
        first = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        assert first.choices[0].message.content
        assert first.choices[0].finish_reason in ("length", "stop")
        assert first.usage is not None and first.usage.prompt_tokens > 64
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0

        stream = await c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
    assert text
    assert usage is not None and usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    # the whole prompt's full blocks were reused
    assert cached == usage.prompt_tokens // 64 * 64 > 0


async def test_completions_and_block_hashes_in_the_gateway_namespace(
    node: tuple[NodeServer, NodeHTTP],
) -> None:
    ns, http = node
    prompt = "The device resets after ten seconds. " * 30
    async with client(http) as c:
        r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert r.choices[0].text
    tok = shipped_tokenizer()
    tokens = tok.encode(prompt)
    hashes = block_hashes(tokens, 64, Namespace(MODEL, "", 64, tok.name).root())
    # a gateway with the node's tokenizer (tokenizer = "engine") would name these blocks
    assert hashes and ns.node.pool.leading(hashes) == len(hashes)


async def test_router_probes(node: tuple[NodeServer, NodeHTTP]) -> None:
    _, http = node
    async with httpx.AsyncClient(base_url=http.url, timeout=10) as h:
        assert (await h.get("/health")).status_code == 200
        assert (await h.get("/health_generate")).status_code == 200
        assert (await h.get("/v1/models")).json()["data"][0]["id"] == MODEL
        info = (await h.get("/server_info")).json()
        assert "model_path" not in info and "tokenizer_path" not in info
        assert "tokenizer_path" not in (await h.get("/get_model_info")).json()
        assert (await h.get("/get_load")).json()[0]["dp_rank"] == 0

        messages = [{"role": "user", "content": "hello there"}]
        rendered = (
            await h.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
        ).json()
        tok = shipped_tokenizer()
        expected = tok.encode_ids(tok.apply_chat_template(messages))  # the shipped chat template
        assert rendered["token_ids"] == expected
        comp = (await h.post("/v1/completions/render", json={"model": MODEL, "prompt": "abcdabcd"})).json()
        assert comp[0]["token_ids"] == tok.encode_ids("abcdabcd")
        count = (await h.post("/tokenize", json={"prompt": "abcdabcd"})).json()
        assert count["count"] == len(tok.encode_ids("abcdabcd")) > 0

        gen = (
            await h.post("/generate", json={"text": "abcd" * 40, "sampling_params": {"max_new_tokens": 3}})
        ).json()
        assert gen["meta_info"]["completion_tokens"] == 3 and gen["text"]

        bad = await h.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        sse = await h.post(
            "/v1/completions", json={"model": MODEL, "prompt": "abcd" * 20, "max_tokens": 2, "stream": True}
        )
        assert sse.status_code == 200 and sse.text.rstrip().endswith("data: [DONE]")
