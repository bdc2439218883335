"""Tool-call parsers on hostile model output: streamed in small pieces they cost time in
proportion to the text (never a rescan of all of it per piece), any output gives content or
calls and never an exception (50k nested brackets included), ``<|python_end|>`` never shows, and
the gateway's streaming path turns a parser's failure into content and still ends the stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from prefixgate.gateway import toolcalls as tc
from prefixgate.gateway.httpfront import responses
from prefixgate.gateway.nodeclient.base import TokenDelta
from prefixgate.gateway.toolcalls import Call, Event, Text, calls_of, new_parser, parse_text
from prefixgate.gateway.toolcalls.scan import MAX_CALL_CHARS, MAX_DEPTH
from prefixgate.gateway.toolcalls.shapes import ToolDeltas, message

CHUNK = 4  # characters per streamed piece: about a token


def _long(n: int) -> str:
    return ("abc, def; ] } { [ <x> " * (n // 22 + 1))[:n]


# What made the parsers rescan their buffer on every piece, each a call of about ``n`` characters.
COSTLY: dict[str, tuple[str, Callable[[int], str]]] = {
    "llama3 call": ("llama3", lambda n: '{"name": "f", "parameters": {"x": "' + "a" * n + '"}}'),
    "mistral call": (
        "mistral",
        lambda n: '[TOOL_CALLS] [{"name": "f", "arguments": {"x": "' + "a" * n + '"}}]',
    ),
    "hermes unterminated name": ("hermes", lambda n: '<tool_call>\n{"name": "' + "a" * n),
    "hermes arguments first": (
        "hermes",
        lambda n: '<tool_call>{"arguments": {"x": "' + _long(n) + '"}, "name": "f"}</tool_call>',
    ),
    "hermes streamed arguments": (
        "hermes",
        lambda n: '<tool_call>{"name": "f", "arguments": {"x": "' + _long(n) + '"}}</tool_call>',
    ),
    "pythonic brackets in a string": ("pythonic", lambda n: '[f(x="' + "]" * n + '")]'),
}


def _stream_seconds(name: str, text: str, budget: float) -> float:
    """CPU time (this thread's: other processes on the machine do not inflate it) to stream
    ``text`` through the gateway's deltas in CHUNK pieces; the budget bounds the test (a
    rescanning parser is stopped, not waited for)."""
    deltas = ToolDeltas(name)
    t0 = time.thread_time()
    for i in range(0, len(text), CHUNK):
        deltas.step(text[i : i + CHUNK], False)
        if i % 4096 == 0 and time.thread_time() - t0 > budget:
            pytest.fail(f"{name}: {i:,} of {len(text):,} characters streamed in {budget} s of CPU")
    deltas.step("", True)
    return time.thread_time() - t0


@pytest.mark.parametrize("case", list(COSTLY))
def test_streaming_cost_is_linear_in_the_output(case: str) -> None:
    name, make = COSTLY[case]
    small = min(_stream_seconds(name, make(16 * 1024), 2.0) for _ in range(3))
    big = _stream_seconds(name, make(512 * 1024), 5.0)  # 32 times the text
    # linear: about 32 times the time; a rescan per piece: hundreds of times (or the budget)
    assert big < 100 * small + 0.05, (case, small, big)


def _llama3_call_of(n: int) -> str:
    return '{"name": "write", "parameters": {"text": "' + "a" * n + '"}}'


def test_a_one_megabyte_call_streams_in_seconds() -> None:
    text = _llama3_call_of(1024 * 1024)
    assert _stream_seconds("llama3", text, 8.0) < 8.0
    content, calls = parse_text("llama3", text)
    assert content == "" and [c.name for c in calls] == ["write"]


def _nested(depth: int) -> str:
    """A call whose JSON nests ``depth`` deep, arguments first (a block taken whole)."""
    return '{"arguments": {"x": ' + "[" * (depth - 2) + "]" * (depth - 2) + '}, "name": "f"}'


DEEP = "[" * 50_000
CLOSED = DEEP + "]" * 50_000
LLAMA3_CALL = '{"name": "f", "parameters": {"x": 1}}'
# label: (parser, model output, its content, its calls' names)
HOSTILE: dict[str, tuple[str, str, str, list[str]]] = {
    "hermes block": ("hermes", "<tool_call>" + DEEP + "</tool_call>", "", []),
    "hermes unclosed": ("hermes", "<tool_call>" + DEEP, "", []),
    "hermes arguments first": (
        "hermes",
        '<tool_call>{"arguments": ' + CLOSED + ', "name": "f"}</tool_call>',
        "",
        [],
    ),
    "hermes arguments string": (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "' + CLOSED + '"}</tool_call>',
        "",
        [],
    ),
    "qwen25 then text": ("qwen25", "<tool_call>" + CLOSED + "</tool_call> after", "", []),
    "llama3 unclosed": ("llama3", "{" + DEEP, "", []),
    "llama3 arguments": ("llama3", '{"name": "f", "parameters": {"x": ' + CLOSED + "}}", "", []),
    "llama3 after a call": ("llama3", LLAMA3_CALL + '; {"a": ' + DEEP, '; {"a": ' + DEEP, ["f"]),
    "mistral unclosed": ("mistral", "[TOOL_CALLS] " + DEEP, "", []),
    "mistral then text": ("mistral", "[TOOL_CALLS] " + CLOSED + " after", "", []),
    "mistral many markers": ("mistral", "[TOOL_CALLS] 1" * 5_000, "", []),
    "pythonic arguments": ("pythonic", "[f(x=" + CLOSED + ")]", "", []),
    "pythonic long name": ("pythonic", "[" + "a." * 1_000 + "b()]", "", []),
    "pythonic long expression": ("pythonic", "[f(x=" + "-" * 100_000 + "1)]", "", []),
}


def _streamed(name: str, text: str, size: int) -> tuple[str, list[Call]]:
    p = new_parser(name)
    events: list[Event] = []
    for i in range(0, len(text), size):
        events += p.feed(text[i : i + size])
    events += p.finish()
    return "".join(e.text for e in events if isinstance(e, Text)), calls_of(events)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_any_nesting_gives_content_and_no_exception(case: str) -> None:
    name, text, content, calls = HOSTILE[case]
    content = content or text  # no call: all of it is content, markers and all; nothing lost
    whole = parse_text(name, text)
    assert (whole[0], [c.name for c in whole[1]]) == (content, calls)
    assert _streamed(name, text, 4096) == whole
    assert _streamed(name, text, 7) == whole
    msg, called = message(name, text)
    assert (msg["content"] or "") == (content if calls else text) and called == bool(calls)


def test_the_bounds_are_where_content_begins() -> None:
    for name, marked in (("hermes", "<tool_call>{}</tool_call>"), ("llama3", "{}")):
        ok, deep = (marked.replace("{}", _nested(d)) for d in (MAX_DEPTH, MAX_DEPTH + 1))
        assert [c.name for c in parse_text(name, ok)[1]] == ["f"]
        assert parse_text(name, deep) == (deep, [])
    huge = '{"name": "f", "parameters": {"x": "' + "a" * MAX_CALL_CHARS + '"}}'
    assert parse_text("llama3", huge) == (huge, [])
    # the streamed arguments of a Hermes call are passed on as written, never parsed: no bound
    streamed = '<tool_call>{"name": "f", "arguments": {"x": ' + CLOSED + "}}</tool_call>"
    assert parse_text("hermes", streamed) == ("", [Call("f", '{"x": ' + CLOSED + "}")])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("after", ["", " done", "\n"])
def test_the_pythonic_end_tag_never_shows(size: int, after: str) -> None:
    text = '<|python_start|>[get_weather(city="Paris"), now()]<|python_end|>' + after
    content, calls = _streamed("pythonic", text, size)
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert content == after.strip()
    deltas = ToolDeltas("pythonic")
    out = [d for i in range(0, len(text), size) for d in deltas.step(text[i : i + size], False)]
    out += deltas.step("", True)
    shown = "".join(d.get("content", "") for d in out)
    assert "python_end" not in shown and "<|" not in shown


class _Broken:
    """A parser with a bug: it fails on the text it is given."""

    def feed(self, text: str) -> list[Event]:
        if "boom" in text:
            raise RuntimeError("parser bug")
        return [Text(text)]

    def finish(self) -> list[Event]:
        return []


@pytest.fixture
def broken_hermes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tc._FACTORIES, "hermes", _Broken)


@pytest.mark.usefixtures("broken_hermes")
def test_a_failing_parser_leaves_the_text_as_content() -> None:
    deltas = ToolDeltas("hermes")
    pieces = ["Hello,", " boom ", "and the rest"]
    out = [d for p in pieces for d in deltas.step(p, False)] + deltas.step("", True)
    assert "".join(d["content"] for d in out) == "Hello, boom and the rest"
    assert message("hermes", "a boom b") == ({"role": "assistant", "content": "a boom b"}, False)


class _Choices:
    """One chat choice streaming scripted deltas, as ``Choices`` does."""

    def __init__(self, texts: list[str]) -> None:
        self._texts = texts
        self.executions = [SimpleNamespace(prep=SimpleNamespace(tool_parser="hermes"), completion_tokens=1)]
        self.request_id, self.prompt_tokens, self.cached_tokens, self.completion_tokens = "r1", 3, 0, 1

    async def stream(self) -> Any:
        for k, text in enumerate(self._texts):
            yield 0, TokenDelta(text=text, finish_reason="stop" if k == len(self._texts) - 1 else "")


def _sse(texts: list[str]) -> list[bytes]:
    parsed = SimpleNamespace(model="m", sampling=SimpleNamespace(logprobs=False), include_usage=False)

    async def run() -> list[bytes]:
        return [b async for b in responses.stream(cast(Any, _Choices(texts)), cast(Any, parsed), "chat")]

    return asyncio.run(run())


def _content(events: list[bytes]) -> str:
    out = ""
    for e in events:
        for line in e.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in orjson.loads(line[6:])["choices"]:
                    out += choice["delta"].get("content") or ""
    return out


def test_a_stream_of_deep_brackets_ends_with_done() -> None:
    texts = ["<tool_call>", *([DEEP[:4096]] * 12), "</tool_call>"]
    events = _sse(texts)
    assert events[-1].endswith(b"data: [DONE]\n\n")
    assert _content(events) == "".join(texts)


@pytest.mark.usefixtures("broken_hermes")
def test_a_stream_whose_parser_fails_ends_with_done() -> None:
    events = _sse(["Hi,", " boom", " end"])
    assert events[-1].endswith(b"data: [DONE]\n\n")
    assert _content(events) == "Hi, boom end"
