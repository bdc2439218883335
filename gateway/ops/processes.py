"""Child processes on loopback: our nodes, gateways, peer routers; started, awaited, stopped.

One launcher for ``prefixgate up``, the benchmarks and the tests, so every child is treated the
same way:

- it runs in its own session (process group), so a stop reaches whatever it forked (a router's
  workers) and a Ctrl-C on the terminal goes to the parent, which then stops it in order;
- it gets SIGTERM when the process that started it dies, even by SIGKILL (Linux
  ``PR_SET_PDEATHSIG``): no node outlives a killed test run or benchmark. The kernel sends that
  signal when the *thread* that forked exits, so every child is forked by one thread kept for
  the life of the process (``_FORKER``): a child started from a short-lived thread (a pool
  that starts several at once) lives as long as its parent process, not as long as that thread;
- its stdout and stderr go, line by line, to a bounded buffer (and a log file when given), so a
  start that fails says why with the child's last lines, and tests can look for a log line;
- it is ready when a check passes before a deadline while it is alive: one loop for every kind,
  the check being what that kind offers. Our node prints its ready line once its ports are bound
  (``printed``; with ``--port 0`` no port is chosen in advance, so none can be taken meanwhile);
  a gateway answers ``/readyz`` (``answers_http``); a peer router's health endpoint says only
  that it is up, so it is ready once a chat through it is answered (``routes_chat``). A child
  that exits while awaited fails at once;
- it is stopped with SIGTERM to its group, a bounded wait, then SIGKILL (group and stragglers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

PR_SET_PDEATHSIG = 1
#: The one thread that forks every child, idle between starts and alive as long as the process.
_FORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forker")
LOG_LINES = 2000  # lines of output kept per child
POLL_S = 0.05

Check = Callable[["Child"], bool]


class StartFailed(RuntimeError):
    """A child exited or missed its readiness deadline; the message ends with its last lines."""


class Child:
    """A started process (leader of its own process group) and the lines it printed."""

    def __init__(self, name: str, proc: subprocess.Popen[str], log: Path | None, echo: bool) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.lines: deque[str] = deque(maxlen=LOG_LINES)
        # where it serves and what its clients send, once its starter knows
        self.url = ""  # HTTP base URL
        self.address = ""  # gRPC host:port
        self.headers: dict[str, str] = {}
        self._echo = echo
        self._reader = threading.Thread(target=self._read, name=f"output of {name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        sink: IO[str] | None = self.log.open("a") if self.log is not None else None
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if self._echo:
                    sys.stderr.write(line)
        finally:
            if sink is not None:
                sink.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(list(self.lines)[-lines:])

    def find(self, pattern: str) -> re.Match[str] | None:
        """The first line printed so far that matches ``pattern``."""
        rx = re.compile(pattern)
        for line in list(self.lines):
            m = rx.search(line)
            if m:
                return m
        return None

    def wait_until(self, check: Check, timeout: float, what: str = "ready") -> None:
        """Until ``check(self)`` holds; raises ``StartFailed`` if the child exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if check(self):
                return
            if not self.alive():
                self._reader.join(timeout=1)  # its last words
                raise StartFailed(
                    f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise StartFailed(f"{self.name} not {what} after {timeout:g} s:\n{self.tail()}")
            time.sleep(POLL_S)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first line matching ``pattern``, waiting for it up to ``timeout`` s."""
        self.wait_until(printed(pattern), timeout, f"printing {pattern!r}")
        m = self.find(pattern)
        assert m is not None
        return m

    def send_signal(self, sig: int) -> None:
        """``sig`` to the child alone (not its group): SIGSTOP/SIGUSR1 drills target one process."""
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """``sig`` to the group, up to ``timeout`` s for it to exit, then SIGKILL; the exit code."""
        stop_all([self], sig, timeout)
        return self.proc.returncode


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_all(children: Iterable[Child], sig: int = signal.SIGTERM, grace: float = 10.0) -> dict[str, int]:
    """Signal every child's group at once, wait up to ``grace`` s in all, SIGKILL what is left;
    the exit codes by name."""
    group = list(children)
    for c in group:
        if c.alive():
            _killpg(c.pid, sig)
    deadline = time.monotonic() + grace
    codes: dict[str, int] = {}
    for c in group:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(c.pid, signal.SIGKILL)
            c.proc.wait(timeout=10)
        _killpg(c.pid, signal.SIGKILL)  # stragglers of the group (a router's workers)
        c._reader.join(timeout=5)
        if c.proc.stdout is not None:
            c.proc.stdout.close()
        codes[c.name] = c.proc.returncode
    return codes


def wait_all(children: Sequence[Child], check: Check, timeout: float) -> None:
    """Until ``check`` holds for every child (started together, so they get ready together),
    within one deadline; on failure every one of them is stopped."""
    deadline = time.monotonic() + timeout
    try:
        for c in children:
            c.wait_until(check, max(0.0, deadline - time.monotonic()))
    except BaseException:
        stop_all(children, grace=5.0)
        raise


def parent_death_signal() -> Callable[[], None]:
    """For a child between fork and exec: SIGTERM to it when its parent is gone (Linux's
    ``PR_SET_PDEATHSIG``; nothing elsewhere). ``prctl`` is looked up here, in the parent: a forked
    child of a process with threads must not import or load a library before exec (the loader's
    lock may have been held by another thread at the fork, and is never released in the child)."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return lambda: None

    def set_signal() -> None:  # pragma: no cover - runs in the child
        with contextlib.suppress(Exception):
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_signal


def _child_setup(open_files: int) -> Callable[[], None]:
    die_with_parent = parent_death_signal()

    def setup() -> None:  # pragma: no cover - runs in the child
        die_with_parent()
        if open_files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    return setup


def start(
    name: str,
    cmd: Sequence[str],
    *,
    ready: Check | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    inherit_env: bool = True,
    cwd: Path | None = None,
    log: Path | None = None,
    echo: bool = False,
    open_files: int = 0,
) -> Child:
    """Start ``cmd``; with ``ready``, return once it holds (else stop the child and raise).

    ``env`` is laid over this process's environment (``inherit_env``) or is the whole of it;
    ``log`` also writes the output to a file; ``echo`` copies it to this process's stderr;
    ``open_files`` > 0 lowers the child's RLIMIT_NOFILE from its first instruction.
    """
    popen = functools.partial(
        subprocess.Popen,
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**(os.environ if inherit_env else {}), "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_child_setup(open_files),
    )
    proc: subprocess.Popen[str] = _FORKER.submit(popen).result()
    child = Child(name, proc, log, echo)
    if ready is not None:
        try:
            child.wait_until(ready, timeout)
        except BaseException:
            child.stop(timeout=5.0)
            raise
    return child


def prefixgate(*args: str) -> list[str]:
    """The command line of ``prefixgate ARGS`` under this interpreter."""
    return [sys.executable, "-m", "prefixgate.cli", *args]


# -- readiness checks -----------------------------------------------------------------------------

NODE_READY = r'^\{"event": "node_ready".*\}$'


def printed(pattern: str) -> Check:
    """Ready once the child has printed a line matching ``pattern``."""
    return lambda child: child.find(pattern) is not None


def node_ready_line(child: Child) -> dict[str, Any]:
    """Our node's ready line (``--ready-line``): its addresses, as bound."""
    m = child.find(NODE_READY)
    if m is None:
        raise StartFailed(f"{child.name} printed no ready line:\n{child.tail()}")
    line: dict[str, Any] = json.loads(m.group(0))
    return line


def answers_http(url: str, accept: Callable[[Any], bool] | None = None) -> Check:
    """Ready once GET ``url`` answers 200 (and ``accept(response)``, when given)."""
    import httpx

    def check(_child: Child) -> bool:
        try:
            r = httpx.get(url, timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and (accept is None or accept(r))

    return check


def routes_chat(base: str, model: str, headers: Mapping[str, str] | None = None) -> Check:
    """Ready once a one-token chat through the router at ``base`` is answered: it is up and
    has a worker to send it to (a router's own health endpoint says only the former)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}

    def check(_child: Child) -> bool:
        try:
            r = httpx.post(
                f"{base}/v1/chat/completions",
                json=body,
                headers=dict(headers or {}),
                timeout=10,
                trust_env=False,
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    return check
