"""The gateway's side of the tokenizer children (``child``): a few processes, used by the
threads that prepare long requests, never by the event loop.

``encode_many(texts)`` is called by a render thread with the segments of a prompt that the
segment cache does not hold. It takes an idle child, writes the texts to it and reads their
packed ids back, with its own thread blocked in ``poll`` and pipe reads (the interpreter lock
released): the event loop does nothing for it. It answers None whenever the caller should
tokenize on its own thread instead, as it did before there were children:

- called on the event loop (a thread there would stall it), or with texts that are not UTF-8;
- no child ready yet: children start at the first long prompt, in the background (a fraction
  of a second each), and a start that fails is tried again after a backoff (1 s, doubling to 60);
- every child busy for ``WAIT_S``, or ``MAX_WAITING`` threads already waiting for one;
- the child died, hung past the call's deadline or broke the frame format: it is killed and
  replaced at once, and the request tokenized on the caller's thread (the same ids);
- the pool is closed, or disabled because a child loaded another ``tokenizer.json`` than the
  gateway's (said once: the ids must be the gateway's own).

Everything is bounded: the children (``processes``), the threads waiting for one, the bytes of
a call (``MAX_TEXT_BYTES``; frames ``wire.MAX_PAYLOAD``), a call's time (``CALL_BASE_S`` plus
``CALL_S_PER_MIB`` a MiB). ``close`` ends every child within its bound: an idle one gets the end
of its stdin and exits, a busy one is killed (its caller tokenizes itself), any left at the
bound is killed. A child also ends by itself when the gateway's process ends however it ends,
since its stdin then ends.

Why not ``concurrent.futures.ProcessPoolExecutor`` (or ``multiprocessing.Pool``): a call here
has its own deadline, and one hung or dead child must be killed and replaced without breaking
the others' calls (a broken executor fails every pending future and must be rebuilt); the
children run niced; texts and ids cross as bytes in frames rather than pickles; and the result
is read by the calling thread itself, not by a result-handler thread competing for the
interpreter lock with the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import structlog

from prefixgate.gateway.tokenpool import kvcolumns, wire

log = structlog.get_logger("prefixgate.tokenpool")
T = TypeVar("T")

#: The children's niceness above the gateway's: when the cores are short the event loop, the
#: small requests and the nodes' own work run first, and a long prompt's tokenization waits.
NICE = 10
WAIT_S = 2.0  # a thread waits this long for a busy child, then tokenizes itself
MAX_WAITING = 8  # threads waiting for a child at once; more tokenize themselves
CALL_BASE_S = 5.0  # a call's deadline: this, plus CALL_S_PER_MIB for each MiB of text
CALL_S_PER_MIB = 1.0
MAX_TEXT_BYTES = 64 << 20  # a call's texts, UTF-8; more is tokenized by the caller
STOP_S = 1.0  # a stopped or killed child is waited for this long
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
PIPE_BYTES = 1 << 20  # each pipe's buffer, where the system allows: a long prompt in a write or two
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), named in the fcntl module from Python 3.10 on Linux only
_MIB = 1 << 20


class ChildFailed(Exception):
    """The child ended, hung or broke the format: it is not used again."""


class ChildRefused(Exception):
    """The child answered that it could not tokenize the texts (it stays in use)."""


def on_event_loop() -> bool:
    """Whether the calling thread runs an event loop (which must never wait for a child)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Child:
    """One tokenizer process and the two pipes to it (non-blocking on this side)."""

    def __init__(self, directory: Path, nice: int, fast: bool = False) -> None:
        argv = [sys.executable, "-m", "prefixgate.gateway.tokenpool.child", str(directory), str(nice)]
        if fast:  # the gateway encodes with tiktoken (``cachetier.fastbpe``): the child does too
            argv.append("fast")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin: IO[bytes] = self.proc.stdin
        self._stdout: IO[bytes] = self.proc.stdout
        self.wfd, self.rfd = self._stdin.fileno(), self._stdout.fileno()
        for fd in (self.wfd, self.rfd):
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        self.digest = ""  # the sha256 of the tokenizer.json it loaded, once it said READY
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        return bool(self.digest)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait(self, fd: int, events: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChildFailed("no answer within the call's deadline")
        poller = select.poll()
        poller.register(fd, events)
        poller.poll(max(1, int(left * 1000)))

    def _read(self, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = os.readv(self.rfd, [view[got:]])
            except BlockingIOError:
                self._wait(self.rfd, select.POLLIN, deadline)
                continue
            except OSError as e:
                raise ChildFailed(f"reading: {e!r}") from e
            if k == 0:
                raise ChildFailed("its output ended")
            got += k
        return buf

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.wfd, view) :]
            except BlockingIOError:
                self._wait(self.wfd, select.POLLOUT, deadline)
            except OSError as e:  # BrokenPipeError: it is gone
                raise ChildFailed(f"writing: {e!r}") from e

    def _receive(self, allowed: frozenset[int], deadline: float) -> tuple[int, list[bytes]]:
        try:
            kind, size = wire.header(bytes(self._read(wire.HEADER.size, deadline)), allowed)
            return kind, wire.split(bytes(self._read(size, deadline)))
        except wire.BadFrame as e:
            raise ChildFailed(str(e)) from e

    def poll_ready(self) -> bool:
        """Whether it said READY (read without waiting when it has; ``ChildFailed`` if it died)."""
        if self.ready:
            return True
        poller = select.poll()
        poller.register(self.rfd, select.POLLIN)
        if not poller.poll(0):
            return False
        _, parts = self._receive(frozenset({wire.READY}), time.monotonic() + STOP_S)
        if len(parts) != 1 or not parts[0]:
            raise ChildFailed("a READY without the tokenizer's digest")
        self.digest = parts[0].decode("ascii", "replace")
        return True

    def call(self, kind: int, parts: Sequence[bytes], deadline: float) -> list[bytes]:
        """Its answer to a frame of ``kind`` (``wire.ANSWERS``)."""
        self._write(wire.frame(kind, parts), deadline)
        got, answer = self._receive(frozenset({wire.ANSWERS[kind], wire.FAILED}), deadline)
        if got == wire.FAILED:
            raise ChildRefused(answer[0].decode("utf-8", "replace") if answer else "")
        return answer

    def end_input(self) -> None:
        """Close its stdin: an idle child exits."""
        with contextlib.suppress(OSError):
            self._stdin.close()

    def stop(self, timeout: float, *, kill: bool) -> None:
        """Wait for it to end (killed first when ``kill``, or when it is not gone within
        ``timeout``), then close this side of the pipes. Called by one thread per child."""
        if kill:
            with contextlib.suppress(OSError):
                self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_S)
        self.end_input()
        with contextlib.suppress(OSError):
            self._stdout.close()


