"""``prefixgate bench detok``: what the gateway's detokenizer costs per output token.

``python -m prefixgate.bench.detok_cost [--sizes 1024 16384 262144 1048576] [--chunk 1] [--json FILE]``

The ``grpc://`` path turns the engine's token ids into text (``gateway.tokens.detokenize``); this
times ``Detokenizer.push`` one chunk of ``--chunk`` ids at a time (1: a streaming engine's worst
case) with the nodes' shipped tokenizer, for outputs of about 1 KB, 16 KB, 256 KB and 1 MB of text
(``size / 4`` ids), over streams that cost differently:

- ``text``: the ids of English text with some non-ASCII words (characters of several tokens);
- ``out of vocabulary``: ids above the tokenizer's vocabulary (an engine fault);
- ``skipped specials``: ``<|im_end|>`` over and over (special tokens are not shown);
- ``partial UTF-8``: a character's first two bytes over and over (it never completes).

A detokenizer whose window grows with ids it cannot show yet costs more per token the longer the
output; the figures here must stay flat across sizes. Each case stops after ``--max-seconds``
(the table then says how many ids it reached), so the run is bounded whatever the code does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from prefixgate.bench.report import write_json
from prefixgate.gateway.tokens.detokenize import Decoder, Detokenizer

SIZES = (1_024, 16_384, 262_144, 1_048_576)  # bytes of output text, about 4 a token
MAX_SECONDS = 20.0
CHECK_EVERY = 256  # pushes between two looks at the clock
REPEAT_IDS = 65_536  # each case runs about this many ids in all (at least once) ...
REPEAT_MAX = 15  # ... in at most this many runs
TEXT = (
    "The gateway streams each choice as it is decoded, and a reader sees whole characters only: "
    "naïve café, 日本語のテキスト, emoji 🙂 and plain words alike.\n"
)


@dataclass(slots=True)
class Cost:
    kind: str
    size_bytes: int
    ids: int  # ids pushed (fewer than asked when the case ran out of time)
    asked: int
    text_bytes: int  # UTF-8 bytes of the text shown
    seconds: float

    @property
    def us_per_token(self) -> float:
        return self.seconds / max(1, self.ids) * 1e6

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "size_bytes": self.size_bytes,
            "ids": self.ids,
            "asked": self.asked,
            "complete": self.ids == self.asked,
            "text_bytes": self.text_bytes,
            "seconds": round(self.seconds, 4),
            "us_per_token": round(self.us_per_token, 3),
        }


def streams(tok: Any) -> dict[str, Callable[[int], list[int]]]:
    """Each kind of stream: ``n`` -> ``n`` ids."""
    vocab = int(tok.get_vocab_size())
    end = tok.token_to_id("<|im_end|>")
    han = list(tok.encode("日", add_special_tokens=False).ids)
    text = list(tok.encode(TEXT, add_special_tokens=False).ids)

    def repeat(unit: Sequence[int]) -> Callable[[int], list[int]]:
        return lambda n: (list(unit) * (n // len(unit) + 1))[:n]

    return {
        "text": repeat(text),
        "out of vocabulary": repeat([vocab + 7]),
        "skipped specials": repeat([end]),
        "partial UTF-8": repeat(han[:2]),
    }


def measure(tok: Decoder, kind: str, ids: list[int], size: int, chunk: int, max_seconds: float) -> Cost:
    d = Detokenizer(tok)
    shown: list[str] = []
    clock = time.process_time  # CPU time: the machine may be shared
    start = clock()
    done = 0
    for k, i in enumerate(range(0, len(ids), chunk)):
        shown.append(d.push(ids[i : i + chunk]).text)
        done = min(len(ids), i + chunk)
        if k % CHECK_EVERY == 0 and clock() - start > max_seconds:
            break
    shown.append(d.finish().text)
    seconds = clock() - start
    return Cost(kind, size, done, len(ids), len("".join(shown).encode()), seconds)


def repeats(ids: int) -> int:
    """Runs of one case (the median is shown): small outputs are timed more often."""
    return max(1, min(REPEAT_MAX, REPEAT_IDS // max(1, ids)))


def run_all(sizes: Sequence[int], chunk: int, max_seconds: float) -> list[Cost]:
    from tokenizers import Tokenizer

    from prefixgate.backends.hftok import TOKENIZER_DIR

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    out: list[Cost] = []
    for kind, make in streams(tok).items():
        measure(tok, kind, make(1024), 4096, chunk, max_seconds)  # warm up
        for size in sizes:
            ids = make(max(1, size // 4))
            runs = [measure(tok, kind, ids, size, chunk, max_seconds) for _ in range(repeats(len(ids)))]
            out.append(sorted(runs, key=lambda c: c.us_per_token)[len(runs) // 2])
    return out


def _size(n: int) -> str:
    return (
        f"{n >> 20} MB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KB" if n >= 1024 else f"{n} B"
    )


def render(costs: Sequence[Cost], sizes: Sequence[int], chunk: int) -> Table:
    t = Table(title=f"detokenizer: µs per token ({chunk} id a push), shipped tokenizer", title_justify="left")
    t.add_column("stream")
    for size in sizes:
        t.add_column(f"{_size(size)} ({max(1, size // 4):,} ids)", justify="right")
    t.add_column("largest / smallest", justify="right")
    for kind in dict.fromkeys(c.kind for c in costs):
        row = {c.size_bytes: c for c in costs if c.kind == kind}
        cells = []
        for size in sizes:
            c = row[size]
            cut = "" if c.ids == c.asked else f" (cut at {c.ids:,})"
            cells.append(f"{c.us_per_token:.2f}{cut}")
        first, last = row[sizes[0]].us_per_token, row[sizes[-1]].us_per_token
        t.add_row(kind, *cells, f"{last / first:.2f}x" if first > 0 else "-")
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="output sizes in bytes of text")
    p.add_argument("--chunk", type=int, default=1, help="ids per push (1: one a streamed chunk)")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="per case, then it stops")
    p.add_argument("--json", dest="json_out", help="write the figures as JSON to this file")


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(120, Console().width))
    sizes = sorted(args.sizes)
    costs = run_all(sizes, max(1, args.chunk), args.max_seconds)
    console.print(render(costs, sizes, max(1, args.chunk)))
    if args.json_out:
        write_json(args.json_out, {"chunk": args.chunk, "results": [c.as_json() for c in costs]}, console)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench detok", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
