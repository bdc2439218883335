"""Structured output end to end: the real gateway (its own process) in front of tiny-engine nodes
(real logits, constrained by the node's grammar library) over ``grpc://`` (monolithic and split)
and over HTTP (the node's OpenAI-compatible endpoint as an ``http://`` worker), the ``openai``
client, streamed and not. Every answer to a ``response_format`` JSON schema parses and validates
against it (hypothesis over schema shapes); ``tool_choice`` ``required`` or a named function
always gives parsed ``tool_calls``; a schema that does not compile is the client's 422; a pool
whose engine cannot constrain (the simulated one) gives the 400 naming the field.

The tiny model is untrained: left to itself it writes a string or a number for ever. The schemas
here bound every value (``maxLength``, ``maximum``, ``maxItems``, no extra properties) so that a
constrained answer ends within ``max_tokens``, which is what is checked: the answer ended
("stop"), and it is valid.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]  # (installed with check-jsonschema; no stubs)
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.ops.processes import Child
from tests.helpers import free_port, spawn, wait_answered

MODEL = "prefixgate-tiny"
TINY = "tiny:preset=small"
BS = 16
MAX_TOKENS = 600  # far above what a bounded schema's answer takes (~150 tokens at most)
TEMPLATE = Path(__file__).resolve().parents[1] / "toolcalls" / "qwen25_template.jinja"


@dataclass
class Stack:
    grpc: str  # gateway --worker-urls grpc://<tiny node>
    split: str  # gateway --prefill grpc://P BOOT --decode grpc://D
    http: str  # gateway --worker-urls http://<the tiny node's HTTP endpoint>
    sim: str  # gateway --worker-urls grpc://<simulated node>


def _node(*args: str) -> tuple[Child, dict[str, Any]]:
    p = spawn(
        ["node", "--port", "0", "--block-size", str(BS), "--ready-line", "--log-level", "warning", *args]
    )
    m = p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=60)
    return p, json.loads(m.group(1))


def _gateway(*args: str) -> tuple[Child, str]:
    port = free_port()
    p = spawn(["gateway", "--port", str(port), *args])
    return p, f"http://127.0.0.1:{port}"


def _ready(base: str, proc: Child, timeout: float = 60.0) -> None:
    """Until a plain request is answered: the gateway is up and has read its node's status
    (the features a node serves come with it)."""
    wait_answered(base, proc, MODEL, timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The shipped tokenizer with a chat template that renders tools (Qwen2.5's), so the gateway
    # renders and parses tool calls itself (hermes format) for the grpc:// pool.
    tok = tmp_path_factory.mktemp("tools-tokenizer")
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tok / "tokenizer.json")
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    procs: list[Child] = []
    try:
        with ThreadPoolExecutor(4) as pool:
            mono_f = pool.submit(
                _node, "--engine", TINY, "--role", "monolithic", "--http-port", "0", "--http-model", MODEL
            )
            pre_f = pool.submit(_node, "--engine", TINY, "--role", "prefill", "--bootstrap-port", "0")
            dec_f = pool.submit(_node, "--engine", TINY, "--role", "decode")
            sim_f = pool.submit(_node, "--engine", "sim", "--role", "monolithic", "--time-scale", "0")
            (mono_p, mono), (pre_p, pre), (dec_p, dec), (sim_p, sim) = (
                f.result() for f in (mono_f, pre_f, dec_f, sim_f)
            )
        procs += [mono_p, pre_p, dec_p, sim_p]
        gateways = [
            # the tools template above instead of the node's own (the tokenizer the worker gives)
            _gateway("--tokenizer-path", str(tok), "--worker-urls", f"grpc://{mono['address']}"),
            _gateway(
                "--prefill",
                f"grpc://{pre['address']}",
                str(pre["bootstrap_port"]),
                "--decode",
                f"grpc://{dec['address']}",
            ),
            _gateway("--worker-urls", f"http://{mono['http_address']}"),
            # the sim node names its model prefixgate-sim: the alias lets the same requests ask it
            _gateway("--model", MODEL, "--worker-urls", f"grpc://{sim['address']}"),
        ]
        procs += [p for p, _ in gateways]
        for p, base in gateways:
            _ready(base, p)
        yield Stack(*(base for _, base in gateways))
    finally:
        with ThreadPoolExecutor(len(procs) or 1) as pool:  # each stop waits for its process
            for rc in pool.map(lambda p: p.stop(timeout=15), procs):
                assert rc == 0


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def answer(base: str, stream: bool, max_tokens: int = MAX_TOKENS, **kw: Any) -> tuple[str, str, Any]:
    """(content, finish_reason, message or the streamed tool calls) of one chat."""
    c = client(base)
    messages: Any = [{"role": "user", "content": "Describe a small thing as JSON."}]
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **kw)
        ch = r.choices[0]
        return ch.message.content or "", str(ch.finish_reason), ch.message.tool_calls
    parts: list[str] = []
    finish = ""
    calls: dict[int, dict[str, str]] = {}
    for chunk in c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, **kw
    ):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(parts), finish, [calls[i] for i in sorted(calls)] or None


# -- response_format -----------------------------------------------------------------------

LEAVES = st.sampled_from(
    [
        {"type": "string", "maxLength": 8},
        {"type": "integer", "minimum": -50, "maximum": 500},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
    ]
)


def objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    props = st.dictionaries(
        st.sampled_from(["name", "size", "ok", "tags", "inner"]), children, min_size=1, max_size=3
    )
    return props.map(
        lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
    )


def arrays(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return children.map(lambda c: {"type": "array", "items": c, "maxItems": 2})


SCHEMAS = objects(st.recursive(LEAVES, lambda c: st.one_of(objects(c), arrays(c)), max_leaves=4))


# no shrinking: each example is a few hundred generated tokens on three paths
@settings(
    max_examples=8,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=SCHEMAS, stream=st.booleans())
def test_every_answer_validates_against_the_schema(
    stack: Stack, schema: dict[str, Any], stream: bool
) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    for base in (stack.grpc, stack.split, stack.http):
        text, finish, _ = answer(base, stream, response_format=rf)
        assert finish == "stop", (base, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object_schema(stack: Stack) -> None:
    """``json_object`` is the schema ``{"type": "object"}``: free keys and values, so the untrained
    model may not finish one; what it writes is always the start of an object."""
    text, finish, _ = answer(stack.grpc, False, response_format={"type": "json_object"}, max_tokens=40)
    assert text.startswith("{") and finish in ("stop", "length"), text
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_schema_that_does_not_compile_is_a_422(stack: Stack) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}
    for stream in (False, True):
        r = httpx.post(
            f"{stack.grpc}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": rf}
            | {"stream": stream},
            timeout=30,
        )
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
        assert "objekt" in error["message"]


def test_a_pool_that_cannot_constrain_refuses_naming_the_field(stack: Stack) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = httpx.post(
        f"{stack.sim}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": rf},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
    assert r.json()["error"]["code"] == "unsupported_parameter"


# -- tool_choice -----------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _checked(calls: Any, names: set[str]) -> int:
    assert calls, "no tool call"
    for call in calls:
        if not isinstance(call, dict):
            call = {"name": call.function.name, "arguments": call.function.arguments}
        name, args = call["name"], call["arguments"]
        assert name in names
        jsonschema.validate(json.loads(args), PARAMS[name])
    return len(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_always_calls_a_tool(stack: Stack, stream: bool) -> None:
    for _ in range(3):
        _, finish, calls = answer(stack.grpc, stream, tools=TOOLS, tool_choice="required")
        assert finish == "tool_calls"
        _checked(calls, set(PARAMS))


def test_a_named_tool_choice_calls_that_tool_once(stack: Stack) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        _, finish, calls = answer(stack.grpc, stream, tools=TOOLS, tool_choice=choice)
        assert finish == "tool_calls"
        assert _checked(calls, {"get_time"}) == 1
