"""The node HTTP endpoint's PD legs, both engines' ways, driven by plain HTTP as the routers do:
SGLang's (same body with a bootstrap room to both nodes at once) and vLLM's (prefill with
``do_remote_decode``, decode with the ``kv_transfer_params`` the prefill answered)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from prefixgate.backends.http_api import HTTPOptions, NodeHTTP, PDLink
from prefixgate.backends.server import NodeServer
from prefixgate.openai.schema import MAX_N, MAX_SEED, choice_seed
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


# -- n choices --------------------------------------------------------------------------------------

TINY = "tiny:preset=small"  # an engine with log probabilities (the simulated one has none)
N_BODY: dict[str, Any] = {
    "model": "prefixgate-sim",
    "messages": [{"role": "user", "content": "Which pages does each choice share? " * 6}],
    "max_tokens": 5,
    "temperature": 1.0,
    "seed": 7,
    "n": 3,
    "logprobs": True,
    "top_logprobs": 2,
}


@pytest.fixture
async def tiny(nodes: StartNode) -> Trio:
    # 16-token blocks: the prompt spans several full blocks and a partial one
    return Trio(
        # prefills at once: the choices after the first must still wait to reuse its blocks
        await _http(await nodes("monolithic", engine=TINY, block_size=16, max_concurrency=4)),
        await _http(await nodes("prefill", engine=TINY, block_size=16, bootstrap_port=0, max_concurrency=4)),
        await _http(await nodes("decode", engine=TINY, block_size=16)),
    )


Answer = tuple[int, str, list[tuple[str, float, list[float]]]]


def _answers(obj: dict[str, Any]) -> list[Answer]:
    out = []
    for c in obj["choices"]:
        lps = [
            (e["token"], e["logprob"], [t["logprob"] for t in e["top_logprobs"]])
            for e in c["logprobs"]["content"]
        ]
        out.append((c["index"], c["message"]["content"], lps))
    return out


async def _events(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _streamed(events: list[dict[str, Any]]) -> list[Answer]:
    """The chat answers a stream of chunks adds up to, by choice index."""
    texts: dict[int, str] = {}
    lps: dict[int, list[tuple[str, float, list[float]]]] = {}
    for e in events:
        for ch in e["choices"]:
            i = ch["index"]
            texts[i] = texts.get(i, "") + (ch["delta"].get("content") or "")
            for lp in (ch["logprobs"] or {}).get("content") or []:
                lps.setdefault(i, []).append(
                    (lp["token"], lp["logprob"], [t["logprob"] for t in lp["top_logprobs"]])
                )
    return [(i, texts[i], lps.get(i, [])) for i in sorted(texts)]


async def test_n_choices_whole_and_over_sglang_pd(tiny: Trio) -> None:
    """``n`` sampled choices with a seed: each its own (choice i is the request with the seed the
    gateway gives choice i), the same on one node and over SGLang's PD, streamed or not, one
    room for all (``room + i``) or one per choice; the prompt counted once, computed once."""
    assert tiny.prefill.bootstrap is not None
    async with httpx.AsyncClient(timeout=20) as c:
        whole = (await c.post(tiny.url(tiny.mono), json=N_BODY)).json()
        hits_after_whole = tiny.mono.node.snapshot().prefix_hit_tokens
        want = _answers(whole)
        assert [i for i, _, _ in want] == [0, 1, 2]
        assert len({text for _, text, _ in want}) > 1  # sampled: the choices differ
        assert all(len(lps) == 5 and all(len(top) == 2 for _, _, top in lps) for _, _, lps in want)
        for i in range(3):  # choice i is reproducible alone, with its seed
            seed = choice_seed(7, i) & MAX_SEED
            alone = (await c.post(tiny.url(tiny.mono), json={**N_BODY, "n": 1, "seed": seed})).json()
            assert _answers(alone) == [(0, *want[i][1:])]
        prompt = alone["usage"]["prompt_tokens"]
        assert whole["usage"]["prompt_tokens"] == prompt
        assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # choice 0's: a miss
        assert hits_after_whole == 2 * (prompt // 16) * 16  # choices 1 and 2 reused choice 0's blocks
        assert whole["usage"]["completion_tokens"] == 15 == whole["usage"]["total_tokens"] - prompt

        streamed = await _events(c, tiny.url(tiny.mono), {**N_BODY, "stream": True})
        assert _streamed(streamed) == want

        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": tiny.prefill.bootstrap.port}
        hits = tiny.prefill.node.snapshot().prefix_hit_tokens
        one = {**N_BODY, **room, "bootstrap_room": random.randrange(2**62)}
        pre, dec = await asyncio.gather(
            c.post(tiny.url(tiny.prefill), json=one), c.post(tiny.url(tiny.decode), json=one)
        )
        assert pre.status_code == 200 and _answers(dec.json()) == want
        assert (
            dec.json()["usage"]["completion_tokens"] == 15 and dec.json()["usage"]["prompt_tokens"] == prompt
        )
        # choice 0's prefill computed the prompt (its full blocks), the other two reused them
        assert tiny.prefill.node.snapshot().prefix_hit_tokens - hits == 2 * (prompt // 16) * 16

        each = {**N_BODY, **room, "stream": True, "stream_options": {"include_usage": True}}
        each["bootstrap_room"] = [random.randrange(2**62) for _ in range(3)]  # sglang-router's lists
        each["bootstrap_host"], each["bootstrap_port"] = (
            [room["bootstrap_host"]] * 3,
            [room["bootstrap_port"]] * 3,
        )
        legs = await asyncio.gather(
            _events(c, tiny.url(tiny.prefill), each), _events(c, tiny.url(tiny.decode), each)
        )
        assert _streamed(legs[1]) == want
        assert legs[1][-1]["usage"]["completion_tokens"] == 15
    assert tiny.decode.node.snapshot().prompt_tokens == 0  # the decode node only decoded


async def test_n_text_completions_offsets_per_choice(tiny: Trio) -> None:
    assert tiny.mono.http is not None
    body = {
        "model": "prefixgate-sim",
        "prompt": "Pages and blocks, " * 4,
        "max_tokens": 4,
        "n": 2,
        "seed": 3,
        "logprobs": 1,
    }
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(tiny.mono.http.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1]
    for ch in choices:  # each choice's offsets run through its own text
        lp = ch["logprobs"]
        assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == ch["text"]


async def test_n_out_of_bounds_and_n_with_vllm_params_are_400(tiny: Trio) -> None:
    assert tiny.prefill.bootstrap is not None
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": tiny.prefill.bootstrap.port}
    async with httpx.AsyncClient(timeout=20) as c:
        for body, param in (
            ({**N_BODY, "n": MAX_N + 1}, "n"),
            ({**N_BODY, "n": 0}, "n"),
            ({**N_BODY, "n": 2, "kv_transfer_params": VLLM_PREFILL}, "n"),
            ({**N_BODY, **room, "bootstrap_room": [1, 2]}, "bootstrap_room"),  # 2 rooms for 3 choices
            ({**N_BODY, **room, "bootstrap_room": [1, 2, 3], "bootstrap_port": [1, 2]}, "bootstrap_port"),
        ):
            r = await c.post(tiny.url(tiny.prefill), json=body)
            err = r.json()["error"]
            assert (
                r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param
            ), r.text
