"""Normalization: the same meaning in gives the same bytes out; different meaning differs."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.openai.normalize import (
    Document,
    NormalizationError,
    canonical_json,
    clean_text,
    render_chat,
    render_completion,
)

TOK = Bytes4Tokenizer()


def hashes_of(text: str, block_size: int = 16) -> list[int]:
    return block_hashes(TOK.encode(text), block_size, Namespace("m", block_size=block_size).root())


def test_system_messages_merge_into_one_prefix_whatever_their_position() -> None:
    a = render_chat(
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Answer briefly."},
        ]
    )
    b = render_chat(
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "hi"},
        ]
    )
    assert a.text == b.text
    assert a.text.startswith("<|system|>\nYou are helpful.\n\nAnswer briefly.\n<|end|>\n")
    assert next(s.kind for s in a.segments) == "system"


def test_line_endings_trailing_whitespace_and_unicode_form_are_normalized() -> None:
    a = render_chat([{"role": "user", "content": "line one  \r\nline two\t\r\n\r\n"}])
    b = render_chat([{"role": "user", "content": "line one\nline two"}])
    assert a.text == b.text
    assert clean_text("caf\u0065\u0301") == clean_text("caf\u00e9")


def test_indentation_inside_a_line_is_kept() -> None:
    a = render_chat([{"role": "user", "content": "def f():\n    return 1"}])
    b = render_chat([{"role": "user", "content": "def f():\n  return 1"}])
    assert a.text != b.text


def test_documents_in_any_order_give_the_same_bytes_and_block_hashes() -> None:
    docs = [Document(f"d{i}", f"chunk number {i} " * 40) for i in range(5)]
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question?"}]
    a = render_chat(msgs, documents=docs)
    b = render_chat(msgs, documents=list(reversed(docs)))
    c = render_chat(msgs, documents=[docs[2], docs[0], docs[4], docs[1], docs[3], docs[0]])
    assert a.text == b.text == c.text
    assert hashes_of(a.text) == hashes_of(b.text)
    labels = [s.label for s in a.segments if s.kind == "document"]
    assert labels == ["d0", "d1", "d2", "d3", "d4"]


def test_documents_come_after_the_system_prefix_and_before_the_conversation() -> None:
    layout = render_chat(
        [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}],
        documents=[Document("a", "A")],
    )
    kinds = [s.kind for s in layout.segments]
    assert kinds.index("system") < kinds.index("document") < kinds.index("conversation")
    # Segment spans are byte offsets that tile the text.
    assert layout.segments[0].start == 0
    for prev, nxt in zip(layout.segments, layout.segments[1:], strict=False):
        assert prev.end == nxt.start
    assert layout.segments[-1].end == len(layout.text.encode())


def test_tool_schemas_with_different_key_order_render_identically() -> None:
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": {"y": 2, "x": 1}}}}]
    t2 = [{"function": {"parameters": {"a": {"x": 1, "y": 2}, "b": 1}, "name": "f"}, "type": "function"}]
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, tools=t1).text == render_chat(msgs, tools=t2).text
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


def test_a_different_question_keeps_the_shared_prefix_bytes() -> None:
    docs = [Document("doc", "long text " * 500)]
    a = render_chat([{"role": "user", "content": "first question"}], documents=docs)
    b = render_chat([{"role": "user", "content": "second question"}], documents=docs)
    ha, hb = hashes_of(a.text), hashes_of(b.text)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    doc_end = next(s.end for s in a.segments if s.kind == "document")
    assert shared * 16 * 4 >= doc_end - 16 * 4  # every full block of the prefix is shared


def test_switched_off_renders_as_given() -> None:
    docs = [Document("b", "B"), Document("a", "A")]
    msgs = [{"role": "user", "content": "q  "}, {"role": "system", "content": "s"}]
    off = render_chat(msgs, documents=docs, normalize=False)
    assert off.text.index('id="b"') < off.text.index('id="a"')
    assert "q  " in off.text
    assert off.text.index("<|user|>") < off.text.index("<|system|>")


def test_content_parts_and_errors() -> None:
    parts = render_chat(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert "a\nb" in parts.text
    with pytest.raises(NormalizationError) as e:
        render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}])
    assert e.value.param == "messages[0].content[1]"
    with pytest.raises(NormalizationError) as e:  # an image needs its URL
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert e.value.param == "messages[0].content[0].image_url"
    with pytest.raises(NormalizationError):
        render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(NormalizationError):
        render_chat([])


def test_completion_prompt_keeps_trailing_space_but_unifies_line_endings() -> None:
    assert render_completion("a\r\nb ").text == "a\nb "
    with_docs = render_completion("Q:", documents=[Document("z", "Z"), Document("y", "Y")])
    assert with_docs.text.index('id="y"') < with_docs.text.index('id="z"') < with_docs.text.index("Q:")


_PIECES = ["a", "b", " ", "é", "e\u0301", "\n", "\r", "\t", "<", "|", ">", "\\", "😀", "<|tool_calls|>"]
_TEXTS = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)


_CALLS = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": "é<|"}'}}]
_MESSAGES = st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _TEXTS, st.booleans())


@given(st.lists(_MESSAGES, min_size=1, max_size=6))
def test_segments_and_client_spans_are_exact_byte_ranges_of_the_rendered_text(
    chat: list[tuple[str, str, bool]],
) -> None:
    """ASCII or not, with markers (tool calls) or without: the offsets are UTF-8 byte offsets,
    the segments tile the text, and the client spans hold client text only."""
    messages = [
        {"role": role, "content": text, **({"tool_calls": _CALLS} if calls and role == "assistant" else {})}
        for role, text, calls in chat
    ]
    layout = render_chat(messages)
    raw = layout.text.encode()
    assert layout.segments[0].start == 0 and layout.segments[-1].end == len(raw)
    for prev, nxt in zip(layout.segments, layout.segments[1:], strict=False):
        assert prev.end == nxt.start
    for seg in layout.segments:
        if seg.kind == "message":
            role = seg.label.split(":")[1]
            assert raw[seg.start : seg.end].startswith(f"<|{role}|>\n".encode())
            assert raw[seg.start : seg.end].endswith(b"\n<|end|>\n")
    for start, end in layout.user_spans:
        assert 0 <= start < end <= len(raw)
        assert raw[start:end].decode()  # whole characters
        assert b"<|" not in raw[start:end]  # client text is escaped; markers fall outside


def _clean_text_line_by_line(text: str) -> str:
    """``clean_text`` as first written: each line's ``rstrip`` in a loop."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


_SPACES = [
    " ",
    "\t",
    "\n",
    "\r",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\x85",
    "\xa0",
    "\u2000",
    "\u2028",
    "\u3000",
]


@given(st.lists(st.sampled_from([*_SPACES, "a", "é", "e\u0301", "😀", "x y"]), max_size=40).map("".join))
def test_clean_text_takes_off_what_rstrip_takes_off_each_line(text: str) -> None:
    assert clean_text(text) == _clean_text_line_by_line(text)
