"""``prefixgate bench lines``: where a request's Python goes, counted line by line.

``bench instructions`` counts what a request costs but not which Python function spent it; a
sampling profiler (py-spy) says so roughly, and ``cProfile`` inflates whatever calls small
functions most. This counts the Python lines each function executes a request, its own and
inclusive (a line counts for every function on the stack when it runs, once each), with
``sys.settrace``: the same requests run the same lines, so two trees or two settings compare
line for line. It is blind to C (a line calling into orjson, a regular expression or grpcio
counts one line, however long it runs) and runs the gateway some fifty times slower, so what it
gives is counted, never timed. It also counts the dataclass values a request makes, by class.

The gateway runs under this module (``python -m prefixgate.bench.lines --trace-to FILE -- python
-m prefixgate.cli gateway ...``): SIGUSR1 starts the count on its event loop's thread (render
threads and tokenizer processes are not counted), SIGUSR2 writes it out. In front of one instant
node over ``http://`` or ``grpc://``, started with the worker flag alone, it is warmed up, then
``--requests`` 2 KB chats are sent one after the other between the two signals. What runs in the
background meanwhile (health probes, stats polls) is counted too, under its own functions, and
grows with the window: the tracing makes the window long.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import orjson

REQUESTS = 300
WARMUP = 200
PROMPT_BYTES = 2_048
TOP = 40
WRITE_WAIT_S = 30.0
INLINE_BUDGET_TRACED_MS = 1000.0  # the default 5 ms, times the tracing's slowdown and then some
_STDLIB = os.path.dirname(os.__file__) + os.sep


def where(code: CodeType) -> str:
    """A function as ``path:first line(qualified name)``, the path from its package down."""
    path = code.co_filename
    for cut in ("site-packages" + os.sep, "prefixgate" + os.sep):
        if cut in path:
            path = path.rsplit(cut, 1)[1]
            break
    else:
        path = path.removeprefix(_STDLIB)
    return f"{path}:{code.co_firstlineno}({code.co_qualname})"


@dataclass(slots=True)
class LineCounts:
    """Lines run per function (its own, and inclusive), its calls (a coroutine's resumptions
    included) and the dataclass values made, by class."""

    own: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    made: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"own": self.own, "inclusive": self.inclusive, "calls": self.calls, "made": self.made}
        )

    @classmethod
    def from_json(cls, raw: bytes) -> LineCounts:
        d = orjson.loads(raw)
        return cls(Counter(d["own"]), Counter(d["inclusive"]), Counter(d["calls"]), Counter(d["made"]))


class Tracer:
    """Counts the lines the calling thread runs between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.counts = LineCounts()
        self._names: dict[CodeType, str] = {}

    def _name(self, code: CodeType) -> str:
        name = self._names.get(code)
        if name is None:
            name = self._names[code] = where(code)
        return name

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        code = frame.f_code
        self.counts.calls[self._name(code)] += 1
        if code.co_name == "__init__" and code.co_filename == "<string>":  # a dataclass's
            made = frame.f_locals.get("self")
            if made is not None:
                kind = type(made)
                self.counts.made[f"{kind.__module__}.{kind.__qualname__}"] += 1
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            counts = self.counts
            counts.own[self._name(frame.f_code)] += 1
            seen: set[CodeType] = set()
            f: FrameType | None = frame
            while f is not None:  # every function on the stack, a recursive one once
                code = f.f_code
                if code not in seen:
                    seen.add(code)
                    counts.inclusive[self._name(code)] += 1
                f = f.f_back
        return self._line

    def start(self) -> None:
        self.counts = LineCounts()
        sys.settrace(self._call)

    def stop(self) -> LineCounts:
        sys.settrace(None)
        return self.counts


