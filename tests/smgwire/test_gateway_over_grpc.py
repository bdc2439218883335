"""The whole gateway (``prefixgate gateway``, its own process) in front of our nodes over
``grpc://``: a prefill node that cannot hand off is retried around, and a client that goes away
mid-stream gets its request aborted on the node."""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.backends.errors import Unavailable
from prefixgate.backends.smg_service import SglangSchedulerService
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn
from tests.smgwire import doubles
from tests.smgwire.conftest import HF, MODEL, StartNode

PROMPT = (
    "<|im_start|>user\n"
    + "Tell me about prefix caches and KV pages. " * 6
    + "<|im_end|>\n<|im_start|>assistant\n"
)


@asynccontextmanager
async def gateway(*workers: str, env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """The gateway process; waits without blocking the loop our nodes run in."""
    port = free_port()
    proc: Child = spawn(["gateway", "--port", str(port), *workers], env=env)  # the worker flags alone
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.proc.poll() is None:
                try:
                    if (await http.get(f"{base}/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise TimeoutError("\n".join(list(proc.lines)[-30:]))
        yield base
    finally:
        rc = await asyncio.to_thread(proc.stop, timeout=15)
        assert rc == 0, "\n".join(list(proc.lines)[-30:])


def one_token_id(token: str) -> int:
    """The id of a token given by its text."""
    ids = HF.encode(token, add_special_tokens=False).ids
    assert len(ids) == 1, token
    return int(ids[0])


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}


async def test_a_prefill_node_that_cannot_hand_off_is_retried_around(nodes: StartNode) -> None:
    broken = await nodes("prefill", bootstrap_port=None)
    good = await nodes("prefill")
    dec = await nodes("decode")
    flags = ["--prefill", f"grpc://{broken.address}", "1", "--prefill", f"grpc://{good.address}"]
    flags += ["--decode", f"grpc://{dec.address}"]
    async with gateway(*flags) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for _ in range(4):
                r = await http.post("/v1/completions", json=body())
                assert r.status_code == 200, r.text
                assert r.headers["x-prefixgate-route"] == "disaggregated"
                assert r.headers["x-prefixgate-prefill-node"] == f"grpc://{good.address}"
                assert r.json()["choices"][0]["text"]
            rows = {n["address"]: n for n in (await http.get("/admin/nodes")).json()["data"]}
            # eviction on engines that can only flush their whole cache says what it did
            some = (await http.post("/admin/cache/evict", json={"prompt": PROMPT, "model": MODEL})).json()
            assert {n["action"] for n in some["nodes"].values()} == {"index only"}
            every = (await http.post("/admin/cache/evict", json={"all": True})).json()
            assert {n["action"] for n in every["nodes"].values()} == {"whole-node flush"}
            good_node = every["nodes"][f"grpc://{good.address}"]
            assert good_node["error"] is None and good_node["index_removed"] >= 0
            assert good.node.pool.snapshot() == []  # the node's cache really went
    failed = rows[f"grpc://{broken.address}"]
    assert failed["engine"] == "sglang" and "prefill" in (failed["last_error"] or "")  # tried, blamed


async def test_a_decode_failed_after_its_prefill_is_retried_on_the_prefill_node_holding_the_prefix(
    nodes: StartNode,
) -> None:
    """SGLang PD: the retry of a decode that failed once the prefill leg had handed its KV over
    goes back to that prefill node, whose cache now holds the prompt (a hit), with the other
    decode node."""
    pre = [await nodes("prefill") for _ in range(2)]
    dec = [await nodes("decode") for _ in range(2)]
    # The decode node idle ties put first (the gateway names workers by address) loses its engine
    # once handed the pages: its decode fails after the prefill was done.
    bad = min(dec, key=lambda n: f"grpc://{n.address}")
    good = next(n for n in dec if n is not bad)

    async def lost(kv_handle: str, sampling: Any = None, resumed: int = 0) -> AsyncIterator[Any]:
        raise Unavailable("decode engine lost", stage="decode")
        yield

    bad.node.decode = lost  # type: ignore[method-assign]
    flags = [f for p in pre for f in ("--prefill", f"grpc://{p.address}")]
    flags += [f for d in dec for f in ("--decode", f"grpc://{d.address}")]
    retried = 0
    async with gateway(*flags) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for i in range(3):
                retries = await _metric(http, "prefixgate_retries_total")
                prompt = f"<|im_start|>user\n{i}: " + "Tell me about KV pages. " * 30 + "<|im_end|>\n"
                r = await http.post("/v1/completions", json=body(prompt=prompt))
                assert r.status_code == 200, r.text
                if await _metric(http, "prefixgate_retries_total") == retries:
                    continue  # went to the good decode node first
                retried += 1
                usage = r.json()["usage"]
                assert r.headers["x-prefixgate-decode-node"] == f"grpc://{good.address}"
                assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16, usage
    assert retried >= 1


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_a_client_gone_mid_stream_aborts_the_request(
    nodes: StartNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    original = SglangSchedulerService.Abort

    async def recording(self: SglangSchedulerService, request: Any, context: Any) -> Any:
        seen.append(request.request_id)
        return await original(self, request, context)

    monkeypatch.setattr(SglangSchedulerService, "Abort", recording)
    mono = await nodes("monolithic", time_scale=1.0)
    async with gateway("--worker-urls", f"grpc://{mono.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body(max_tokens=500, stream=True)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk, then the client goes
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    assert len(seen) == 1


async def _texts(http: httpx.AsyncClient, **kw: Any) -> list[str]:
    r = await http.post("/v1/completions", json=body(max_tokens=12, **kw))
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


async def test_n_choices_on_vllm_differ_and_a_seed_reproduces_them(nodes: StartNode) -> None:
    ns = await nodes("monolithic")
    servicer = doubles.VllmOverOurNode(ns.address, node=ns.node)
    server, addr = await doubles.serve(doubles.add_vllm(servicer))
    try:
        async with gateway("--worker-urls", f"grpc://{addr}") as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                seeded = await _texts(http, n=3, temperature=1, seed=11)
                assert len(set(seeded)) == 3  # each choice its own seed
                assert await _texts(http, n=3, temperature=1, seed=11) == seeded
                assert await _texts(http, n=3, temperature=1, seed=12) != seeded
                assert len(set(await _texts(http, n=3, temperature=1))) == 3  # the engine's random
    finally:
        await server.stop(0)
    seeds = [r.sampling_params.seed for r in servicer.requests if r.sampling_params.HasField("seed")]
    # the first request's three choices (sent at once: in any order) are its first three calls
    assert len(seeds) == 9 and 11 in seeds[:3] and len(set(seeds[:3])) == 3


async def test_sglang_refuses_a_seed_and_samples_each_choice_at_random(nodes: StartNode) -> None:
    mono = await nodes("monolithic")
    async with gateway("--worker-urls", f"grpc://{mono.address}") as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            r = await http.post("/v1/completions", json=body(temperature=1, seed=1))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "seed" and err["type"] == "invalid_request_error"
            assert "sglang" in err["message"]
            # the sim node says it serves no log probabilities: refused before routing
            r = await http.post("/v1/completions", json=body(logprobs=1))
            assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
            assert len(await _texts(http, temperature=0, seed=1)) == 1  # greedy: any seed is the same
            assert len(set(await _texts(http, n=3, temperature=1))) == 3


async def test_vllm_carries_logprobs_and_logit_bias(nodes: StartNode) -> None:
    """vLLM's ``logprobs`` is the alternatives wanted, at least 1 (chat ``logprobs`` without
    ``top_logprobs`` still asks for one, and shows none); ``logit_bias`` goes as int32 ids."""
    ns = await nodes("monolithic", engine="tiny:preset=small")
    servicer = doubles.VllmOverOurNode(ns.address, node=ns.node)
    server, addr = await doubles.serve(doubles.add_vllm(servicer))
    chat = {"model": "prefixgate-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat["temperature"] = 0
    try:
        async with gateway("--worker-urls", f"grpc://{addr}") as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                r = await http.post("/v1/chat/completions", json={**chat, "logprobs": True})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                entries = choice["logprobs"]["content"]
                assert (
                    len(entries) == 4 and "".join(e["token"] for e in entries) == choice["message"]["content"]
                )
                assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
                r = await http.post(
                    "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3}
                )
                assert [len(e["top_logprobs"]) for e in r.json()["choices"][0]["logprobs"]["content"]] == [
                    3
                ] * 4
                first = one_token_id(entries[0]["token"])
                r = await http.post("/v1/chat/completions", json={**chat, "logit_bias": {str(first): -100}})
                assert r.status_code == 200, r.text
                assert not r.json()["choices"][0]["message"]["content"].startswith(entries[0]["token"])
    finally:
        await server.stop(0)
    asked = [r.sampling_params for r in servicer.requests]
    assert [p.logprobs if p.HasField("logprobs") else None for p in asked] == [1, 3, None]
    assert dict(asked[2].logit_bias) == {first: -100.0}


async def test_a_workers_tokenizer_from_its_bundle_serves_requests(nodes: StartNode, tmp_path: Path) -> None:
    """A worker on another host: its ``tokenizer_path`` means nothing here, so the gateway takes
    the ``GetTokenizer`` bundle, and detokenizes the worker's ids with it too."""
    node = await nodes("monolithic")
    address = f"grpc://{node.address}"
    # as if the worker's tokenizer_path were on another host; the bundle lands in a scratch dir
    env = {"PREFIXGATE_TOKENIZER_WORKER_PATHS": "false", "PREFIXGATE_TOKENIZER_CACHE_DIR": str(tmp_path)}
    texts = []
    for extra in (env, None):
        async with (
            gateway("--worker-urls", address, env=extra) as base,
            httpx.AsyncClient(timeout=30) as http,
        ):
            r = await http.post(f"{base}/v1/completions", json=body())
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]
    bundled = await asyncio.to_thread(lambda: [p.name for p in tmp_path.rglob("tokenizer.json")])
    assert bundled == ["tokenizer.json"]  # it came as a bundle


async def test_a_grpc_worker_is_drained_and_removed_by_its_id(nodes: StartNode) -> None:
    """A grpc:// worker's id is its address, slashes and all: the admin paths take it as sent and
    percent-encoded."""
    first, second = await nodes("monolithic"), await nodes("monolithic")
    ids = [f"grpc://{first.address}", f"grpc://{second.address}"]
    async with gateway("--worker-urls", *ids) as base, httpx.AsyncClient(base_url=base, timeout=10) as http:
        r = await http.post(f"/admin/nodes/{ids[0]}/drain")
        assert r.status_code == 200, r.text
        encoded = urllib.parse.quote(ids[1], safe="")
        assert (await http.post(f"/admin/nodes/{encoded}/drain", json={"drain": False})).status_code == 200
        rows = {n["id"]: n for n in (await http.get("/admin/nodes")).json()["data"]}
        assert rows[ids[0]]["draining"] is True and rows[ids[1]]["draining"] is False
        assert (await http.delete(f"/admin/nodes/{encoded}")).status_code == 200
        left = {n["id"] for n in (await http.get("/admin/nodes")).json()["data"]}
        assert left == {ids[0]}
        assert (await http.delete(f"/admin/nodes/{encoded}")).status_code == 404
