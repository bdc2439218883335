"""A KV event publisher that misbehaves, on the engines' ZMQ wire, for the subscriber's bounds.

``HostilePublisher`` speaks the engines' protocol (PUB ``[topic, seq BE64, payload]``, ROUTER
replay ``[b"", start]`` -> ``[b"", seq, payload]``... then seq ``2**64-1``) and can break it the
ways a faulty or hostile engine would: raw payloads that are not event batches, frames of any
size or count, a flood at the speed one thread can send, a replay that trickles. ``LagProbe``
measures how late the event loop runs a timer (what every other task of the gateway sees).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

END = (2**64 - 1).to_bytes(8, "big")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class HostilePublisher:
    """PUB + ROUTER replay; ``history`` is what the replay buffer holds before anything is sent
    (seq 0...), ``replay_delay_s`` the pause before each replayed frame (a trickling replay)."""

    def __init__(
        self,
        topic: bytes = b"kv",
        history: Sequence[bytes] = (),
        replay_delay_s: float = 0.0,
        buffer: int = 10_000,
    ) -> None:
        self.topic = topic
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_delay_s = replay_delay_s
        self.buffer_size = buffer
        self.history: list[tuple[int, bytes]] = list(enumerate(history))
        self.seq = len(self.history)
        self.replay_requests: list[int] = []
        self.replay_times: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replayer = threading.Thread(target=self._serve_replays, daemon=True)
        self._replayer.start()

    # -- live --------------------------------------------------------------------------------

    def send(self, payload: bytes, deliver: bool = True) -> int:
        """One batch (kept for replays); ``deliver=False`` only buffers it (a gap). Its seq."""
        with self._lock:
            s, self.seq = self.seq, self.seq + 1
            self.history.append((s, payload))
            del self.history[: -self.buffer_size]
        if deliver:
            self.pub.send_multipart([self.topic, s.to_bytes(8, "big"), payload], copy=False)
        return s

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """A raw multipart message, not numbered, not buffered."""
        self.pub.send_multipart(list(frames), copy=False)

    def flood(self, payloads: Sequence[bytes], seconds: float, at_least: int = 0) -> Callable[[], int]:
        """Send ``payloads`` round and round, as fast as one thread can, for ``seconds`` and until
        ``at_least`` are sent (on a busy machine one thread sends fewer a second), at most three
        times ``seconds`` (not buffered for replays: far more than any engine keeps). Returns
        ``join() -> count``."""
        sent = [0]

        def run() -> None:
            start = time.monotonic()
            n = len(payloads)
            i = 0
            while not self._stop.is_set():
                if i % 256 == 0:
                    elapsed = time.monotonic() - start
                    if (elapsed >= seconds and i >= at_least) or elapsed >= 3 * seconds:
                        break
                with self._lock:
                    s, self.seq = self.seq, self.seq + 1
                self.pub.send_multipart([self.topic, s.to_bytes(8, "big"), payloads[i % n]], copy=False)
                i += 1
            sent[0] = i

        t = threading.Thread(target=run, daemon=True)
        t.start()

        def join() -> int:
            t.join(seconds + 10)
            return sent[0]

        return join

    # -- replay ------------------------------------------------------------------------------

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(10):
                continue
            ident, _, start = self.router.recv_multipart()
            s0 = int.from_bytes(start, "big")
            self.replay_requests.append(s0)
            self.replay_times.append(time.monotonic())
            with self._lock:
                todo = [(s, p) for s, p in self.history if s >= s0]
            for s, payload in todo:
                if self.replay_delay_s and self._stop.wait(self.replay_delay_s):
                    return
                self.router.send_multipart([ident, b"", s.to_bytes(8, "big"), payload], copy=False)
            self.router.send_multipart([ident, b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._replayer.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


class LagProbe:
    """Wakes every ``tick_s`` and records how late: ``lags`` by the wall clock (what other tasks
    see), ``held`` in CPU time of the event loop's thread (the CPU it spent over the interval,
    less the tick: the work that made the probe late; unlike the wall clock it does not grow
    when other processes take the machine's cores). ``sample`` (optional) is called at each
    wake (e.g. to follow RSS)."""

    def __init__(self, tick_s: float = 0.005, sample: Callable[[], Any] | None = None) -> None:
        self.tick_s = tick_s
        self.lags: list[float] = []
        self.held: list[float] = []
        self.sample = sample
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(self.tick_s)
            self.lags.append(loop.time() - t - self.tick_s)
            self.held.append(max(0.0, time.thread_time() - cpu - self.tick_s))
            if self.sample is not None:
                self.sample()

    def start(self) -> LagProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def max(self) -> float:
        """The longest the loop was held by work past a tick, in CPU seconds."""
        return max(self.held, default=0.0)

    def report(self) -> str:
        lags = sorted(self.lags) or [0.0]
        return (
            f"held at most {self.max * 1000:.0f} ms of CPU past a tick; wall lag p50 "
            f"{lags[len(lags) // 2] * 1000:.0f} ms, max {lags[-1] * 1000:.0f} ms over {len(lags)} ticks"
        )


class RssPeak:
    """The highest RSS of this process, sampled from a thread every ``every_s`` (a loop that is
    held cannot sample itself)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        """Growth over the base, in bytes."""
        self._stop.set()
        self._thread.join(2)
        self.peak = max(self.peak, rss_bytes())
        return self.peak - self.base
