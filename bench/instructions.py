"""``prefixgate bench instructions``: what a request costs a router in CPU instructions, counted.

CPU time per request (``bench overhead``) drifts with whatever else the machine runs: two runs of
the same command on the two-core benchmark machine differed by a third. Instructions executed do
not. Each router runs under ``valgrind --tool=callgrind`` with counting off; once it is up and
warm the count is switched on (``callgrind_control``) for a quiet window (what its background
work, such as the nodes' health probes, costs per second), then for ``--requests`` chat requests
sent one after another (2 KB prompts, 8 output tokens, the ``bench overhead`` prompts). A request
costs the second window's count less the quiet rate times its length, over the requests.

Only user-space instructions of the router's own process are counted: not the kernel's work
(sockets), not child processes (prefixgate's tokenizer processes, gateway workers), and an
instruction is not a fixed time (a cache miss costs more than an add). What it is good for is
comparing: two checkouts (``--baseline-src``), a router against a peer, one node against many
(``--nodes 1 8``), the same to within 1.5 % from run to run.

Targets: prefixgate in front of the nodes' OpenAI endpoints (``http://``) and their SMG engine
protocol (``grpc://``, where the gateway renders, tokenizes and detokenizes), started with the
worker flag alone; with ``--baseline-src`` the same from another source tree; smg (``--peers
smg``) in front of the same nodes both ways; with ``--floor`` the floor (``bench.floor``: uvicorn
and aiohttp relaying the chat, nothing else) and the essentials (the relay plus the least a
gateway request does, written lean) in front of the first node. Needs valgrind
(``callgrind_control`` beside it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from prefixgate.bench import launch
from prefixgate.bench.overhead import FLOORS, Prompts, add_head_arguments, body
from prefixgate.bench.report import write_json
from prefixgate.gateway.ops import processes

REQUESTS = 200
WARMUP = 30
QUIET_S = 5.0
PROMPT_BYTES = 2_048
START_TIMEOUT_S = 600.0  # a router starting under callgrind runs tens of times slower
REQUEST_TIMEOUT_S = 120.0
INLINE_BUDGET_UNDER_CALLGRIND_MS = 250.0  # the default 5 ms, times callgrind's slowdown


@dataclass(frozen=True, slots=True)
class Count:
    """What one router cost over ``requests`` requests, background taken out."""

    target: str
    nodes: int
    requests: int
    instructions: int  # in the requests' window
    window_s: float
    quiet_per_s: float  # instructions a second with no request

    @property
    def per_request(self) -> float:
        return max(0.0, self.instructions - self.quiet_per_s * self.window_s) / self.requests


def callgrind(out: Path) -> list[str]:
    """The command prefix that runs a process under callgrind, counting off until switched on."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def _totals(f: Path) -> int | None:
    """The instructions a dump file counts; None while it is not written out."""
    for line in f.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return None


def _window(pid: int, out: Path) -> int:
    """Dump the count so far and return it: callgrind starts the next count from zero."""
    before = set(out.parent.glob(out.name + ".*"))
    _control(pid, "--dump")
    for _ in range(600):  # written by the router's own thread, soon after
        new = sorted(set(out.parent.glob(out.name + ".*")) - before)
        totals = [_totals(f) for f in new]
        if new and all(t is not None for t in totals):
            return sum(t or 0 for t in totals)
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no dump for pid {pid}")


def _send(client: httpx.Client, prompts: Prompts, n: int) -> None:
    for _ in range(n):
        r = client.post(
            "/v1/chat/completions", content=body(prompts.make(PROMPT_BYTES), False, head=prompts.head)
        )
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")


def count(
    child: processes.Child, out: Path, target: str, nodes: int, requests: int, prompts: Prompts
) -> Count:
    """Warm ``child`` up, then count a quiet window and ``requests`` requests. ``prompts`` is the
    run's: no prompt is sent twice, so no target finds the nodes holding what an earlier one sent
    (a hit changes the nodes' KV events, and so what a gateway does)."""
    with httpx.Client(
        base_url=child.url,
        headers={"content-type": "application/json", **child.headers},
        timeout=REQUEST_TIMEOUT_S,
    ) as client:
        _send(client, prompts, WARMUP)
        _control(child.pid, "--instr=on")
        _window(child.pid, out)  # what was counted while switching on
        t0 = time.monotonic()
        time.sleep(QUIET_S)
        quiet = _window(child.pid, out) / (time.monotonic() - t0)
        t0 = time.monotonic()
        _send(client, prompts, requests)
        window = time.monotonic() - t0
        busy = _window(child.pid, out)
        _control(child.pid, "--instr=off")
    return Count(target, nodes, requests, busy, window, quiet)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes", type=int, nargs="+", default=[1], help="instant nodes behind the routers (default 1)"
    )
    p.add_argument("--requests", type=int, default=REQUESTS, help=f"requests counted (default {REQUESTS})")
    p.add_argument("--peers", default="", help="peers to count too: smg ('' none, the default)")
    p.add_argument(
        "--peers-venv", default=str(launch.default_peers_dir()), help="directory of the peer venvs"
    )
    p.add_argument(
        "--baseline-src",
        help="also count a gateway run from this source tree (PYTHONPATH, e.g. an exported older commit)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also count the floor (uvicorn and aiohttp relaying the chat to a node, nothing else) "
        "and the essentials (the relay plus the least a gateway request does, written lean)",
    )
    add_head_arguments(p)
    p.add_argument("--json", dest="json_out", help="write the counts as JSON to this file")


