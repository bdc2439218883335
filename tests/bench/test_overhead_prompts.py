"""``bench overhead``'s prompts: unique by default, or behind one shared system prompt."""

from __future__ import annotations

import orjson

from prefixgate.bench.overhead import TURN_BYTES, Prompts, body


def test_prompts_share_no_prefix_by_default() -> None:
    p = Prompts()
    a, b = p.make(2048), p.make(2048)
    assert len(a) == len(b) == 2048 and a[:20] != b[:20] and p.head == []
    assert [m["role"] for m in orjson.loads(body(a, stream=False))["messages"]] == ["user"]


def test_a_system_prompt_and_a_history_come_first_in_every_request() -> None:
    p = Prompts(system_bytes=1024, history_turns=3)
    system = p.head[0]
    assert system["role"] == "system" and len(system["content"]) == 1024
    assert [m["role"] for m in p.head[1:]] == ["user", "assistant", "user"]
    assert all(len(m["content"]) == TURN_BYTES for m in p.head[1:])
    assert len({m["content"] for m in p.head}) == 4  # no two turns alike
    first, second = (orjson.loads(body(p.make(512), stream=True, head=p.head)) for _ in range(2))
    for b in (first, second):
        assert b["messages"][:4] == p.head and b["messages"][4]["role"] == "user"
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert first["messages"][4]["content"] != second["messages"][4]["content"]