@dataclass(slots=True)
class PoolStats:
    calls: int = 0  # answered by a child
    local: int = 0  # left to the caller (no child ready or free, or one failed)
    started: int = 0  # children started
    failed: int = 0  # children that died, hung or broke the format (each replaced)


class TokenizerPool:
    """Up to ``processes`` tokenizer children for the tokenizer in ``directory`` whose
    ``tokenizer.json`` has the sha256 ``digest`` (see the module docstring)."""

    def __init__(
        self, directory: str | Path, digest: str, processes: int, *, nice: int = NICE, fast: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.fast = fast
        self.digest = digest
        self.processes = max(0, processes)
        self.nice = nice
        self.stats = PoolStats()
        self._cond = threading.Condition()
        self._idle: list[Child] = []
        self._starting: list[Child] = []
        self._busy: set[Child] = set()
        self._waiting = 0
        self._closed = False
        self._disabled = False
        self._backoff = 0.0
        self._next_start = 0.0

    def __repr__(self) -> str:
        return f"TokenizerPool({self.directory}, processes={self.processes})"

    @property
    def pids(self) -> list[int]:
        """The children alive now (busy, idle or starting)."""
        with self._cond:
            return [c.pid for c in (*self._idle, *self._starting, *self._busy)]

    def start(self, wait_s: float = 0.0) -> bool:
        """Start the children now instead of at the first long text, and wait up to ``wait_s``
        for all of them to say READY (benchmarks and tests measure the pool warm); whether they
        all did. Not from the event loop when ``wait_s`` > 0."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._cond:
                if self._closed or self._disabled:
                    return False
                self._settle()
                if len(self._idle) + len(self._busy) >= self.processes:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- the callers' side -----------------------------------------------------------------------

    def encode_many(self, texts: Sequence[str]) -> list[bytes] | None:
        """Each text's packed ids, or None: the caller tokenizes them itself."""
        if not texts:
            return None
        try:
            data = [t.encode("utf-8") for t in texts]
        except UnicodeEncodeError:  # lone surrogates: the caller's tokenizer says what it says
            return None

        def ids(parts: list[bytes]) -> list[bytes]:
            if len(parts) != len(texts) or any(len(p) % 4 for p in parts):
                raise ValueError(f"{len(parts)} answers to {len(texts)} texts")
            return parts

        return self._call(wire.ENCODE, data, ids)

    def kv_batch(self, raw: bytes) -> kvcolumns.Batch | None:
        """An SMG ``KvEventBatch`` 's bytes in columns, or None: the caller reads it itself."""
        return self._call(wire.KV_BATCH, [raw], kvcolumns.from_parts)

    def _call(self, kind: int, parts: list[bytes], read: Callable[[list[bytes]], T]) -> T | None:
        """A child's answer to one frame, as ``read`` reads it (a ``ValueError``: the answer is
        not one, and the child is not trusted again), or None (see the module docstring)."""
        size = sum(len(p) for p in parts)
        if self.processes == 0 or on_event_loop() or size > MAX_TEXT_BYTES:
            return None
        child = self._checkout()
        if child is None:
            self.stats.local += 1
            return None
        deadline = time.monotonic() + CALL_BASE_S + CALL_S_PER_MIB * size / _MIB
        try:
            out = read(child.call(kind, parts, deadline))
        except ChildRefused as e:
            self._checkin(child)
            self.stats.local += 1
            log.warning("tokenizer_process_refused", pid=child.pid, error=str(e)[:200])
            return None
        except (ChildFailed, ValueError) as e:
            self._discard(child, str(e))
            self.stats.local += 1
            return None
        self._checkin(child)
        self.stats.calls += 1
        return out

    def _checkout(self) -> Child | None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            if self._waiting >= MAX_WAITING:
                return None
            self._waiting += 1
            try:
                while not (self._closed or self._disabled):
                    self._settle()
                    if self._idle:
                        child = self._idle.pop()
                        self._busy.add(child)
                        return child
                    if self._starting or len(self._busy) < self.processes:
                        return None  # one is starting (or cannot start yet): not waited for
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
                return None
            finally:
                self._waiting -= 1

    def _checkin(self, child: Child) -> None:
        with self._cond:
            self._busy.discard(child)
            if self._closed:
                closing = True
            else:
                closing = False
                self._idle.append(child)
                self._cond.notify()
        if closing:
            child.end_input()
            child.stop(STOP_S, kill=False)

    # -- children's lives (under the lock) -------------------------------------------------------

    def _settle(self) -> None:
        """Idle children checked alive, starting ones that said READY made idle, and children
        started up to ``processes``."""
        for child in [c for c in self._idle if not c.alive()]:
            self._idle.remove(child)
            self._lost(child, "it exited")
        for child in list(self._starting):
            try:
                if not child.poll_ready():
                    continue
            except ChildFailed as e:
                self._starting.remove(child)
                self._lost(child, f"while starting: {e}")
                continue
            self._starting.remove(child)
            if child.digest != self.digest:
                self._disable(child)
                return
            self._backoff = 0.0
            self._idle.append(child)
        now = time.monotonic()
        while self._count() < self.processes and now >= self._next_start:
            try:
                child = Child(self.directory, self.nice, self.fast)
            except OSError as e:
                self._failed_start(f"cannot start: {e!r}")
                return
            self.stats.started += 1
            self._starting.append(child)

    def _count(self) -> int:
        return len(self._idle) + len(self._starting) + len(self._busy)

    def _failed_start(self, reason: str) -> None:
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self._backoff))
        self._next_start = time.monotonic() + self._backoff
        log.warning("tokenizer_process_start_failed", reason=reason[:200], retry_in_s=self._backoff)

    def _lost(self, child: Child, reason: str) -> None:
        """A child that died or failed (already out of every list): stopped, and a replacement
        started at once (after a backoff when it never got ready)."""
        child.stop(STOP_S, kill=True)
        if self._closed:  # killed by ``close`` under its caller
            return
        self.stats.failed += 1
        log.warning("tokenizer_process_failed", pid=child.pid, reason=reason[:200])
        if not child.ready:
            self._failed_start(reason)

    def _disable(self, child: Child) -> None:
        self._disabled = True
        log.warning(
            "tokenizer_processes_disabled",
            reason="a child loaded another tokenizer.json than the gateway's",
            expected=self.digest[:16],
            loaded=child.digest[:16],
        )
        children = [child, *self._idle, *self._starting]
        self._idle.clear()
        self._starting.clear()
        for c in children:
            c.stop(STOP_S, kill=True)
        self._cond.notify_all()

    def _discard(self, child: Child, reason: str) -> None:
        with self._cond:
            self._busy.discard(child)
            self._lost(child, reason)
            if not (self._closed or self._disabled):
                self._settle()  # the replacement starts now, ready for the next long prompt
            self._cond.notify()

    # -- the end ---------------------------------------------------------------------------------

    def close(self, timeout: float = 2.0) -> None:
        """End every child within ``timeout`` (see the module docstring); callers after this
        tokenize themselves."""
        with self._cond:
            self._closed = True
            quiet = [*self._idle, *self._starting]
            busy = list(self._busy)
            self._idle.clear()
            self._starting.clear()
            self._cond.notify_all()
        for child in quiet:
            child.end_input()
        for child in busy:  # its caller sees the end, discards it and tokenizes itself
            with contextlib.suppress(OSError):
                child.proc.kill()
        deadline = time.monotonic() + timeout
        for child in quiet:
            child.stop(max(0.0, deadline - time.monotonic()), kill=False)

    async def aclose(self, timeout: float = 2.0) -> None:
        await asyncio.to_thread(self.close, timeout)