def traced(argv: Sequence[str]) -> int:
    """``--trace-to FILE -- PYTHON -m MODULE ARGS...``: run MODULE as ``python -m`` would, counting
    from SIGUSR1 and writing the count to FILE at SIGUSR2."""
    if len(argv) < 6 or argv[0] != "--trace-to" or argv[2] != "--" or argv[4] != "-m":
        print(
            "usage: python -m prefixgate.bench.lines --trace-to FILE -- PYTHON -m MODULE ...", file=sys.stderr
        )
        return 2
    out, module, rest = Path(argv[1]), argv[5], list(argv[6:])
    tracer = Tracer()

    def write(*_: object) -> None:
        counts = tracer.stop()
        tmp = out.with_suffix(".part")
        tmp.write_bytes(counts.to_json())
        tmp.replace(out)  # whole or not there

    signal.signal(signal.SIGUSR1, lambda *_: tracer.start())
    signal.signal(signal.SIGUSR2, write)
    sys.argv = [module, *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0


def render(counts: LineCounts, requests: int, top: int = TOP) -> list[str]:
    """The table: all the lines run a request, the ``top`` functions by inclusive lines a request,
    then the values made. Functions already running when the count began and not called since
    (the process's own ``main``, the event loop's ``run``) hold everything: they are left out."""
    n = max(1, requests)
    total = max(counts.inclusive.values(), default=0)
    rows = [f"{total / n:.1f} lines a request in all (background work in the window included)"]
    rows.append(f"{'inclusive':>9} {'own':>7} {'calls':>6}  function (lines and calls a request)")
    called = Counter({name: k for name, k in counts.inclusive.items() if counts.calls[name]})
    for name, lines in called.most_common(top):
        rows.append(f"{lines / n:9.1f} {counts.own[name] / n:7.1f} {counts.calls[name] / n:6.2f}  {name}")
    made = sum(counts.made.values())
    rows.append(f"\n{made / n:.1f} dataclass values made a request:")
    for kind, k in counts.made.most_common(top):
        rows.append(f"{k / n:9.2f}  {kind}")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from prefixgate.backends.cli import whole_number  # here: the traced gateway imports this module
    from prefixgate.bench.overhead import OUTPUT_TOKENS, add_stream_interval_argument

    p.add_argument("--target", choices=("http", "grpc"), default="http", help="the node's protocol")
    p.add_argument("--requests", type=int, default=REQUESTS, help=f"requests counted (default {REQUESTS})")
    p.add_argument("--top", type=int, default=TOP, help=f"functions and classes listed (default {TOP})")
    p.add_argument("--baseline-src", help="count a gateway run from this source tree instead (PYTHONPATH)")
    p.add_argument("--json", dest="json_out", help="write the whole count as JSON to this file")
    p.add_argument("--stream", action="store_true", help="the chats streamed (SSE) instead of answered whole")
    p.add_argument(
        "--max-tokens",
        type=whole_number("--max-tokens"),
        default=OUTPUT_TOKENS,
        help=f"tokens each chat generates (default {OUTPUT_TOKENS}): two runs, streamed, with more"
        " tokens and fewer, tell what a streamed chunk costs",
    )
    add_stream_interval_argument(p)


def run(args: argparse.Namespace) -> int:
    import httpx

    from prefixgate.bench import launch
    from prefixgate.bench.overhead import Prompts, body
    from prefixgate.gateway.ops import processes

    logs = launch.run_dir("lines")
    out = Path(tempfile.mkdtemp(prefix="prefixgate-lines-")) / "counts.json"
    opts = launch.NodeOptions(
        profile="instant",
        capacity_blocks=300_000,
        max_queue=4096,
        max_decode_streams=4096,
        stream_interval=args.stream_interval,
    )
    nodes = launch.start_nodes(1, opts, logs)
    try:
        worker = nodes[0].url if args.target == "http" else f"grpc://{nodes[0].address}"
        # Traced, every step runs some fifty times slower: the chat-template budget (5 ms) is
        # scaled with it, or every chat would take the render threads, which are not counted.
        env = {"PREFIXGATE_INLINE_RENDER_BUDGET_MS": str(INLINE_BUDGET_TRACED_MS)}
        if args.baseline_src:
            env["PYTHONPATH"] = args.baseline_src
        wrap = [sys.executable, "-m", "prefixgate.bench.lines", "--trace-to", str(out), "--"]
        # started as the other benchmarks start it: the worker flag and nothing else
        child = launch.start_gateway(
            logs, name="gateway", env=env, timeout=120.0, extra_args=["--worker-urls", worker], wrap=wrap
        )
        try:
            prompts = Prompts()
            headers = {"content-type": "application/json", **child.headers}
            with httpx.Client(base_url=child.url, headers=headers, timeout=120.0) as client:

                def send(count: int) -> None:
                    for _ in range(count):
                        chat = body(prompts.make(PROMPT_BYTES), args.stream, max_tokens=args.max_tokens)
                        r = client.post("/v1/chat/completions", content=chat)
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")

                send(WARMUP)
                os.kill(child.pid, signal.SIGUSR1)
                send(args.requests)
                os.kill(child.pid, signal.SIGUSR2)
                deadline = time.monotonic() + WRITE_WAIT_S
                while not out.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            processes.stop_all([child], grace=10.0)
    finally:
        processes.stop_all(nodes, grace=3.0)
    if not out.exists():
        print(f"the gateway wrote no count (its log: {logs / 'gateway.log'})", file=sys.stderr)
        return 1
    counts = LineCounts.from_json(out.read_bytes())
    answered = "streamed" if args.stream else "answered whole"
    print(
        f"{args.target}://, {args.requests} chats of {PROMPT_BYTES // 1024} KB, one after the other,"
        f" {args.max_tokens} tokens each, {answered}"
    )
    print("\n".join(render(counts, args.requests, args.top)))
    if args.json_out:
        Path(args.json_out).write_bytes(counts.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(traced(sys.argv[1:]))