def _targets(args: argparse.Namespace) -> list[str]:
    out = ["prefixgate-http", "prefixgate-grpc"]
    if args.floor:
        out += [f"{name}-http" for name in FLOORS]
    if args.baseline_src:
        out += ["baseline-http", "baseline-grpc"]
    if "smg" in args.peers.split(","):
        out += ["smg-http", "smg-grpc"]
    return out


def _start(
    target: str, args: argparse.Namespace, http: Sequence[str], grpc: Sequence[str], logs: Path, out: Path
) -> processes.Child:
    workers = list(grpc if target.endswith("-grpc") else http)
    wrap = callgrind(out)
    name = target.removesuffix("-http")
    if name in FLOORS:
        return launch.start_floor(logs, target, FLOORS[name], http[0], timeout=START_TIMEOUT_S, wrap=wrap)
    if target.startswith("smg"):
        return launch.start_peer(
            "smg", Path(args.peers_venv), workers, logs, timeout=START_TIMEOUT_S, wrap=wrap
        )
    # Callgrind runs every step some 50 times slower: the chat-template budget (5 ms) is scaled
    # with it, or a 2 KB chat would take the render threads it never takes run natively.
    env = {"PREFIXGATE_INLINE_RENDER_BUDGET_MS": str(INLINE_BUDGET_UNDER_CALLGRIND_MS)}
    if target.startswith("baseline"):
        env["PYTHONPATH"] = args.baseline_src
    # started as the peers are: the worker flag and nothing else (its defaults, but the above)
    return launch.start_gateway(
        logs, name=target, env=env, timeout=START_TIMEOUT_S, extra_args=["--worker-urls", *workers], wrap=wrap
    )


def render(counts: Sequence[Count]) -> Table:
    t = Table(
        title="instructions a request, millions",
        caption=f"callgrind; one client, {PROMPT_BYTES // 1024} KB chats, 8 output tokens; quiet: "
        "background instructions a second with no request (taken out)",
        title_justify="left",
    )
    node_counts = sorted({c.nodes for c in counts})
    t.add_column("target")
    for n in node_counts:
        t.add_column(f"{n} node{'s' if n > 1 else ''}", justify="right")
    t.add_column("quiet, M/s", justify="right")
    for target in dict.fromkeys(c.target for c in counts):
        row = {c.nodes: c for c in counts if c.target == target}
        quiet = "/".join(f"{row[n].quiet_per_s / 1e6:.1f}" for n in node_counts if n in row)
        t.add_row(
            target, *(f"{row[n].per_request / 1e6:.2f}" if n in row else "-" for n in node_counts), quiet
        )
    return t


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(110, Console().width))
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        console.print("[red]needs valgrind and callgrind_control on PATH[/]")
        return 2
    if "smg" in args.peers.split(","):
        reason = launch.peer_missing("smg", Path(args.peers_venv))
        if reason:
            console.print(f"[red]smg: {reason}[/]")
            return 2
    logs = launch.run_dir("instructions")
    counts: list[Count] = []
    prompts = Prompts(args.system_prompt, args.history)
    opts = launch.NodeOptions(
        profile="instant", capacity_blocks=300_000, max_queue=4096, max_decode_streams=4096
    )
    with tempfile.TemporaryDirectory(prefix="prefixgate-callgrind-") as tmp:
        for n in args.nodes:
            nodes = launch.start_nodes(n, opts, logs)
            try:
                http = [c.url for c in nodes]
                grpc = [f"grpc://{c.address}" for c in nodes]
                for target in _targets(args):
                    out = Path(tmp) / f"{target}-{n}.out"
                    child = _start(target, args, http, grpc, logs, out)
                    try:
                        c = count(child, out, target, n, args.requests, prompts)
                    finally:
                        processes.stop_all([child], grace=10.0)
                    counts.append(c)
                    console.print(
                        f"  {target}, {n} node(s): {c.per_request / 1e6:.2f} M instructions a request "
                        f"(quiet {c.quiet_per_s / 1e6:.1f} M/s, {c.window_s:.1f} s for {c.requests})"
                    )
            finally:
                processes.stop_all(nodes, grace=3.0)
    console.print(render(counts))
    if args.json_out:
        report: dict[str, Any] = {
            "config": {"requests": args.requests, "prompt_bytes": PROMPT_BYTES, "quiet_s": QUIET_S},
            "counts": [
                {
                    "target": c.target,
                    "nodes": c.nodes,
                    "per_request": round(c.per_request),
                    "quiet_per_s": round(c.quiet_per_s),
                    "window_s": round(c.window_s, 2),
                    "requests": c.requests,
                }
                for c in counts
            ],
        }
        write_json(args.json_out, report, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench instructions", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
