"""``bench overhead``'s prompts: unique by default, or behind one shared system prompt."""

from __future__ import annotations

import orjson

from prefixgate.bench.overhead import Prompts, body


def test_prompts_share_no_prefix_by_default() -> None:
    p = Prompts()
    a, b = p.make(2048), p.make(2048)
    assert len(a) == len(b) == 2048 and a[:20] != b[:20] and p.system == ""
    assert [m["role"] for m in orjson.loads(body(a, stream=False))["messages"]] == ["user"]


def test_a_system_prompt_comes_first_in_every_request() -> None:
    p = Prompts(system_bytes=1024)
    assert len(p.system) == 1024
    first, second = (orjson.loads(body(p.make(512), stream=True, system=p.system)) for _ in range(2))
    for b in (first, second):
        assert b["messages"][0] == {"role": "system", "content": p.system}
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert first["messages"][1]["content"] != second["messages"][1]["content"]
