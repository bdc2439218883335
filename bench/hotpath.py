"""``prefixgate bench hotpath``: the per-request work before routing, timed.

normalize (``render_chat`` of a chat request with ``documents``) + tokenize (``bytes4``) +
block hashes (64-token blocks) for prompts of about 1K, 32K and 128K tokens. Prints p50/p99
per stage and in total; target: the 128K-token prompt in <= 10 ms (p50).

With ``--tokenizer-path DIR`` (``shipped``: the nodes' tokenizer) it also times the engine
tokenizer's path (``gateway.tokens``): the model's chat template over the canonical messages +
tokenization + hash, for prompts of about that many of the model's tokens: one plain encode of
the whole text (for comparison), cold (segment cache empty) and with the system prompt and
documents repeated (cache warm, a new question each time).
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
from prefixgate.gateway.tokens import EngineTokenizer, open_tokenizer_dir
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


# -- the engine tokenizer (chat template + real token ids) ------------------------------------


def engine_body(tok: EngineTokenizer, tokens: int) -> dict[str, Any]:
    """``chat_body`` scaled so the engine tokenizer makes about ``tokens`` of it."""
    body = chat_body(tokens)
    made = len(_engine_pass(tok, body, 0)[1]) // 4
    return chat_body(max(64, tokens * tokens // max(1, made)))


def _engine_pass(tok: EngineTokenizer, body: Mapping[str, Any], i: int) -> tuple[str, bytes]:
    docs = [Document(str(d["id"]), str(d["text"])) for d in body.get("documents") or ()]
    messages = [
        *body["messages"][:-1],
        {"role": "user", "content": f"{body['messages'][-1]['content']} ({i})"},
    ]
    text = tok.render_chat(messages, documents=docs, tools=body.get("tools"))
    return text, tok.encode(text)


def measure_engine(
    tok: EngineTokenizer,
    body: Mapping[str, Any],
    iterations: int,
    target: int,
    warm: bool,
    whole: bool = False,
) -> HotpathResult:
    """Template + tokenize + hash per request; ``warm``: the segment cache holds the system prompt
    and documents (every request has a new question), else it is emptied before each request;
    ``whole``: one plain ``encode`` of the whole text instead (no segments, for comparison)."""
    root = Namespace(model="prefixgate-sim", block_size=BLOCK_SIZE, tokenizer=tok.name).root()
    times: dict[str, list[float]] = {"template": [], "tokenize": [], "hash": [], "total": []}
    clock = time.perf_counter_ns
    tokens = b""
    hashes: list[int] = []
    docs = [Document(str(d["id"]), str(d["text"])) for d in body.get("documents") or ()]
    tok.segments.cache.clear()
    if warm:
        _engine_pass(tok, body, -1)
    for i in range(iterations):
        if not warm:
            tok.segments.cache.clear()
        messages = [
            *body["messages"][:-1],
            {"role": "user", "content": f"{body['messages'][-1]['content']} ({i})"},
        ]
        t0 = clock()
        text = tok.render_chat(messages, documents=docs, tools=body.get("tools"))
        t1 = clock()
        tokens = tok.segments.plain(text) if whole else tok.encode(text)
        t2 = clock()
        hashes = block_hashes(tokens, BLOCK_SIZE, root)
        t3 = clock()
        spans = (("template", t1 - t0), ("tokenize", t2 - t1), ("hash", t3 - t2), ("total", t3 - t0))
        for stage, ns in spans:
            times[stage].append(ns / 1e6)
    stages = {k: (statistics.median(sorted(v)), percentile(sorted(v), 99)) for k, v in times.items()}
    return HotpathResult(target, len(tokens) // 4, len(hashes), iterations, stages)


def engine_iterations(tokens: int) -> int:
    return max(10, min(300, 3_000_000 // max(1, tokens)))


def render_engine(rows: Sequence[tuple[str, HotpathResult]], name: str) -> Table:
    t = Table(
        title=f"engine tokenizer {name}: chat template + tokenize + hash (64-token blocks), ms",
        title_justify="left",
    )
    for col in (
        "cache",
        "prompt tokens",
        "iters",
        "template p50",
        "tokenize p50",
        "hash p50",
        "total p50",
        "total p99",
    ):
        t.add_column(col, justify="right")
    for label, r in rows:
        s = r.stages_ms
        t.add_row(
            label,
            f"{r.prompt_tokens:,}",
            str(r.iterations),
            f"{s['template'][0]:.3f}",
            f"{s['tokenize'][0]:.3f}",
            f"{s['hash'][0]:.3f}",
            f"{s['total'][0]:.3f}",
            f"{s['total'][1]:.3f}",
        )
    return t


def run_engine(path: str, sizes: Sequence[int], fixed: int | None) -> list[tuple[str, HotpathResult]]:
    from prefixgate.backends.hftok import TOKENIZER_DIR

    tok = open_tokenizer_dir(TOKENIZER_DIR if path == "shipped" else path)
    rows: list[tuple[str, HotpathResult]] = []
    for n in sizes:
        body = engine_body(tok, n)
        iters = fixed or engine_iterations(n)
        rows.append(("none (whole text)", measure_engine(tok, body, iters, n, warm=False, whole=True)))
        rows.append(("cold", measure_engine(tok, body, iters, n, warm=False)))
        rows.append(("repeated docs", measure_engine(tok, body, iters, n, warm=True)))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="prompt sizes in tokens")
    p.add_argument(
        "--tokenizer-path",
        default=None,
        metavar="DIR",
        help="also time the engine tokenizer in DIR (chat template + real ids); 'shipped': the nodes' one",
    )
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
    engine: list[tuple[str, HotpathResult]] = []
    if args.tokenizer_path:
        engine = run_engine(args.tokenizer_path, args.sizes, fixed)
        console.print(render_engine(engine, args.tokenizer_path))
    if args.json_out:
        out: dict[str, Any] = {"results": [r.as_json() for r in results], "targets": verdict}
        if engine:
            out["engine"] = [{"cache": label, **r.as_json()} for label, r in engine]
        write_json(args.json_out, out, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench hotpath", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
