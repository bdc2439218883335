"""Tool calling end to end: the real gateway (its own process) with the engine tokenizer and a
Qwen2.5-style chat template that renders tools, in front of a recording ``SglangScheduler`` on
loopback gRPC that answers scripted token ids (the tokenizer's ids of a Hermes-format answer) and
records the ids it was sent; the real ``openai`` client, streamed and not, and a second turn with
the tool's result. The tiny engine cannot honestly decide to call a tool, so the answer is
scripted; everything between the client and the engine is the real path."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.ops.processes import Child
from prefixgate.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers import free_port, spawn
from tests.smgwire.doubles import ScriptedSglang, add_sglang, serve

MODEL = "qwen-tools"
HERE = Path(__file__).resolve().parent
TOOLS: list[dict[str, Any]] = [
    {
        "function": {
            "description": "The weather now in a city.",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"], "type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
        "type": "function",
    }
]  # keys in sorted order: the gateway's canonical form, so transformers renders the same bytes
ANSWER = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>"
)
FOLLOW_UP = "It is 18 C and sunny in Paris."


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped tokenizer with a chat template that renders tools (Qwen2.5's)."""
    d = tmp_path_factory.mktemp("qwen-tools-tokenizer")
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = (HERE / "qwen25_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


class RecordingSglang(ScriptedSglang):
    """Answers each Generate with the next scripted text's ids, a few at a time (so markers
    arrive in pieces), and records the input ids."""

    def __init__(self, tokenizer_dir: Path, eos: tuple[int, ...] = ()) -> None:
        super().__init__(None)
        self.hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.eos = eos  # reported by GetModelInfo and ending every answer
        self.answers: list[str] = []
        self.inputs: list[list[int]] = []
        self.streamed: list[bool] = []
        self.constraints: list[str] = []  # the constraint oneof each request set ("" none)

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return spb.GetModelInfoResponse(model_path="double", eos_token_ids=list(self.eos))

    async def Abort(self, request: Any, context: Any) -> Any:
        return spb.AbortResponse(success=True)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        ids = list(request.tokenized.input_ids)
        self.inputs.append(ids)
        self.streamed.append(request.stream)
        self.constraints.append(request.sampling_params.WhichOneof("constraint") or "")
        out = list(self.hf.encode(self.answers.pop(0), add_special_tokens=False)) + list(self.eos[:1])
        rid = request.request_id
        if request.stream:
            for k in range(0, len(out), 2):
                yield spb.GenerateResponse(
                    request_id=rid,
                    chunk=spb.GenerateStreamChunk(
                        token_ids=out[k : k + 2],
                        prompt_tokens=len(ids),
                        completion_tokens=min(k + 2, len(out)),
                    ),
                )
        done = spb.GenerateComplete(
            output_ids=out[-2:] if request.stream else out,
            finish_reason="stop",
            prompt_tokens=len(ids),
            completion_tokens=len(out),
        )
        yield spb.GenerateResponse(request_id=rid, complete=done)


@asynccontextmanager
async def gateway(tokenizer_dir: Path, worker: str, *extra: str) -> AsyncIterator[str]:
    port = free_port()
    argv = ["gateway", "--port", str(port), "--model", MODEL, "--block-size", "16"]
    argv += ["--tokenizer-path", str(tokenizer_dir), "--worker-urls", worker, *extra]
    proc: Child = spawn(argv)
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


@pytest.fixture
async def engine(template_dir: Path) -> AsyncIterator[tuple[RecordingSglang, str]]:
    double = RecordingSglang(template_dir)
    server, address = await serve(add_sglang(double))
    try:
        yield double, f"grpc://{address}"
    finally:
        await server.stop(0.2)


async def create(client: openai.AsyncOpenAI, **kw: Any) -> Any:
    """``chat.completions.create`` with plain dicts (the client's typed params are not needed)."""
    return await client.chat.completions.create(**kw)


def param_of(e: openai.APIStatusError) -> Any:
    body: Any = e.body  # the error object of the OpenAI error body
    return body["param"] if isinstance(body, dict) else None


def expected_ids(hf: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    ids = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def collect(choices: list[Any]) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """Content, tool calls (assembled as a client does), finish reason and the deltas of one
    choice's streamed chunk choices."""
    content, finish = "", None
    calls: list[dict[str, Any]] = []
    deltas: list[Any] = []
    for ch in choices:
        d = ch.delta
        deltas.append(d)
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, calls, finish, deltas


async def test_tool_calls_whole_streamed_and_a_second_turn(
    template_dir: Path, engine: tuple[RecordingSglang, str]
) -> None:
    double, worker = engine
    user = {"role": "user", "content": "What is the weather in Paris?"}
    async with gateway(template_dir, worker) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        double.answers = [ANSWER, ANSWER, FOLLOW_UP]

        r = await create(client, model=MODEL, messages=[user], tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
        assert calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
        # the engine was sent the model's own template with the tools in it
        assert double.inputs[0] == expected_ids(double.hf, [user], TOOLS)
        assert '"name": "get_weather"' in double.hf.decode(double.inputs[0])

        stream = await create(client, model=MODEL, messages=[user], tools=TOOLS, stream=True)
        content, streamed, finish, deltas = collect([ch async for c in stream for ch in c.choices])
        assert double.streamed[1] and double.inputs[1] == double.inputs[0]
        assert content == "Let me check." and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            ("get_weather", {"city": "Paris", "unit": "c"})
        ]
        assert all("<" not in (d.content or "") for d in deltas)  # no half of a marker leaked
        firsts = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
        assert len(firsts) == 1 and firsts[0].function.arguments == ""  # name first, then arguments
        pieces = [
            d.tool_calls[0].function.arguments for d in deltas if d.tool_calls and not d.tool_calls[0].id
        ]
        assert len(pieces) > 3  # the arguments stream as the engine's tokens come

        # the second turn: the assistant's call and the tool's result, rendered by the template
        assistant = choice.message.model_dump(exclude_none=True)
        tool_msg = {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}
        r2 = await create(
            client,
            model=MODEL,
            messages=[user, assistant, tool_msg],
            tools=TOOLS,
        )
        assert r2.choices[0].message.content == FOLLOW_UP and r2.choices[0].finish_reason == "stop"
        assert not r2.choices[0].message.tool_calls
        as_template = {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "function": {"arguments": {"city": "Paris", "unit": "c"}, "name": "get_weather"},
                    "id": calls[0].id,
                    "type": "function",
                }
            ],
        }
        assert double.inputs[2] == expected_ids(double.hf, [user, as_template, tool_msg], TOOLS)
        assert "<tool_response>\n18 C, sunny\n</tool_response>" in double.hf.decode(double.inputs[2])

        # tool_choice "none": the template renders no tools, and nothing is parsed
        double.answers = [ANSWER]
        r3 = await create(client, model=MODEL, messages=[user], tools=TOOLS, tool_choice="none")
        assert r3.choices[0].message.content == ANSWER and r3.choices[0].finish_reason == "stop"
        assert double.inputs[3] == expected_ids(double.hf, [user], None)

        # malformed tool parts and what these engines cannot keep: 400s naming the field
        bad: list[tuple[dict[str, Any], str]] = [
            ({"messages": [user, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
            (
                {"messages": [user, {**assistant, "tool_calls": [{"id": "c", "type": "function"}]}]},
                "messages[1].tool_calls[0].function",
            ),
            (
                {
                    "messages": [
                        user,
                        {
                            "role": "assistant",
                            "tool_calls": [
                                {
                                    "id": "c",
                                    "type": "function",
                                    "function": {"name": "f", "arguments": "{oops"},
                                }
                            ],
                        },
                    ]
                },
                "messages[1].tool_calls[0].function.arguments",
            ),
            ({"messages": [user], "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ]
        for extra, param in bad:
            kw: dict[str, Any] = {"model": MODEL, "tools": TOOLS, **extra}
            with pytest.raises(openai.BadRequestError) as e:
                await create(client, **kw)
            assert param_of(e.value) == param
        assert len(double.inputs) == 4  # none of them reached the engine

        # tool_choice "required": the engine (an SGLang, which constrains) is asked for the calls
        double.answers = [ANSWER.removeprefix("Let me check.\n")]
        r5 = await create(client, model=MODEL, messages=[user], tools=TOOLS, tool_choice="required")
        assert r5.choices[0].finish_reason == "tool_calls"
        assert double.constraints[-1] == "structural_tag" and set(double.constraints[:-1]) == {""}

        # n choices: each parsed on its own, each call with its own id
        double.answers = [ANSWER, FOLLOW_UP]
        r4 = await create(client, model=MODEL, messages=[user], tools=TOOLS, n=2)
        got = sorted((c.finish_reason, len(c.message.tool_calls or [])) for c in r4.choices)
        assert got == [("stop", 0), ("tool_calls", 1)]
        double.answers = [ANSWER, ANSWER]
        stream = await create(client, model=MODEL, messages=[user], tools=TOOLS, n=2, stream=True)
        by_choice: dict[int, list[Any]] = {}
        async for c in stream:
            for ch in c.choices:
                by_choice.setdefault(ch.index, []).append(ch)
        ids: set[str] = set()
        for chunks in by_choice.values():
            content, streamed, finish, _ = collect(chunks)
            assert content == "Let me check." and finish == "tool_calls" and len(streamed) == 1
            ids.add(streamed[0]["id"])
        assert len(ids) == 2
        await client.close()


async def test_tools_stay_refused_without_a_parser(
    template_dir: Path, engine: tuple[RecordingSglang, str]
) -> None:
    double, worker = engine
    async with gateway(template_dir, worker, "--tool-call-parser", "none") as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        user = {"role": "user", "content": "hi"}
        with pytest.raises(openai.BadRequestError) as e:
            await create(client, model=MODEL, messages=[user], tools=TOOLS)
        assert param_of(e.value) == "tools"
        assert double.inputs == []
        await client.close()


MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{# calls come as [TOOL_CALLS] [...] #}"
)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped tokenizer with ``[TOOL_CALLS]`` as a special (control) token, as in Mistral's."""
    d = tmp_path_factory.mktemp("mistral-tokenizer")
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens(["[TOOL_CALLS]"])
    tok.save(str(d / "tokenizer.json"))
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = MISTRAL_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


async def test_a_parser_whose_marker_is_a_special_token(mistral_dir: Path) -> None:
    """Output is decoded with special tokens shown when a parser is in use (as SGLang does with
    tools), so a control-token marker reaches the parser; the end-of-turn token still is hidden."""
    double = RecordingSglang(mistral_dir, eos=(2,))  # <|im_end|>
    codec = Tokenizer.from_file(str(mistral_dir / "tokenizer.json"))
    marker = codec.token_to_id("[TOOL_CALLS]")
    assert marker is not None
    assert codec.decode([marker], skip_special_tokens=True) == ""  # gone when special tokens are skipped
    server, address = await serve(add_sglang(double))
    user = {"role": "user", "content": "Weather in Paris?"}
    try:
        async with gateway(mistral_dir, f"grpc://{address}") as base:  # parser read from the template
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
            double.answers = [
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                "Plain.",
            ]
            r = await create(client, model=MODEL, messages=[user], tools=TOOLS)
            calls = r.choices[0].message.tool_calls or []
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("get_weather", {"city": "Paris"})
            ]
            assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
            r2 = await create(client, model=MODEL, messages=[user], tools=TOOLS, stream=True)
            content, streamed, finish, _ = collect([ch async for c in r2 for ch in c.choices])
            assert content == "Plain." and streamed == [] and finish == "stop"  # no <|im_end|> shown
            await client.close()
    finally:
        await server.stop(0.2)


async def test_the_grpc_front_refuses_tools_it_cannot_answer(
    template_dir: Path, engine: tuple[RecordingSglang, str]
) -> None:
    """The gateway's gRPC API has no field for tool calls: a request whose tools the gateway would
    parse is refused there (INVALID_ARGUMENT naming ``tools_json``) instead of answered raw."""
    double, worker = engine
    gport = free_port()
    async with gateway(template_dir, worker, "--grpc-port", str(gport)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as channel:
            req = gateway_pb2.CompletionRequest(
                model=MODEL,
                messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                tools_json=json.dumps(TOOLS),
                max_tokens=3,
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gateway_pb2_grpc.GatewayStub(channel).Complete(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools_json" in (e.value.details() or "")
    assert double.inputs == []


async def test_an_engine_going_on_past_max_tokens_is_cut_there(
    template_dir: Path, engine: tuple[RecordingSglang, str]
) -> None:
    """The engine ignores ``max_new_tokens`` (this one answers its script whole): the gateway
    ends the answer at ``max_tokens`` with ``length``, streamed and not, and bills no more."""
    double, worker = engine
    long = " ".join(f"word{i}" for i in range(120))  # far more tokens than asked for
    async with gateway(template_dir, worker) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        user = {"role": "user", "content": "Talk."}
        double.answers = [long, long]
        whole = await create(client, model=MODEL, messages=[user], max_tokens=8, temperature=0)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
        want = double.hf.decode(double.hf.encode(long, add_special_tokens=False)[:8])
        assert whole.choices[0].message.content == want
        stream = await create(
            client,
            model=MODEL,
            messages=[user],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length" and usage is not None and usage.completion_tokens == 8
        assert text == want  # the engine streams 2 tokens a chunk: the limit falls between chunks
        await client.close()
