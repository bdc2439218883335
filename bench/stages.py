"""Where a router's CPU goes, by stage of the request path: a sampling profile read back by stage.

``Sampler`` runs ``py-spy record --format raw`` against a process for as long as a block runs
(non-blocking: the target is never paused) and reads its threads' CPU time from /proc before and
after. ``breakdown`` reads the collapsed stacks and charges each sample to one stage: the stage
of the innermost frame that belongs to prefixgate or to a library with a known role (HTTP server,
JSON, gRPC, metrics, logging...), skipping the generic frames (asyncio, contextlib, functools)
that any stage passes through. A main-thread sample whose stack has no such frame is native work
under the loop. Shares are of the main (event loop) thread's samples; other Python threads (gRPC's
completion-queue poller) are counted apart.

What a Python sampler cannot see is native threads: gRPC's C-core threads poll and write the
node channel's sockets; ``thread_cpu`` gives their share from /proc, by thread name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
MAIN = "main"  # the process's first thread: the event loop's

#: (stage, fragment) rules, the first match wins. A fragment is found in one frame ``function
#: (file:line)`` of py-spy's raw output; ``func|file`` needs that function in that file.
RULES: tuple[tuple[str, str], ...] = (
    ("logging", "structlog/"),
    ("logging", "gateway/logging.py"),
    ("logging", "/logging/__init__.py"),
    ("metrics", "prometheus_client/"),
    ("metrics", "gateway/metrics.py"),
    ("tokenization", "cachetier/tokenizer.py"),
    ("tokenization", "gateway/tokens/"),
    ("tokenization", "tokenizers/"),
    ("tokenization", "backends/hftok/"),
    ("hashing", "cachetier/hashing.py"),
    ("index lookup", "cachetier/"),
    ("routing", "gateway/routing/"),
    ("routing", "gateway/cluster/nodes.py"),
    ("normalization", "openai/normalize.py"),
    ("validation", "openai/schema.py"),
    ("validation", "gateway/core/bodyparse.py"),
    ("validation", "pydantic"),
    ("validation", "msgspec"),
    ("engine client", "gateway/nodeclient/"),
    ("engine client", "grpc/"),
    ("engine client", "google/protobuf"),
    ("engine client", "prefixgate/v1/"),
    ("response framing", "_stream|gateway/httpfront/app.py"),
    ("response framing", "_sse|gateway/httpfront/app.py"),
    ("response framing", "_complete|gateway/httpfront/app.py"),
    ("response framing", "stream|gateway/core/choices.py"),
    ("response framing", "_stream|gateway/httpfront/hotroutes.py"),
    ("response framing", "_complete|gateway/httpfront/hotroutes.py"),
    ("pipeline", "gateway/core/pipeline.py"),
    ("pipeline", "gateway/core/request.py"),
    ("pipeline", "gateway/core/prepare.py"),
    ("pipeline", "gateway/core/admission.py"),
    ("pipeline", "gateway/core/plan.py"),
    ("pipeline", "gateway/core/execute.py"),
    ("pipeline", "gateway/core/execution.py"),
    ("pipeline", "gateway/core/accounting.py"),
    ("runner", "gateway/core/runner.py"),
    ("HTTP front", "gateway/httpfront/app.py"),
    ("HTTP front", "gateway/httpfront/common.py"),
    ("HTTP front", "gateway/httpfront/guard.py"),
    ("HTTP front", "gateway/httpfront/hotroutes.py"),
    ("HTTP parsing", "gateway/httpfront/connections.py"),
    ("HTTP parsing", "uvicorn/"),
    ("HTTP parsing", "httptools"),
    ("HTTP parsing", "h11/"),
    ("HTTP front", "starlette/"),
    ("HTTP front", "anyio/"),
    ("auth", "gateway/core/auth.py"),
)
#: Frames any stage passes through: skipped when looking for the innermost meaningful one.
GENERIC = (
    "/asyncio/",
    "contextlib.py",
    "functools.py",
    "typing.py",
    "abc.py",
    "enum.py",
    "dataclasses.py",
    "<frozen",
    "uuid.py",
    "/json/",
    "weakref",
    "threading.py",
    "selectors.py",
    "uvloop/",
    "copy.py",
    "/re/",
    "_weakrefset.py",
)
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


#: A main-thread sample with no meaningful Python frame: the loop's own C code, i.e. uvloop,
#: socket reads and writes, and gRPC's Cython callbacks (which show no Python frame).
NATIVE = "native under the loop"
#: A sample of a Python thread other than the event loop's (executor or gRPC helper threads).
OTHER_THREAD = "other Python threads"


def classify(stack: Sequence[str]) -> str:
    """The stage of one sampled stack (root first, as py-spy writes it)."""
    if stack and "threading.py" in stack[0]:
        return OTHER_THREAD
    for frame in reversed(stack):
        if any(g in frame for g in GENERIC):
            continue
        for stage, fragment in RULES:
            func, bar, file = fragment.partition("|")
            if (frame.startswith(func + " (") and file in frame) if bar else fragment in frame:
                return stage
    return NATIVE


def read_raw(path: Path) -> Iterator[tuple[list[str], int]]:
    """(stack, samples) pairs of a py-spy ``--format raw`` file."""
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def breakdown(path: Path) -> dict[str, Any]:
    """Samples per stage, with each stage's share and its hottest leaf frames."""
    stages: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    total = 0  # main-thread samples
    for stack, n in read_raw(path):
        if stack and stack[0].startswith(("process ", "thread ")):
            stack = [f for f in stack if not f.startswith(("process ", "thread "))]
        stage = classify(stack)
        stages[stage] += n
        total += n if stage != OTHER_THREAD else 0
        leaf = _FRAME.sub(lambda m: f"{m['func']} ({_short(m['file'])})", stack[-1]) if stack else "?"
        leaves.setdefault(stage, Counter())[leaf] += n
    return {
        "samples": total,
        "stages": {
            s: {
                "samples": n,
                "share": round(n / total, 4) if total and s != OTHER_THREAD else 0.0,
                "top": [{"frame": f, "samples": c} for f, c in leaves[s].most_common(5)],
            }
            for s, n in stages.most_common()
        },
    }


