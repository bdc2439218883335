"""``prefixgate bench toolcalls``: what parsing tool calls out of a streamed answer costs.

One tool call per answer, in each parser's format (``hermes``, ``llama3``, ``mistral``,
``pythonic``), whose arguments make the answer about 1 KB, 16 KB, 256 KB and 1 MB, streamed
through the gateway's streaming path (``toolcalls.shapes.ToolDeltas``: parser, whitespace policy,
OpenAI deltas) in pieces of 4 characters, about one token each, as a real stream comes. Prints
the cost per KB and per piece (token) for each size, the best of the runs; the cost per KB
should be flat: no piece makes the parser look again at what came before it. Pure CPU, no I/O.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from prefixgate.bench.report import write_json
from prefixgate.gateway.toolcalls.shapes import ToolDeltas

SIZES = (1_024, 16_384, 262_144, 1_048_576)
PARSERS = ("hermes", "llama3", "mistral", "pythonic")
CHUNK = 4
FLAT_RATIO = 3.0  # the largest over the smallest cost per KB, across sizes, for "flat"
_WORDS = 'the quick "brown" fox {jumps} over [the] lazy dog, again\n and <again>; '.split(" ")


def content_of(size: int) -> str:
    """``size`` characters of file content with quotes, brackets and newlines in it."""
    out: list[str] = []
    n = 0
    while n < size:
        w = _WORDS[len(out) % len(_WORDS)] + " "
        out.append(w)
        n += len(w)
    return "".join(out)[:size]


def answer(parser: str, size: int) -> str:
    """An answer of about ``size`` characters: one call writing a file, in ``parser``'s format
    (the content scaled for what escaping it adds)."""
    first = _answer(parser, size)
    return _answer(parser, max(0, size * size // max(1, len(first))))


def _answer(parser: str, size: int) -> str:
    body = content_of(max(0, size - 120))
    args = {"path": "notes/today.txt", "content": body, "mode": "overwrite"}
    if parser == "hermes":
        call = json.dumps({"name": "write_file", "arguments": args}, ensure_ascii=False)
        return f"I will write it.\n<tool_call>\n{call}\n</tool_call>"
    if parser == "llama3":
        return "<|python_tag|>" + json.dumps({"name": "write_file", "parameters": args}, ensure_ascii=False)
    if parser == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": "write_file", "arguments": args}], ensure_ascii=False)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return f"<|python_start|>[write_file({kwargs})]<|python_end|>"


@dataclass(slots=True)
class CostRow:
    parser: str
    size: int  # characters of the answer
    pieces: int
    runs: int
    ms: float  # the best run's time to stream the whole answer
    us_per_kb: float
    us_per_token: float


def stream_once(parser: str, text: str, chunk: int) -> float:
    """Seconds to stream ``text`` through the deltas of one choice; the call must come out."""
    deltas = ToolDeltas(parser)
    t0 = time.perf_counter()
    for i in range(0, len(text), chunk):
        deltas.step(text[i : i + chunk], False)
    deltas.step("", True)
    elapsed = time.perf_counter() - t0
    if deltas.calls != 1:
        raise AssertionError(f"{parser}: {deltas.calls} calls parsed out of a {len(text)}-character answer")
    return elapsed


def default_runs(size: int) -> int:
    return max(3, min(100, 2_000_000 // size))


def measure(parser: str, size: int, chunk: int, runs: int) -> CostRow:
    text = answer(parser, size)
    secs = min(stream_once(parser, text, chunk) for _ in range(runs))  # the least disturbed run
    pieces = -(-len(text) // chunk)
    per_kb = secs * 1e6 / (len(text) / 1024)
    return CostRow(parser, len(text), pieces, runs, secs * 1e3, per_kb, secs * 1e6 / pieces)


def render(rows: Sequence[CostRow], chunk: int) -> Table:
    t = Table(
        title=f"tool-call parsing, streamed in {chunk}-character pieces (best of the runs)",
        title_justify="left",
    )
    for col in ("parser", "answer", "pieces", "runs", "total ms", "µs/KB", "µs/token"):
        t.add_column(col, justify="right")
    for r in rows:
        size = f"{r.size / 1024:,.0f} KB" if r.size >= 1024 else f"{r.size} B"
        t.add_row(
            r.parser,
            size,
            f"{r.pieces:,}",
            str(r.runs),
            f"{r.ms:,.2f}",
            f"{r.us_per_kb:,.1f}",
            f"{r.us_per_token:.2f}",
        )
    return t


def flatness(rows: Sequence[CostRow]) -> dict[str, float]:
    """Per parser: the largest cost per KB over the smallest, across the sizes."""
    out: dict[str, float] = {}
    for parser in dict.fromkeys(r.parser for r in rows):
        costs = [r.us_per_kb for r in rows if r.parser == parser]
        out[parser] = max(costs) / min(costs)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="answer sizes in characters")
    p.add_argument("--parsers", nargs="+", default=list(PARSERS), choices=PARSERS)
    p.add_argument("--chunk", type=int, default=CHUNK, help="characters per streamed piece")
    p.add_argument("--runs", type=int, default=None, help="per size (default: more for small answers)")
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(100, Console().width))
    rows = [
        measure(parser, size, args.chunk, args.runs or default_runs(size))
        for parser in args.parsers
        for size in args.sizes
    ]
    console.print(render(rows, args.chunk))
    ratios = flatness(rows)
    for parser, ratio in ratios.items():
        verdict = "[green]flat[/]" if ratio <= FLAT_RATIO else "[red]grows[/]"
        console.print(f"{parser}: largest / smallest µs per KB {ratio:.2f} ({verdict}, flat <= {FLAT_RATIO})")
    if args.json_out:
        report: dict[str, Any] = {"chunk": args.chunk, "rows": [asdict(r) for r in rows], "flatness": ratios}
        write_json(args.json_out, report, console)
    return 0 if all(r <= FLAT_RATIO for r in ratios.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench toolcalls", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
