"""prefixgate in front of OpenAI-compatible HTTP workers, through the real ``openai`` client.

Usage and cached tokens are the engines' own; ``include_usage`` is asked of the engine always and
shown to a client only when it asked; several models behind one gateway never mix.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import document
from tests.httpworkers.conftest import NODE_BLOCK, Cluster, Worker

Messages = list[ChatCompletionMessageParam]


def chat(seed: int, tokens: int = 200) -> Messages:
    return [{"role": "user", "content": document(seed, tokens)}]


def engine_prompt_tokens(worker: Worker, messages: Messages) -> int:
    """The worker's own count of a chat's prompt (its template, its tokenizer)."""
    with worker.http() as c:
        return int(c.post("/tokenize", json={"messages": messages}).json()["count"])


def node_prompt_total(worker: Worker) -> int:
    """Prompt tokens the worker has served so far (its own metrics)."""
    with worker.http() as c:
        text = c.get("/metrics").text
    m = re.search(r"^prefixgate_node_prompt_tokens_total (\d+)", text, re.M)
    assert m, text
    return int(m.group(1))


def gateway_prompt_tokens(cluster: Cluster, model: str, messages: Messages) -> int:
    with cluster.admin() as a:
        return int(
            a.post("/admin/cache/lookup", json={"model": model, "messages": messages}).json()["prompt_tokens"]
        )


def wait_indexed(cluster: Cluster, model: str, messages: Messages, timeout: float = 5.0) -> None:
    """Until the gateway's index holds the prompt's blocks (it writes them in the background
    after a request is routed)."""
    deadline = time.monotonic() + timeout
    with cluster.admin() as a:
        while time.monotonic() < deadline:
            look = a.post("/admin/cache/lookup", json={"model": model, "messages": messages}).json()
            if look["decision"]["cached_blocks"] > 0:
                return
            time.sleep(0.05)
    raise TimeoutError("the index never learned the prompt")


def served_prompt_tokens(cluster: Cluster, node_id: str) -> tuple[int, int]:
    """(requests, prompt tokens) the gateway accounted to a node."""
    with cluster.admin() as a:
        rows = {r["id"]: r for r in a.get("/admin/cache").json()["nodes"]}
    row = rows.get(node_id, {})
    return int(row.get("requests", 0)), int(row.get("prompt_tokens", 0))


def served_after(cluster: Cluster, node_id: str, requests: int, timeout: float = 5.0) -> tuple[int, int]:
    """``served_prompt_tokens`` once the node has ``requests`` (a request is accounted when the
    gateway closes it, which may be just after the client read its last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        got = served_prompt_tokens(cluster, node_id)
        if got[0] >= requests or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_the_models_are_the_workers(cluster: Cluster) -> None:
    models = {m.id for m in cluster.client().models.list().data}
    assert models == {w.model for w in cluster.all}
    with cluster.admin() as a:
        nodes = {n["id"]: n for n in a.get("/admin/nodes").json()["data"]}
    for w in cluster.all:
        n = nodes[w.node_id]
        assert n["models"] == [w.model] and n["engine"] == "openai-http"
        assert n["cache"] == "index-only" and n["role"] == "monolithic" and n["routable"]


def test_unknown_model_is_a_404_in_openai_format(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        cluster.client().chat.completions.create(model="no-such-model", messages=chat(1, 8), max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"


def test_non_streamed_usage_and_cached_tokens_are_the_engines(cluster: Cluster) -> None:
    client = cluster.client()
    messages = chat(101)
    engine_count = engine_prompt_tokens(cluster.of("m-a")[0], messages)
    ours = gateway_prompt_tokens(cluster, "m-a", messages)
    assert engine_count != ours  # the gateway's rendering is not the engine's: usage shows which one
    first = client.chat.completions.with_raw_response.create(model="m-a", messages=messages, max_tokens=4)
    wait_indexed(cluster, "m-a", messages)
    second = client.chat.completions.with_raw_response.create(model="m-a", messages=messages, max_tokens=4)
    r1, r2 = first.parse(), second.parse()
    assert r1.choices[0].message.content and r1.choices[0].finish_reason == "length"
    for r in (r1, r2):
        assert r.usage is not None and r.model == "m-a"
        assert r.usage.prompt_tokens == engine_count and r.usage.completion_tokens == 4
    # The same prompt again: the same worker (the index learned it from routing), its cache reused.
    node = first.headers["x-prefixgate-decode-node"]
    assert second.headers["x-prefixgate-decode-node"] == node
    assert node in {w.node_id for w in cluster.of("m-a")}
    details = r2.usage.prompt_tokens_details if r2.usage else None
    cached = details.cached_tokens if details else None
    assert cached is not None and 0 < cached <= engine_count and cached % NODE_BLOCK == 0
    assert second.headers["x-prefixgate-cached-tokens"] == str(cached)


def test_a_stream_without_include_usage_hides_usage_but_the_gateway_learns_it(cluster: Cluster) -> None:
    messages = chat(202)
    worker = cluster.of("m-b")[0]
    engine_count = engine_prompt_tokens(worker, messages)
    assert engine_count != gateway_prompt_tokens(cluster, "m-b", messages)
    before = served_prompt_tokens(cluster, worker.node_id)
    stream = cluster.client().chat.completions.create(
        model="m-b", messages=messages, max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    after = served_after(cluster, worker.node_id, before[0] + 1)
    # The engine's usage reached the gateway (asked for with include_usage): its count, not ours.
    assert after == (before[0] + 1, before[1] + engine_count)


def test_a_stream_with_include_usage_gets_the_engines_usage(cluster: Cluster) -> None:
    messages = chat(303)
    engine_count = engine_prompt_tokens(cluster.of("m-a")[0], messages)
    client = cluster.client()
    for attempt in range(2):
        stream = client.chat.completions.create(
            model="m-a", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        assert last.usage.prompt_tokens == engine_count and last.usage.completion_tokens == 3
        cached = last.usage.prompt_tokens_details.cached_tokens if last.usage.prompt_tokens_details else None
        assert cached == 0 if attempt == 0 else (cached is not None and cached > 0)
        wait_indexed(cluster, "m-a", messages)


def test_text_completions_streamed_and_not(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = document(404, 120)
    whole = client.completions.create(model="m-b", prompt=prompt, max_tokens=4)
    assert whole.choices[0].text and whole.usage is not None and whole.usage.completion_tokens == 4
    with cluster.of("m-b")[0].http() as c:
        engine_count = int(c.post("/tokenize", json={"prompt": prompt}).json()["count"])
    assert whole.usage.prompt_tokens == engine_count
    parts = list(client.completions.create(model="m-b", prompt=prompt, max_tokens=4, stream=True))
    assert "".join(p.choices[0].text for p in parts) and parts[-1].choices[0].finish_reason == "length"


def test_each_request_reaches_only_its_models_workers(cluster: Cluster) -> None:
    client = cluster.client()
    totals = {w.url: node_prompt_total(w) for w in cluster.workers}
    seen: dict[str, set[str]] = {"m-a": set(), "m-b": set()}
    for i in range(6):
        for model in ("m-a", "m-b"):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=chat(500 + i, 80), max_tokens=2
            )
            seen[model].add(raw.headers["x-prefixgate-decode-node"])
    for model, nodes in seen.items():
        assert nodes <= {w.node_id for w in cluster.of(model)}, (model, nodes)
    grown = {w.url: node_prompt_total(w) - totals[w.url] for w in cluster.workers}
    # Six different prompts per model: both m-a workers share them (load), m-b gets its six.
    for w in cluster.workers:
        assert grown[w.url] > 0, (w, grown)
    if cluster.mock is not None:
        with cluster.mock.http() as c:
            posts = [r for r in c.get("/_mock/requests").json() if r["method"] == "POST"]
        assert all(r["model"] == "m-c" for r in posts)


def test_no_cache_hit_crosses_models(cluster: Cluster) -> None:
    client = cluster.client()
    messages = chat(606)
    for _ in range(2):
        a = client.chat.completions.create(model="m-a", messages=messages, max_tokens=2)
        wait_indexed(cluster, "m-a", messages)
    assert a.usage and a.usage.prompt_tokens_details and a.usage.prompt_tokens_details.cached_tokens
    with cluster.admin() as admin:
        look_a = admin.post("/admin/cache/lookup", json={"model": "m-a", "messages": messages}).json()
        look_b = admin.post("/admin/cache/lookup", json={"model": "m-b", "messages": messages}).json()
    assert look_a["decision"]["predicted_cached_tokens"] > 0
    assert look_b["decision"]["predicted_cached_tokens"] == 0
    assert not set(look_a["block_hashes"]) & set(look_b["block_hashes"])
    assert {r["id"] for r in look_b["nodes"]} == {w.node_id for w in cluster.of("m-b")}
    assert all(r["hit_blocks"] == 0 for r in look_b["nodes"])
    b = client.chat.completions.create(model="m-b", messages=messages, max_tokens=2)
    assert b.usage and b.usage.prompt_tokens_details and b.usage.prompt_tokens_details.cached_tokens == 0


def test_the_lookup_states_what_the_hashes_are_computed_on(cluster: Cluster) -> None:
    with cluster.admin() as admin:
        look = admin.post("/admin/cache/lookup", json={"model": "m-a", "messages": chat(707, 20)}).json()
    basis = look["prompt_basis"]
    assert basis["tokenizer"] == "bytes4" and basis["rendering"] == "gateway" and basis["exact"] is False
    assert (
        basis["approximate_for"] == sorted(w.node_id for w in cluster.of("m-a")) and basis["exact_for"] == []
    )
    assert all(r["cache"] == "index-only" for r in look["nodes"])


def test_any_openai_compatible_server_behind_the_gateway(cluster: Cluster) -> None:
    if cluster.mock is None:
        pytest.skip("the mock worker cannot run here (reason printed when the cluster started)")
    mock = cluster.mock
    with mock.http() as c:
        c.post("/_mock/reset")
    client = cluster.client()
    messages: Messages = [
        {"role": "system", "content": "be brief   "},
        {"role": "developer", "content": "no lists"},
        {"role": "user", "content": "hello\r\nthere  "},
    ]
    whole = client.chat.completions.create(model="m-c", messages=messages, max_tokens=4, temperature=0.2)
    assert whole.choices[0].message.content == "tok " * 4
    assert whole.usage is not None and whole.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="m-c", messages=messages, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok " * 3
    assert all(c.usage is None for c in chunks)
    with mock.http() as c:
        posts = [r for r in c.get("/_mock/requests").json() if r["method"] == "POST"]
    # the answer taken whole is asked whole of the engine; the streamed one streamed
    assert [(r["path"], r["model"], r["stream"], r["max_tokens"]) for r in posts] == [
        ("/v1/chat/completions", "m-c", False, 4),
        ("/v1/chat/completions", "m-c", True, 3),
    ]
    # Normalized: system and developer merged into one leading system message, text cleaned.
    assert posts[0]["prompt_head"] == "be brief\n\nno lists\nhello\nthere"
    # The mock's usage counts its prompt characters / 4: the gateway relays the engine's number.
    assert whole.usage.prompt_tokens == max(1, posts[0]["prompt_chars"] // 4)


def test_a_request_the_engine_refuses_is_the_clients_400(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        cluster.client().chat.completions.create(model="m-a", messages=chat(808, 10), max_tokens=8500)
    assert "the model server refused the request" in info.value.message
    assert "8192" in info.value.message  # the engine's own words


def test_the_grpc_front_end_reaches_http_workers_too(cluster: Cluster) -> None:
    prompt = document(909, 60)
    with cluster.of("m-b")[0].http() as c:
        engine_count = int(c.post("/tokenize", json={"prompt": prompt}).json()["count"])
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        done = stub.Complete(
            gateway_pb2.CompletionRequest(model="m-b", prompt=prompt, max_tokens=3), timeout=30
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(gateway_pb2.CompletionRequest(model="m-x", prompt=prompt, max_tokens=3), timeout=30)
    assert done.text and done.finish_reason == "length" and done.route == "monolithic"
    assert done.decode_node == cluster.of("m-b")[0].node_id
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (engine_count, 3)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_concurrent_streams_share_the_models_workers(cluster: Cluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[str, str, int]:
        raw = await client.chat.completions.with_raw_response.create(
            model="m-a",
            messages=chat(1000 + i, 60),
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        return raw.headers["x-prefixgate-decode-node"], text, usage.completion_tokens if usage else 0

    try:
        results = await asyncio.gather(*(one(i) for i in range(24)))
    finally:
        await client.close()
    assert all(text and tokens == 6 for _, text, tokens in results)
    assert {node for node, _, _ in results} == {w.node_id for w in cluster.of("m-a")}
