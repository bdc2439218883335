"""Tool-call parsers: each format's calls and content, markers never leaking, and the same
calls however the text is split (hypothesis chooses the splits)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.gateway.toolcalls import (
    Call,
    CallArgs,
    Event,
    Text,
    calls_of,
    detect_parser,
    new_parser,
    parse_text,
)

HERMES = (
    'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "東京"}}; {"name": "now", "parameters": {}}'
)
MISTRAL = (
    'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "now", "arguments": {}}]'
)
PYTHONIC = '[get_weather(city="Paris", days=[1, 2]), now()]'

CASES = [
    ("hermes", HERMES),
    ("qwen25", HERMES),
    ("llama3", LLAMA3),
    ("mistral", MISTRAL),
    ("pythonic", PYTHONIC),
    ("hermes", "no calls here, only <tool_ text and a < sign\n"),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'),  # unclosed at the end
    ("hermes", "<tool_call>not json</tool_call> after"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "} </tool_call> {"}}</tool_call>x'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": 2}]</tool_call>after'),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'),
    ("llama3", "Sure, {braces} in text"),
    ("llama3", '{"answer": 42}'),
    ("pythonic", "[1, 2, 3] is a list"),
    ("mistral", "[TOOL_CALLS] [broken"),
]


def test_hermes() -> None:
    content, calls = parse_text("hermes", HERMES)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"}
    assert calls[1].arguments == "{}"


def test_hermes_unclosed_and_malformed() -> None:
    assert parse_text("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n') == (
        "",
        [Call("f", '{"a": 1}')],
    )
    text = "<tool_call>not json</tool_call> after"
    assert parse_text("hermes", text) == (text, [])  # nothing lost: the block stays content
    assert parse_text("hermes", "<tool_call>{") == ("<tool_call>{", [])


def test_hermes_arguments_as_a_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>'
    assert parse_text("hermes", text) == ("", [Call("f", '{"a": [1]}')])


def test_hermes_arguments_stream_as_the_model_writes_them() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"q": "a long } </tool_call> query"}}\n</tool_call> done'
    _, calls, events = _run("hermes", list(text))  # one character at a time
    pieces = [e.text for e in events if isinstance(e, CallArgs)]
    assert len(pieces) > 10 and "".join(pieces) == '{"q": "a long } </tool_call> query"}'
    assert calls == [Call("f", '{"q": "a long } </tool_call> query"}')]
    assert "".join(e.text for e in events if isinstance(e, Text)) == "done"
    # broken off by the end marker: the call stands with what it has; the rest is content
    assert parse_text("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>x') == (
        "x",
        [Call("f", '{"a": 1')],
    )
    # arguments before the name: taken whole at the end marker
    assert parse_text("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>') == (
        "",
        [Call("f", '{"a": 1}')],
    )


def test_llama3() -> None:
    content, calls = parse_text("llama3", LLAMA3)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "東京"}),
        ("now", {}),
    ]
    assert parse_text("llama3", '{"name": "f", "arguments": {"x": 1}}') == ("", [Call("f", '{"x": 1}')])
    assert parse_text("llama3", '{"answer": 42}') == ('{"answer": 42}', [])  # JSON, not a call
    assert parse_text("llama3", "Hello {x}") == ("Hello {x}", [])


def test_mistral_and_pythonic() -> None:
    content, calls = parse_text("mistral", MISTRAL)
    assert content == "ok" and [c.name for c in calls] == ["get_weather", "now"]
    content, calls = parse_text("pythonic", PYTHONIC + " done")
    assert content == "done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("now", {}),
    ]
    assert parse_text("pythonic", "[1, 2, 3] is a list") == ("[1, 2, 3] is a list", [])
    assert parse_text("pythonic", "[f(x=__import__('os'))]") == (
        "[f(x=__import__('os'))]",
        [],
    )  # never evaluated


def test_plain_text_is_kept_as_is() -> None:
    for name in ("hermes", "llama3", "mistral", "pythonic"):
        assert parse_text(name, "  plain answer.\n\n") == ("  plain answer.\n\n", [])


def _run(name: str, pieces: list[str]) -> tuple[list[str], list[Call], list[Event]]:
    p = new_parser(name)
    events: list[Event] = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return [e.text for e in events if isinstance(e, Text)], calls_of(events), events


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("name", "text"), CASES)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_any_chunking_gives_the_same_answer(name: str, text: str, cuts: list[int]) -> None:
    whole = parse_text(name, text)
    shown, calls, _ = _run(name, _split(text, cuts))
    assert ("".join(shown), calls) == whole
    for piece in shown:  # no half of a marker ever shown while calls are found
        if whole[1]:
            assert "<tool_call" not in piece and "[TOOL_CALLS" not in piece and "python_tag" not in piece


@settings(max_examples=100, deadline=None)
@given(
    prefix=st.text(max_size=40),
    args=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
    cuts=st.lists(st.integers(0, 500), max_size=20),
)
def test_hermes_any_content_and_arguments(prefix: str, args: dict[str, object], cuts: list[int]) -> None:
    prefix = prefix.replace("<", "(")
    block = json.dumps({"name": "f", "arguments": args}, ensure_ascii=False)
    text = f"{prefix}<tool_call>\n{block}\n</tool_call>"
    shown, calls, _ = _run("hermes", _split(text, cuts))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", args)]
    assert "".join(shown) == prefix.rstrip()  # whitespace before a call is not content


def test_detect_from_template() -> None:
    qwen = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call></tool_call>{% endif %}"
    assert detect_parser(qwen) == "hermes"
    assert detect_parser("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert detect_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_parser("<tool_call></tool_call>") is None  # the template never reads tools
    assert detect_parser("{{ tools }}<tool_call></tool_call><|python_tag|>") is None  # ambiguous
    assert detect_parser("{{ messages }}") is None
