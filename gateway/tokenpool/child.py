"""A tokenizer child: ``python -m prefixgate.gateway.tokenpool.child DIR NICE [fast]``.

It lowers its own CPU priority by ``NICE`` (the gateway's event loop, its other requests and
their nodes come first when the cores are short: a long prompt waits a little longer instead),
loads ``DIR/tokenizer.json`` as ``EngineTokenizer`` does (no truncation, no padding), says
``READY`` with the sha256 of the file it loaded (the gateway refuses a child whose file is not
the one it loaded itself), then answers every frame on stdin, in turn, on stdout:

- ``ENCODE`` with ``IDS``: each text's ``encode(text, add_special_tokens=False)`` ids, packed
  little-endian u32. With ``fast`` (the gateway checked that tiktoken gives this tokenizer's ids,
  ``cachetier.fastbpe``) by tiktoken, one text after the other; otherwise the texts of one
  frame are encoded in one ``encode_batch_fast`` call (in parallel on the tokenizer's own
  threads; the same ids as ``encode``, ``cachetier.tokenizer.hf_ids_many``);
- ``KV_BATCH`` with ``COLUMNS``: an SMG ``KvEventBatch`` 's bytes in columns (``kvcolumns``).

It ends when stdin ends: when the gateway closes it, or exits however it exits. Ctrl-C on the
terminal is the gateway's to handle, so SIGINT is ignored. Nothing but frames is written to stdout.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from prefixgate.cachetier.fastbpe import FastBPE
from prefixgate.gateway.tokenpool import wire

_LITTLE = sys.byteorder == "little"


def read_exactly(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd`` (blocking); None at the end of the stream."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def load(directory: str, fast: bool = False) -> tuple[Any, str]:
    """The tokenizer (``FastBPE`` with ``fast``) and the sha256 of its ``tokenizer.json``."""
    raw = (Path(directory) / "tokenizer.json").read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if fast:
        from prefixgate.cachetier.fastbpe import compile_fast

        return compile_fast(json.loads(raw)), digest
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(raw.decode("utf-8"))
    tok.no_truncation()
    tok.no_padding()
    return tok, digest


def encode(tok: Any, texts: list[str]) -> list[bytes]:
    if isinstance(tok, FastBPE):
        return [tok.packed(t) for t in texts]
    out = []
    for e in tok.encode_batch_fast(texts, add_special_tokens=False):
        ids = array.array("I", e.ids)
        if not _LITTLE:
            ids.byteswap()
        out.append(ids.tobytes())
    return out


def answer(tok: Any, kind: int, parts: list[bytes]) -> list[bytes]:
    if kind == wire.ENCODE:
        return encode(tok, [p.decode("utf-8") for p in parts])
    from prefixgate.gateway.tokenpool import kvcolumns  # KV_BATCH

    (raw,) = parts
    return kvcolumns.to_parts(kvcolumns.parse_batch(raw))


def serve(tok: Any, digest: str, rfd: int, wfd: int) -> None:
    write_all(wfd, wire.frame(wire.READY, [digest.encode()]))
    while True:
        head = read_exactly(rfd, wire.HEADER.size)
        if head is None:
            return
        kind, size = wire.header(head, wire.TO_CHILD)
        payload = read_exactly(rfd, size)
        if payload is None:
            return
        try:
            reply = wire.frame(wire.ANSWERS[kind], answer(tok, kind, wire.split(payload)))
        except Exception as e:  # the gateway does it itself, and meets the error there
            reply = wire.frame(wire.FAILED, [repr(e)[:500].encode()])
        write_all(wfd, reply)


def main(argv: list[str]) -> int:
    directory, nice, *mode = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(nice):
        try:
            os.nice(int(nice))
        except OSError:
            pass  # not allowed here: the child still works, at the gateway's priority
    # the frames get stdout's pipe on a descriptor of their own; anything else written to
    # stdout, by Python or by native code, goes to stderr and cannot corrupt them
    wfd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    tok, digest = load(directory, fast=mode == ["fast"])
    try:
        serve(tok, digest, 0, wfd)
    except (BrokenPipeError, wire.BadFrame):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
