"""Settings precedence and request validation."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.gateway.config import load_settings
from prefixgate.gateway.core.bodyparse import values_bound
from prefixgate.gateway.core.errors import GatewayError
from prefixgate.openai.errors import from_domain
from prefixgate.openai.schema import count_values, parse_json, parse_request

KW = dict(models={"m"}, default_max_tokens=16, max_tokens_limit=1000, max_documents=4)


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text('port = 9000\nprefill = ["127.0.0.1:1"]\nredis = "redis://x"\n')
    s = load_settings(cfg, {"port": None}, environ={})
    assert s.port == 9000 and s.prefill == ["127.0.0.1:1"]
    s = load_settings(cfg, {}, environ={"PREFIXGATE_PORT": "9100", "PREFIXGATE_DECODE": "a:1,b:2"})
    assert s.port == 9100 and s.decode == ["a:1", "b:2"]
    s = load_settings(cfg, {"port": 9200}, environ={"PREFIXGATE_PORT": "9100"})
    assert s.port == 9200
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such = 1\n")
    with pytest.raises(ValueError, match="no_such"):
        load_settings(bad, {}, environ={})


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"", 400, None),
        (b"{", 400, None),
        (b"\xff\xfe", 400, None),
        (b"[1]", 400, None),
    ],
)
def test_bad_json(raw: bytes, status: int, param: str | None) -> None:
    with pytest.raises(GatewayError) as e:
        parse_json(raw)
    api = from_domain(e.value)
    assert api.status == status and api.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"model": "m", "messages": []}, 400, "messages"),
        ({"model": "m", "messages": "hi"}, 400, "messages"),
        ({"model": "m", "messages": [1]}, 400, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3},
            400,
            "temperature",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, 400, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "documents": [{"id": "a"}]},
            400,
            "documents[0].text",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "documents": [{"text": "t"}] * 5},
            400,
            "documents",
        ),
    ],
)
def test_bad_fields_name_their_param(body: dict[str, object], status: int, param: str) -> None:
    with pytest.raises(GatewayError) as e:
        parse_request(body, "chat", **KW)  # type: ignore[arg-type]
    assert from_domain(e.value).status == status
    assert e.value.param == param


def test_completion_prompt_forms() -> None:
    r = parse_request({"model": "m", "prompt": [1, 2, 3]}, "completion", **KW)  # type: ignore[arg-type]
    assert r.prompt_token_ids == [1, 2, 3]
    r = parse_request({"model": "m", "prompt": ["one"]}, "completion", **KW)  # type: ignore[arg-type]
    assert r.prompt == "one"
    with pytest.raises(GatewayError):
        parse_request({"model": "m", "prompt": ["a", "b"]}, "completion", **KW)  # type: ignore[arg-type]
    r = parse_request({"model": "m", "prompt": "p", "max_completion_tokens": 7}, "completion", **KW)  # type: ignore[arg-type]
    assert r.sampling.max_tokens == 7 and r.max_tokens_given


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([{"role": "user", "content": "x"}] * 11, "messages", "too_many_messages"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}] * 4}] * 5,
            "messages[4].content",
            "too_many_content_parts",
        ),
    ],
)
def test_message_shape_limits_are_413_naming_the_field(
    messages: list[dict[str, object]], param: str, code: str
) -> None:
    with pytest.raises(GatewayError) as e:
        parse_request(
            {"model": "m", "messages": messages},
            "chat",
            max_messages=10,
            max_content_parts=16,
            **KW,  # type: ignore[arg-type]
        )
    api = from_domain(e.value)
    assert (api.status, api.param, api.code) == (413, param, code)


def test_json_values_are_counted_and_bounded() -> None:
    assert count_values({"a": [1, {"b": None}], "c": "x"}, 100) == 6
    assert count_values([[]] * 1000, 10) <= 1001  # stops counting past the bound
    body = orjson.dumps({"model": "m", "junk": [{}] * 20})
    assert parse_json(body, max_values=23)["junk"] == [{}] * 20
    with pytest.raises(GatewayError) as e:
        parse_json(body, max_values=22)
    api = from_domain(e.value)
    assert (api.status, api.code) == (413, "too_many_values")


def test_the_bytes_bound_the_values_from_above() -> None:
    bodies = [
        {"a": [1, 2, {"b": [[], [[]], {}]}], "c": "x, [y] {z}"},
        {"messages": [{"role": "user", "content": "hi"}] * 50, "n": None},
        {"deep": [[[[[[1]]]]]]},
    ]
    for body in bodies:
        raw = orjson.dumps(body)
        assert values_bound(raw) >= count_values(body, 10**6)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(0, 9) | st.text(max_size=2),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=1), inner, max_size=4),
    max_leaves=40,
)


@given(_JSON)
def test_a_body_holds_no_more_values_than_bytes(value: object) -> None:
    """What lets ``parse_json`` skip counting a body no longer than its bound: every value starts
    at a byte of its own, in the most compact JSON too."""
    assert count_values(value, 10**6) <= len(orjson.dumps(value))
