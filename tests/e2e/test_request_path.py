"""The whole request path with the official OpenAI client against ``prefixgate up``."""

from __future__ import annotations

import concurrent.futures as cf
import math

import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import MODEL, Stack
from tests.faults.cluster import Cluster
from tests.helpers import document


def test_streamed_and_plain_chat_completions(stack: Stack) -> None:
    client = stack.client()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    assert 0 < plain.usage.completion_tokens <= 12
    assert plain.usage.prompt_tokens_details is not None

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish = None
    usage = None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == plain.choices[0].message.content  # same prompt, same output
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_endpoint(stack: Stack) -> None:
    client = stack.client()
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens <= 5
    chunks = list(
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_shared_document_goes_to_the_same_prefill_node_and_hits(stack: Stack) -> None:
    client = stack.client()
    doc = document(1, 8000)
    doc_tokens = len(doc.encode()) // 4
    results = []
    for q in ("What is the first word?", "How many times does echo appear?"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": q},
            ],
            extra_body={"documents": [{"id": "manual", "text": doc}]},
        )
        results.append((raw.headers, raw.parse()))
    (h1, _r1), (h2, r2) = results
    assert h1["x-prefixgate-route"] == "disaggregated"
    assert h1["x-prefixgate-prefill-node"] == h2["x-prefixgate-prefill-node"]
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    cached = r2.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 0.9 * doc_tokens, (cached, doc_tokens)
    assert int(h2["x-prefixgate-cached-tokens"]) == cached


def test_common_system_prompt_spreads_over_both_prefill_nodes() -> None:
    """Ten concurrent requests sharing only a system prompt. On a real-time cluster (prefills
    of ~45 ms overlap, as in production) the bound keeps either node at most ceil(1.25 * 10 / 2)."""
    cluster = Cluster.create(2, 2, ["--time-scale", "1.0"])
    cluster.start()
    try:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        system = "You are a support assistant for ACME. " * 20

        def one(i: int) -> str:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                max_tokens=2,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"ticket {i}: " + document(100 + i, 6000)},
                ],
            )
            return raw.headers["x-prefixgate-prefill-node"]

        client.chat.completions.create(  # warm: the system prompt is now cached on one node
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        )
        with cf.ThreadPoolExecutor(max_workers=10) as ex:
            nodes = list(ex.map(one, range(10)))
    finally:
        assert cluster.stop() == 0
    counts = {n: nodes.count(n) for n in set(nodes)}
    assert len(counts) == 2, counts
    assert max(counts.values()) <= math.ceil(1.25 * 10 / 2), counts


def test_disaggregated_and_monolithic_paths_answer_identically(stack: Stack) -> None:
    client = stack.client()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about " + document(7, 1500)}
    ]
    with stack.admin() as admin:
        split = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            seed=5,
        )
        r = admin.put("/admin/switches", json={"disaggregation": False})
        assert r.status_code == 200 and r.json()["disaggregation"] is False
        try:
            mono = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                max_tokens=24,
                seed=5,
            )
        finally:
            admin.put("/admin/switches", json={"disaggregation": True})
    assert split.headers["x-prefixgate-route"] == "disaggregated"
    assert mono.headers["x-prefixgate-route"] == "monolithic"
    assert split.parse().choices[0].message.content == mono.parse().choices[0].message.content


def test_document_order_does_not_matter(stack: Stack) -> None:
    client = stack.client()
    docs = [{"id": f"kb-{i}", "text": document(200 + i, 700)} for i in range(6)]
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Summarize."}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=msgs,
        max_tokens=2,
        extra_body={"documents": docs},
    )
    second = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=msgs,
        max_tokens=2,
        extra_body={"documents": docs[::-1]},
    )
    r2 = second.parse()
    assert first.headers["x-prefixgate-prefill-node"] == second.headers["x-prefixgate-prefill-node"]
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert (r2.usage.prompt_tokens_details.cached_tokens or 0) >= 0.9 * r2.usage.prompt_tokens - 64


def test_errors_are_openai_shaped(stack: Stack) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        r = http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.post(
            "/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post(
            "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.get("/nothing-here")
        assert r.status_code == 404 and "error" in r.json()
    assert stack.ready_s < 30


def test_bad_input_gets_clear_4xx(stack: Stack) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        hdr = {"content-type": "application/json"}
        r = http.post("/chat/completions", content=b'{"model": "\xff"}', headers=hdr)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"
        r = http.post("/chat/completions", json={"model": MODEL, "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = http.post(
            "/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": ""}]}
        )
        assert r.status_code == 200  # an empty user turn still renders a prompt (the template)
        r = http.post("/chat/completions", content=b"x" * (9 * 1024 * 1024), headers=hdr)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        huge = "word " * 140_000  # ~175K tokens > the 131,072-token limit
        r = http.post(
            "/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": huge}]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/completions", json={"model": MODEL, "prompt": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post(
            "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