def _short(file: str) -> str:
    for marker in ("site-packages/", "/prefixgate/", "/lib/python"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) per thread name of a process, summed over same-named threads."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = MAIN if tid == str(pid) else text[text.find("(") + 1 : text.rfind(")")]
            fields = text[text.rfind(")") + 2 :].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def py_spy() -> str | None:
    """The py-spy executable: next to this interpreter (a dev install), else on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


@dataclass
class Sampler:
    """py-spy on ``pid`` while the block runs, plus the per-thread CPU it took meanwhile."""

    pid: int
    out: Path
    rate: int = 500
    threads_cpu: dict[str, float] = field(default_factory=dict)
    error: str = ""
    _proc: subprocess.Popen[bytes] | None = None
    _cpu0: dict[str, float] = field(default_factory=dict)

    def __enter__(self) -> Sampler:
        exe = py_spy()
        self._cpu0 = thread_cpu(self.pid)
        if exe is None:
            self.error = "py-spy not installed (pip install -e '.[dev]')"
            return self
        self.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "record", "--pid", str(self.pid), "--format", "raw", "--rate", str(self.rate)]
        self._proc = subprocess.Popen(
            [*cmd, "--nonblocking", "--output", str(self.out)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.3)  # attached before the first request
        return self

    def __exit__(self, *exc: object) -> None:
        cpu1 = thread_cpu(self.pid)
        self.threads_cpu = {k: round(v - self._cpu0.get(k, 0.0), 3) for k, v in cpu1.items()}
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = self._proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate(timeout=5)
        if not self.out.exists():
            self.error = (err or b"").decode(errors="replace").strip()[-300:] or "py-spy wrote nothing"

    def report(self, requests: int) -> dict[str, Any]:
        """The stage breakdown, with each stage's CPU per request (samples scaled to the main
        thread's measured CPU) and the native threads' CPU per request."""
        out: dict[str, Any] = {"requests": requests, "threads_cpu_s": self.threads_cpu, "error": self.error}
        if self.error or not self.out.exists():
            return out
        b = breakdown(self.out)
        py_ms = self.threads_cpu.get(MAIN, 0.0) * 1e3 / max(1, requests)
        for st in b["stages"].values():
            st["ms_per_req"] = round(st["share"] * py_ms, 4)
        out.update(b)
        out["cpu_ms_per_req_by_thread"] = {
            k: round(v * 1e3 / max(1, requests), 4) for k, v in sorted(self.threads_cpu.items()) if v
        }
        return out
