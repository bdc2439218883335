"""The bounded SSE reader: the event format as workers write it, however the bytes are split, and
its bounds (checked with small ones here; the adapter's real ones in ``test_engine_bounds``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prefixgate.gateway.nodeclient.sse import EventTooLarge, event_data


async def chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def read(parts: list[bytes], max_line: int = 1 << 20, max_event: int = 1 << 20) -> list[str]:
    return [d async for d in event_data(chunks(parts), max_line=max_line, max_event=max_event)]


STREAM = (
    b"\xef\xbb\xbf: a comment\n"
    b'data: {"a": 1}\n\n'
    b"event: x\nid: 7\ndata: two\ndata:lines\r\n\r\n"
    b"data: cr\r\rdata: [DONE]\n\n"
)
EXPECTED = ['{"a": 1}', "two\nlines", "cr", "[DONE]"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
async def test_events_come_out_the_same_however_the_bytes_are_split(size: int) -> None:
    parts = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert await read(parts) == EXPECTED


async def test_an_event_cut_before_its_blank_line_is_dropped_and_bad_utf8_is_replaced() -> None:
    assert await read([b"data: \xff\n\ndata: cut"]) == ["\ufffd"]


async def test_a_line_over_the_bound_is_refused_before_it_ends() -> None:
    reader = event_data(
        chunks([b"data: ok\n\n", b"data: " + b"x" * 60, b"x" * 60]), max_line=100, max_event=1000
    )
    assert await anext(reader) == "ok"
    with pytest.raises(EventTooLarge, match="a line over 100 bytes"):
        await anext(reader)
    with pytest.raises(EventTooLarge, match="a line over 100 bytes"):  # whole in one chunk, too
        await read([b"data: " + b"x" * 200 + b"\n\n"], max_line=100)


async def test_an_event_of_many_short_lines_is_bounded_too() -> None:
    assert await read([b"data: 123456789\n" * 9 + b"\n"], max_event=90) == ["\n".join(["123456789"] * 9)]
    with pytest.raises(EventTooLarge, match="an event over 90 bytes"):
        await read([b"data: 123456789\n" * 10 + b"\n"], max_event=90)
