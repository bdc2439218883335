"""The OpenAI request surface through ``prefixgate up``, driven by the real ``openai`` client.

Tiny engine (a real model): ``n``, ``seed``, ``stop``, ``logit_bias``, ``logprobs``/``top_logprobs``
and ``max_completion_tokens``, each streamed and not. What the engine cannot serve (constrained
JSON, tool calls, images) gets a 400 naming the field. The simulated engine (no model) refuses
logprobs and logit_bias the same way and serves ``n``/``seed``/``stop``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.backends.tiny.vocab import OUTPUT_IDS, token_text
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn
from tests.tiny.support import BS, SMALL

MODEL = "prefixgate-sim"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a tiny transformer computed in numpy."},
    {"role": "user", "content": "Tell me about prefix caches and KV pages."},
]


def _stack(engine: str) -> Iterator[OpenAI]:
    port = free_port()
    args = ["up", "--port", str(port), "--prefill", "1", "--decode", "1", "--block-size", str(BS)]
    proc: Child = spawn([*args, "--engine", engine])
    try:
        m = proc.wait_for(r"prefixgate ready in [0-9.]+s: (http://\S+/v1)", timeout=60)
        yield OpenAI(base_url=m.group(1), api_key="unused", max_retries=0, timeout=60)
    finally:
        rc = proc.stop()
        assert rc == 0, f"prefixgate up exited with {rc}:\n" + "\n".join(list(proc.lines)[-30:])


@pytest.fixture(scope="module")
def tiny() -> Iterator[OpenAI]:
    yield from _stack(SMALL)


@pytest.fixture(scope="module")
def sim() -> Iterator[OpenAI]:
    yield from _stack("sim")


def chat(client: OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", MESSAGES)
    return client.chat.completions.create(model=MODEL, **kw)


def streamed(client: OpenAI, **kw: Any) -> tuple[dict[int, str], dict[int, str], dict[int, list[Any]]]:
    """Texts, finish reasons and logprob entries per choice index of a streamed chat."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    lps: dict[int, list[Any]] = {}
    for c in chat(client, stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
            if ch.logprobs is not None and ch.logprobs.content:
                lps.setdefault(ch.index, []).extend(ch.logprobs.content)
    return texts, finish, lps


def refused(client: OpenAI, param: str, kind: str = "chat", **kw: Any) -> str:
    """The 400 of a request the gateway must refuse, checked to name ``param``."""
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            chat(client, **kw)
        else:
            client.completions.create(model=MODEL, **kw)
    assert e.value.status_code == 400
    assert e.value.param == param, e.value.body
    return str(e.value.message)


# -- tiny engine: served ---------------------------------------------------------------------


def test_n_choices(tiny: OpenAI) -> None:
    r = chat(tiny, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content or "" for c in r.choices]
    assert all(texts) and len(set(texts)) > 1  # choices are sampled independently
    assert r.usage is not None
    if all(c.finish_reason == "length" for c in r.choices):
        assert r.usage.completion_tokens == 24  # every choice counted
    else:
        assert 3 <= r.usage.completion_tokens < 24
    one = chat(tiny, max_tokens=8, temperature=1.0, seed=7)
    assert one.choices[0].message.content == texts[0]  # choice 0 is the n=1 answer
    s_texts, s_finish, _ = streamed(tiny, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [s_texts[i] for i in range(3)] == texts  # same seed, same choices, streamed
    assert set(s_finish) == {0, 1, 2}
    comp = tiny.completions.create(model=MODEL, prompt="tiny " * 30, n=2, max_tokens=5, seed=3)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text != comp.choices[1].text


def test_seed(tiny: OpenAI) -> None:
    def text(seed: int, stream: bool) -> str:
        if stream:
            return streamed(tiny, max_tokens=10, temperature=1.0, seed=seed)[0][0]
        return chat(tiny, max_tokens=10, temperature=1.0, seed=seed).choices[0].message.content or ""

    a = text(11, False)
    assert a and text(11, True) == a and text(11, False) == a and text(12, False) != a


def test_stop(tiny: OpenAI) -> None:
    full = chat(tiny, max_tokens=16, temperature=0).choices[0].message.content or ""
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    r = chat(tiny, max_tokens=16, temperature=0, stop=stop)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    texts, finish, _ = streamed(tiny, max_tokens=16, temperature=0, stop=["never-generated", stop])
    assert texts[0] == cut and finish[0] == "stop"


def test_logit_bias(tiny: OpenAI) -> None:
    forced = int(OUTPUT_IDS[5])  # an id the model can output, pushed to the top
    want = token_text(forced) * 6
    r = chat(tiny, max_tokens=6, temperature=0, logit_bias={str(forced): 100})
    assert r.choices[0].message.content == want
    assert streamed(tiny, max_tokens=6, temperature=0, logit_bias={str(forced): 100})[0][0] == want
    plain = chat(tiny, max_tokens=6, temperature=0).choices[0].message.content
    assert plain != want


def test_chat_logprobs(tiny: OpenAI) -> None:
    r = chat(tiny, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    entries = c.logprobs.content
    assert r.usage is not None and len(entries) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == c.message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the most likely
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.bytes == list(e.token.encode())
    _, _, lps = streamed(tiny, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    assert [(e.token, round(e.logprob, 4)) for e in lps[0]] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]
    plain = chat(tiny, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(tiny: OpenAI) -> None:
    r = tiny.completions.create(model=MODEL, prompt="tiny " * 30, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    tokens: list[str] = []
    for chunk in tiny.completions.create(
        model=MODEL, prompt="tiny " * 30, max_tokens=6, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
    assert tokens == lp.tokens


def test_max_completion_tokens(tiny: OpenAI) -> None:
    r = chat(tiny, max_completion_tokens=5, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    both = chat(tiny, max_completion_tokens=3, max_tokens=9, temperature=0)  # max_completion_tokens wins
    assert both.usage is not None and both.usage.completion_tokens == 3
    chunks = list(
        chat(
            tiny, max_completion_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 4


def test_tool_choice_none_is_served(tiny: OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = chat(tiny, max_tokens=3, tools=tools, tool_choice="none")
    assert r.choices[0].message.content


# -- tiny engine: refused, naming the field ----------------------------------------------------


def test_tiny_refuses_what_it_cannot_constrain(tiny: OpenAI) -> None:
    """Over the native protocol (whose sampling carries no constraint) the tiny engine does not
    advertise constrained decoding; its SMG and HTTP faces do (tests/structured)."""
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    for stream in (False, True):
        msg = refused(
            tiny, "response_format", max_tokens=3, response_format={"type": "json_object"}, stream=stream
        )
        assert "tiny" in msg
        schema: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        refused(tiny, "response_format", max_tokens=3, response_format=schema, stream=stream)
        refused(tiny, "tools", max_tokens=3, tools=tools, stream=stream)
        refused(tiny, "tools", max_tokens=3, tools=tools, tool_choice="required", stream=stream)


def test_tiny_refuses_images(tiny: OpenAI) -> None:
    image: Any = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    messages: Any = [MESSAGES[0], {"role": "user", "content": image}]
    for stream in (False, True):
        refused(tiny, "messages[1].content[1]", messages=messages, max_tokens=3, stream=stream)


def test_malformed_surface_fields(tiny: OpenAI) -> None:
    refused(tiny, "top_logprobs", max_tokens=3, top_logprobs=2)
    refused(tiny, "top_logprobs", max_tokens=3, logprobs=True, top_logprobs=21)
    refused(tiny, "n", max_tokens=3, n=17)
    refused(tiny, "logit_bias", max_tokens=3, logit_bias={"5": 101})
    refused(tiny, "logit_bias", max_tokens=3, logit_bias={"x": 1})
    refused(tiny, "response_format.type", max_tokens=3, response_format={"type": "yaml"})
    refused(tiny, "tool_choice", max_tokens=3, tool_choice="auto")
    refused(tiny, "logprobs", "completion", prompt="x", max_tokens=3, logprobs=6)


# -- simulated engine: honest about having no model ------------------------------------------


def test_sim_refuses_logprobs_and_logit_bias(sim: OpenAI) -> None:
    for stream in (False, True):
        msg = refused(sim, "logprobs", max_tokens=3, logprobs=True, stream=stream)
        assert "sim" in msg
        refused(sim, "logit_bias", max_tokens=3, logit_bias={"5": 10}, stream=stream)
    refused(sim, "logprobs", "completion", prompt="x " * 20, max_tokens=3, logprobs=1)


def test_sim_serves_n_seed_stop(sim: OpenAI) -> None:
    r = chat(sim, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    again = chat(sim, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    texts, finish, _ = streamed(sim, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices] and set(finish) == {0, 1}
    full = r.choices[0].message.content or ""
    stop = full[2:5]
    cut = chat(sim, max_tokens=8, temperature=1.0, seed=5, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
