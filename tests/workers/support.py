"""A ``prefixgate gateway --workers N`` under test: its log lines, chats on connections of their
own, and connections to the worker a test wants (the kernel picks who accepts each)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import redis

from prefixgate.gateway.ops.processes import Child

#: Fresh connections tried to reach a given worker.
MAX_TRIES = 60


class Gateway:
    def __init__(self, proc: Child, base: str, model: str = "prefixgate-sim") -> None:
        self.proc = proc
        self.base = base
        self.model = model

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.proc.lines):
            if f'"event":"{name}"' in line.replace(" ", ""):
                out.append(json.loads(line))
        return out

    def served(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The request's log line (it names the worker that served it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events("request"):
                if e.get("request_id") == request_id:
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no request line for {request_id}:\n{self.proc.tail()}")

    def metric(self, pattern: str) -> float:
        """The sum of the series matching ``pattern`` (a regex of the line before its value)."""
        text = httpx.get(self.base + "/metrics", timeout=10, trust_env=False).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{pattern} (\S+)$", text, re.M))

    def chat_on(self, client: httpx.Client, text: str, question: str, max_tokens: int = 1) -> dict[str, Any]:
        """One chat on ``client``'s connection; its request line."""
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": question}],
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return self.served(r.headers["x-prefixgate-request-id"])

    def chat(self, text: str, question: str) -> dict[str, Any]:
        """One chat on a connection of its own; its request line."""
        with httpx.Client(base_url=self.base, timeout=30, trust_env=False) as c:
            c.headers["connection"] = "close"
            return self.chat_on(c, text, question)

    def connect_to(self, worker: int | None = None, *, avoid: int | None = None) -> tuple[httpx.Client, int]:
        """A keep-alive connection to ``worker`` (or to any worker but ``avoid``), and its
        worker: fresh connections until the kernel gives one to it, told by a chat too short
        to hold a block (so no index learns anything from it)."""
        for i in range(MAX_TRIES):
            client = httpx.Client(base_url=self.base, timeout=30, trust_env=False)
            w = int(self.chat_on(client, "hi", f"probe {i}")["worker"])
            if (worker is None or w == worker) and w != avoid:
                return client, w
            client.close()
        raise AssertionError(f"none of {MAX_TRIES} connections went to worker {worker} (avoiding {avoid})")

    @contextlib.contextmanager
    def two_workers(self) -> Iterator[tuple[httpx.Client, httpx.Client]]:
        """Keep-alive connections to two different workers, closed afterwards."""
        here, first = self.connect_to()
        try:
            there, _ = self.connect_to(avoid=first)
        except BaseException:
            here.close()
            raise
        try:
            yield here, there
        finally:
            here.close()
            there.close()

    def served_through_both(self, text: str, wait_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request lines of ``text`` asked through one worker, then, ``wait_s`` later, through
        another; the first must have been cold."""
        with self.two_workers() as (here, there):
            first = self.chat_on(here, text, "question 0")
            assert first["predicted_cached_tokens"] == 0  # cold
            time.sleep(wait_s)
            other = self.chat_on(there, text, "question 1")
        assert other["worker"] != first["worker"]
        return first, other

    def kill_worker(self, index: int, timeout: float = 60.0) -> None:
        """SIGKILL worker ``index``; back once its replacement serves."""
        import os

        pid = next(int(e["pid"]) for e in reversed(self.events("worker_started")) if e["worker"] == index)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e["worker"] == index and e["pid"] != pid for e in self.events("worker_ready")):
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {index} was not replaced:\n{self.proc.tail()}")

    def store(self) -> redis.Redis:
        """A client of the workers' embedded store."""
        line = self.proc.wait_for(r'^\{.*"event": ?"embedded_store_started".*\}$').group(0)
        return redis.Redis(unix_socket_path=json.loads(line)["socket"])


class Monitor:
    """Every command the store runs while it is open (``MONITOR``), by name."""

    def __init__(self, store: redis.Redis) -> None:
        self.monitor = store.monitor()  # type: ignore[no-untyped-call]
        self.commands: list[list[str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> Monitor:
        self.monitor.__enter__()
        self._thread.start()
        return self

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                cmd = self.monitor.next_command()
            except (redis.ConnectionError, OSError, ValueError):
                return
            self.commands.append(str(cmd["command"]).split())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.monitor.connection.disconnect()
        self._thread.join(5)

    def names(self) -> Counter[str]:
        return Counter(c[0].upper() for c in self.commands if c)
