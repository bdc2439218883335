"""Server-sent events off a byte stream, each line and each event bounded in size.

A general SSE reader keeps a line however long it grows: a worker that sends one endless line
takes the gateway's memory with it, and the whole line is relayed once it ends. This one holds at
most ``max_line`` bytes of an unfinished line and ``max_event`` bytes of an event's data, and
raises ``EventTooLarge`` as soon as either is passed, before more is read.

The format is the WHATWG event stream, as far as the gateway reads it: lines end at CRLF, LF or
CR; ``data`` lines are joined with newlines; an event is dispatched at a blank line; comments and
the other fields (``event``, ``id``, ``retry``) are skipped; an event cut off before its blank
line is dropped; a leading byte-order mark is ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

_BOM = b"\xef\xbb\xbf"


class EventTooLarge(ValueError):
    """A line or an event over its bound."""


async def event_data(chunks: AsyncIterable[bytes], *, max_line: int, max_event: int) -> AsyncIterator[str]:
    """The data of each event in ``chunks`` (text; bytes that are not UTF-8 are replaced)."""
    buf = bytearray()
    data: list[bytearray] = []
    size = 0
    first = True
    async for chunk in chunks:
        buf += chunk
        held = len(buf) - 1 if buf.endswith(b"\r") else len(buf)  # a last CR may start a CRLF
        end = max(buf.rfind(b"\n", 0, held), buf.rfind(b"\r", 0, held)) + 1
        if not end:  # no line ends here yet
            if len(buf) > max_line:
                raise EventTooLarge(f"a line over {max_line} bytes")
            continue
        lines = buf[:end].splitlines()  # bytes split at CRLF, LF and CR only
        del buf[:end]
        if len(buf) > max_line:
            raise EventTooLarge(f"a line over {max_line} bytes")
        if first:
            first = False
            lines[0] = lines[0].removeprefix(_BOM)
        for line in lines:
            if len(line) > max_line:
                raise EventTooLarge(f"a line over {max_line} bytes")
            if not line:
                if data:
                    yield b"\n".join(data).decode("utf-8", errors="replace")
                data, size = [], 0
                continue
            field, _, value = line.partition(b":")
            if field != b"data":
                continue  # a comment (empty field name) or a field the gateway does not read
            value = value.removeprefix(b" ")
            size += len(value) + 1
            if size > max_event:
                raise EventTooLarge(f"an event over {max_event} bytes")
            data.append(value)
