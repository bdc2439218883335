"""Workloads are deterministic, and normalization makes equivalent requests hash alike."""

from __future__ import annotations

import random
from pathlib import Path

import orjson

from prefixgate.bench.generated import _shuffled, generate, request_hashes
from prefixgate.bench.textgen import segment_text, span_hashes, spans_text
from prefixgate.bench.traces import load_azure, load_mooncake, mooncake_spans
from prefixgate.bench.workloads import Workload, WorkloadOptions, load_workload
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer


def test_same_id_gives_the_same_512_token_text() -> None:
    a = segment_text(1234, 512, "mooncake")
    assert a == segment_text(1234, 512, "mooncake")
    assert a != segment_text(1235, 512, "mooncake")
    assert a.isascii() and len(a.encode()) == 2048
    assert len(Bytes4Tokenizer().encode(a)) // 4 == 512
    # A partial block is a prefix of the full one.
    assert segment_text(1234, 100, "mooncake") == a[:400]


def test_mooncake_spans_follow_input_length() -> None:
    spans = mooncake_spans([0, 7, 9], 1500)
    assert spans == [(0, 512), (7, 512), (9, 476)]
    text = spans_text(spans, "mooncake")
    assert len(text.encode()) == 1500 * 4


def test_span_hashes_match_the_sharing_of_real_text() -> None:
    """Two prompts agree on exactly as many leading blocks as their text does."""
    root = Namespace("m").root()
    a = mooncake_spans([0, 1, 2, 3], 2000)
    b = mooncake_spans([0, 1, 5], 1400)
    ha, hb = span_hashes(a, 64, root), span_hashes(b, 64, root)
    shared = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert shared == 16  # two trace blocks of 512 = 16 of ours
    tok = Bytes4Tokenizer()
    ta, tb = tok.encode(spans_text(a, "s")), tok.encode(spans_text(b, "s"))
    ra, rb = block_hashes(ta, 64, root), block_hashes(tb, 64, root)
    assert next(i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y) == 16
    assert len(ha) == len(ra) and len(hb) == len(rb)
    # The memo changes nothing.
    memo: dict[tuple[int, int, int], tuple[int, ...]] = {}
    assert span_hashes(a, 64, root, memo) == ha and span_hashes(a, 64, root, memo) == ha


def test_document_order_does_not_change_hashes_under_normalization() -> None:
    docs = [{"id": f"kb-{i}", "text": segment_text(i, 300, "kb", line_words=10)} for i in range(5)]
    msgs = [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": "Why?"}]
    body_a = {"messages": msgs, "documents": docs}
    body_b = {"messages": msgs, "documents": docs[::-1]}
    on, off = WorkloadOptions(normalize=True), WorkloadOptions(normalize=False)
    assert request_hashes(body_a, on) == request_hashes(body_b, on)
    n_a, h_a = request_hashes(body_a, off)
    n_b, h_b = request_hashes(body_b, off)
    assert n_a == n_b and h_a != h_b  # as given, the order changes the bytes


def test_tool_key_order_does_not_change_hashes_under_normalization() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "description": segment_text(i, 200, "t"),
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
        for i in range(4)
    ]
    msgs = [{"role": "user", "content": "go"}]
    shuffled = _shuffled(tools, random.Random(3))
    assert shuffled == tools and orjson.dumps(shuffled) != orjson.dumps(tools)
    on, off = WorkloadOptions(normalize=True), WorkloadOptions(normalize=False)
    assert request_hashes({"messages": msgs, "tools": tools}, on) == request_hashes(
        {"messages": msgs, "tools": shuffled}, on
    )
    assert (
        request_hashes({"messages": msgs, "tools": tools}, off)[1][0]
        != request_hashes({"messages": msgs, "tools": shuffled}, off)[1][0]
    )


def test_generated_workloads_are_deterministic_and_normalization_pays() -> None:
    opts = WorkloadOptions(requests=150, seed=7)
    for fmt in ("rag", "chat", "agent", "longdoc"):
        w1, w2 = generate(fmt, opts), generate(fmt, opts)
        assert len(w1.requests) == 150
        assert [r.block_hashes for r in w1.requests] == [r.block_hashes for r in w2.requests]
        assert all(b.arrival_s >= a.arrival_s for a, b in zip(w1.requests, w1.requests[1:], strict=False))
        path, body = w1.openai_body(w1.requests[0], "m")
        assert path == "/v1/chat/completions" and body["messages"] and body["model"] == "m"
    # Retrieved chunks in random order: only normalization lets questions share them.
    rag_on = load_workload("rag", None, WorkloadOptions(requests=400, normalize=True))
    rag_off = load_workload("rag", None, WorkloadOptions(requests=400, normalize=False))
    assert _distinct_blocks(rag_on) < 0.7 * _distinct_blocks(rag_off)


def _distinct_blocks(w: Workload) -> int:
    return len({h for r in w.requests for h in r.block_hashes})


def test_mooncake_slice(mooncake_trace: Path) -> None:
    w = load_mooncake(mooncake_trace, WorkloadOptions(block_size=512, limit=500, time_scale=2.0))
    assert len(w.requests) == 500
    first = w.requests[0]
    assert all(r.block_hashes[0] == first.block_hashes[0] for r in w.requests if r.block_hashes)
    assert first.arrival_s == 0.0 and w.requests[-1].arrival_s > 0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(w.requests, w.requests[1:], strict=False))
    # Block 512, the trace's own: one hash per full trace block.
    assert len(first.block_hashes) == first.prompt_tokens // 512
    again = load_mooncake(mooncake_trace, WorkloadOptions(block_size=512, limit=500, time_scale=2.0))
    assert [r.block_hashes for r in again.requests] == [r.block_hashes for r in w.requests]
    path, body = w.openai_body(first, "m", stream=False)
    assert path == "/v1/completions" and len(body["prompt"].encode()) == 4 * first.prompt_tokens
    sampled = load_mooncake(mooncake_trace, WorkloadOptions(block_size=512, limit=100, fraction=0.5, seed=1))
    assert len(sampled.requests) == 100 and sampled.requests[-1].arrival_s > w.requests[99].arrival_s


def test_azure_sessions_keep_trace_lengths(azure_trace: Path) -> None:
    w = load_azure(azure_trace, WorkloadOptions(limit=2000, time_scale=10.0))
    assert len(w.requests) == 2000
    for r in w.requests:
        assert sum(n for _, n in r.spans) == r.prompt_tokens
    by_session: dict[int, list[int]] = {}
    for i, r in enumerate(w.requests):
        by_session.setdefault(r.session, []).append(i)
    follow = [ids for ids in by_session.values() if len(ids) > 1]
    assert follow, "the sessions model produced no follow-up turn"
    a, b = w.requests[follow[0][0]], w.requests[follow[0][1]]
    shared = len(a.block_hashes)
    assert b.block_hashes[:shared] == a.block_hashes  # the next turn extends the previous prompt
