"""Shared helpers for tests that run real processes on loopback."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prefixgate.gateway.ops.stack import free_port as free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A child process whose output is collected in the background (bounded)."""

    proc: subprocess.Popen[str]
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=2000))
    _reader: threading.Thread | None = None

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = "\n".join(list(self.lines)[-40:])
        raise TimeoutError(f"{pattern!r} not seen (exit={self.proc.poll()}); output:\n{tail}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self.proc.returncode


def spawn(args: list[str], env: dict[str, str] | None = None, open_files: int = 0) -> Proc:
    """``prefixgate ARGS`` as a child; ``open_files`` > 0 lowers its RLIMIT_NOFILE from the start."""

    def limit_files() -> None:  # pragma: no cover - runs in the child
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFIXGATE_LOG_FORMAT": "json", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixgate.cli", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=limit_files if open_files else None,
    )
    p = Proc(proc)
    p.start_reader()
    return p


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def document(seed: int, tokens: int) -> str:
    """Deterministic prose of about ``tokens`` tokens (the bytes4 tokenizer: 4 bytes a token)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def wait_answered(base: str, proc: Proc, model: str, *, timeout: float = 60.0, interval: float = 0.3) -> None:
    """Until a one-token chat through the gateway or router at ``base`` is answered (it is up and
    routes to a worker), or raise with the tail of its output (it exited or never routed)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.proc.poll() is None:
        try:
            if httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    tail = "\n".join(list(proc.lines)[-30:])
    raise TimeoutError(f"{base} never routed a request (exit={proc.proc.poll()}):\n{tail}")
