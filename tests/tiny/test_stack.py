"""``prefixgate up --engine tiny``: the unchanged gateway in front of tiny-engine node processes,
driven by the OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.backends.hftok import load
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn
from tests.tiny.support import BS, SMALL

TOKEN_TEXTS = {t for t in load().texts if t}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    args = ["up", "--port", str(port), "--prefill", "1", "--decode", "2", "--block-size", str(BS)]
    proc: Child = spawn([*args, "--engine", SMALL])
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
        yield m.group(1)
    finally:
        rc = proc.stop()
        assert rc == 0, f"prefixgate up exited with {rc}:\n" + "\n".join(list(proc.lines)[-30:])


def words(text: str) -> list[str]:
    """The output split into the shipped tokenizer's token texts (greedily, longest first)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        k = next(k for k in range(min(len(text) - i, 32), 0, -1) if text[i : i + k] in TOKEN_TEXTS)
        out.append(text[i : i + k])
        i += k
    return out


def test_openai_client_through_the_gateway(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a tiny transformer computed in numpy."},
        {"role": "user", "content": "Say something about prefix caches and KV pages, please."},
    ]
    first = client.chat.completions.with_raw_response.create(
        model="prefixgate-sim", messages=messages, max_tokens=12, temperature=0
    )
    again = client.chat.completions.with_raw_response.create(
        model="prefixgate-sim", messages=messages, max_tokens=12, temperature=0
    )
    a, b = first.parse(), again.parse()
    text = a.choices[0].message.content or ""
    assert words(text) and a.choices[0].finish_reason == "length"
    assert a.usage is not None and a.usage.completion_tokens == 12
    assert b.choices[0].message.content == text  # the same answer from the prefix cache
    assert first.headers["x-prefixgate-route"] == again.headers["x-prefixgate-route"] == "disaggregated"
    assert a.usage is not None and b.usage is not None and b.usage.prompt_tokens_details is not None
    assert b.usage.prompt_tokens_details.cached_tokens == (a.usage.prompt_tokens // BS) * BS > 0

    # Split across two node processes, or whole on one decode node: the same tokens.
    root = base_url.removesuffix("/v1")
    assert httpx.put(f"{root}/admin/switches", json={"disaggregation": False}, timeout=10).status_code == 200
    try:
        mono = client.chat.completions.with_raw_response.create(
            model="prefixgate-sim", messages=messages, max_tokens=12, temperature=0
        )
    finally:
        httpx.put(f"{root}/admin/switches", json={"disaggregation": True}, timeout=10)
    assert mono.headers["x-prefixgate-route"] == "monolithic"
    assert mono.parse().choices[0].message.content == text

    # Seeded sampling, streamed: the same seed gives the same text, another seed another text.
    def sampled(seed: int) -> str:
        stream = client.chat.completions.create(
            model="prefixgate-sim",
            messages=messages,
            max_tokens=10,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    s1 = sampled(1)
    assert words(s1) and sampled(1) == s1 and sampled(2) != s1
    comp = client.completions.create(model="prefixgate-sim", prompt="tiny " * 40, max_tokens=5, temperature=0)
    assert words(comp.choices[0].text) and comp.usage is not None and comp.usage.completion_tokens == 5
