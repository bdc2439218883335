"""``prefixgate bench hotpath``: the per-request work before routing, timed.

normalize (``render_chat`` of a chat request with ``documents``) + tokenize (``bytes4``) +
block hashes (64-token blocks) for prompts of about 1K, 32K and 128K tokens. Prints p50/p99
per stage and in total; target: the 128K-token prompt in <= 10 ms (p50).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from prefixgate.bench.report import percentile, write_json
from prefixgate.bench.textgen import segment_text
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.openai.normalize import Document, render_chat

SIZES = (1_024, 32_768, 131_072)
TARGET_128K_MS = 10.0
BLOCK_SIZE = 64


def chat_body(tokens: int) -> dict[str, Any]:
    """A chat request of about ``tokens`` tokens: system prompt, documents, a question."""
    system = segment_text(1, 200, "hot-sys", line_words=14)
    question = segment_text(2, 50, "hot-q", line_words=14)
    doc_tokens = max(64, tokens - 300)
    n_docs = max(1, min(16, doc_tokens // 2048))
    per_doc = doc_tokens // n_docs
    docs = [
        {"id": f"doc-{i:02d}", "text": segment_text(100 + i, per_doc, "hot-doc", line_words=14)}
        for i in range(n_docs)
    ]
    docs.reverse()  # not in canonical order: the normalizer has to sort them
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "documents": docs,
    }


@dataclass(slots=True)
class HotpathResult:
    target_tokens: int
    prompt_tokens: int
    blocks: int
    iterations: int
    stages_ms: dict[str, tuple[float, float]]  # stage -> (p50, p99)

    def as_json(self) -> dict[str, Any]:
        return {
            "target_tokens": self.target_tokens,
            "prompt_tokens": self.prompt_tokens,
            "blocks": self.blocks,
            "iterations": self.iterations,
            **{f"{k}_p50_ms": round(v[0], 4) for k, v in self.stages_ms.items()},
            **{f"{k}_p99_ms": round(v[1], 4) for k, v in self.stages_ms.items()},
        }


def measure(body: Mapping[str, Any], iterations: int, target: int) -> HotpathResult:
    root = Namespace(model="prefixgate-sim", block_size=BLOCK_SIZE).root()
    tok = Bytes4Tokenizer()
    times: dict[str, list[float]] = {"normalize": [], "tokenize": [], "hash": [], "total": []}
    clock = time.perf_counter_ns
    tokens = b""
    hashes: list[int] = []
    for _ in range(iterations):
        t0 = clock()
        docs = [Document(str(d["id"]), str(d["text"])) for d in body.get("documents") or ()]
        layout = render_chat(body["messages"], documents=docs, tools=body.get("tools"), normalize=True)
        t1 = clock()
        tokens = tok.encode(layout.text)
        t2 = clock()
        hashes = block_hashes(tokens, BLOCK_SIZE, root)
        t3 = clock()
        spans = (("normalize", t1 - t0), ("tokenize", t2 - t1), ("hash", t3 - t2), ("total", t3 - t0))
        for stage, ns in spans:
            times[stage].append(ns / 1e6)
    stages: dict[str, tuple[float, float]] = {}
    for stage, ms in times.items():
        ms.sort()
        stages[stage] = (statistics.median(ms), percentile(ms, 99))
    return HotpathResult(target, len(tokens) // 4, len(hashes), iterations, stages)


def run_all(sizes: Sequence[int], iterations: Callable[[int], int]) -> list[HotpathResult]:
    return [measure(chat_body(n), iterations(n), n) for n in sizes]


def default_iterations(tokens: int) -> int:
    return max(200, min(2000, 4_000_000 // max(1, tokens)))


def render(results: Sequence[HotpathResult]) -> Table:
    t = Table(title="hot path: normalize + tokenize + hash (64-token blocks), ms", title_justify="left")
    for col in (
        "prompt tokens",
        "blocks",
        "iters",
        "normalize p50",
        "tokenize p50",
        "hash p50",
        "total p50",
        "total p99",
    ):
        t.add_column(col, justify="right")
    for r in results:
        s = r.stages_ms
        t.add_row(
            f"{r.prompt_tokens:,}",
            f"{r.blocks:,}",
            str(r.iterations),
            f"{s['normalize'][0]:.3f}",
            f"{s['tokenize'][0]:.3f}",
            f"{s['hash'][0]:.3f}",
            f"{s['total'][0]:.3f}",
            f"{s['total'][1]:.3f}",
        )
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="prompt sizes in tokens")
    p.add_argument("--iterations", type=int, default=None, help="per size (default: more for small prompts)")
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    fixed = args.iterations
    results = run_all(args.sizes, (lambda n: fixed) if fixed else default_iterations)
    console.print(render(results))
    big = [r for r in results if r.target_tokens >= 131_072]
    verdict: dict[str, bool] = {}
    if big:
        p50 = big[0].stages_ms["total"][0]
        verdict[f"128K-token prompt total p50 <= {TARGET_128K_MS} ms"] = p50 <= TARGET_128K_MS
        console.print(
            f"128K-token prompt: {p50:.2f} ms p50 (target <= {TARGET_128K_MS} ms): "
            + ("[green]met[/]" if p50 <= TARGET_128K_MS else "[red]missed[/]")
        )
    if args.json_out:
        out = {"results": [r.as_json() for r in results], "targets": verdict}
        write_json(args.json_out, out, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench hotpath", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
