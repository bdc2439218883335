"""Public traces as workloads: Mooncake (ids, chained) and Azure 2023 (lengths only).

Mooncake: each ``hash_ids`` entry is one 512-token block of the prompt, the last possibly
partial (``input_length`` says how much). A block id becomes segment ``(id, 512)`` of
deterministic text, so the same id is always the same 512 tokens (2,048 bytes under
``bytes4``); the block hashes are chained over those segments (``bench.textgen.span_hashes``)
at our block size. With a block size dividing 512, a trace block is ``512 / block_size`` of
ours and a partial last block contributes its full blocks only, as the index keys full blocks.

Azure 2023 has no content at all: the sessions model below decides which prompts share what.
"""

from __future__ import annotations

import csv
import random
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import orjson

from prefixgate.bench.textgen import Span, span_hashes
from prefixgate.bench.workload_types import Request, Workload, WorkloadOptions, sample

TRACE_BLOCK = 512
MOONCAKE_SALT = "mooncake"
AZURE_SALT = "azure"


def mooncake_spans(hash_ids: list[int], input_length: int) -> list[Span]:
    """Segments of a Mooncake prompt: full trace blocks, then the partial last one."""
    if not hash_ids:
        return []
    last = input_length - TRACE_BLOCK * (len(hash_ids) - 1)
    last = max(1, min(TRACE_BLOCK, last))
    spans: list[Span] = [(i, TRACE_BLOCK) for i in hash_ids[:-1]]
    spans.append((hash_ids[-1], last))
    return spans


def load_mooncake(path: Path, opts: WorkloadOptions) -> Workload:
    root = opts.namespace().root()
    memo: dict[tuple[int, int, int], tuple[int, ...]] = {}
    scale = opts.time_scale or 1.0
    rows: list[Request] = []
    early_stop = opts.limit if opts.fraction is None else None
    with path.open("rb") as f:
        for line in f:
            if early_stop is not None and len(rows) >= early_stop:
                break
            if not line.strip():
                continue
            rec = orjson.loads(line)
            ids = list(rec["hash_ids"])
            spans = mooncake_spans(ids, int(rec["input_length"]))
            rows.append(
                Request(
                    index=len(rows),
                    arrival_s=float(rec["timestamp"]) / 1000.0 / scale,
                    prompt_tokens=sum(n for _, n in spans),
                    block_hashes=(),
                    output_tokens=int(rec["output_length"]),
                    spans=tuple(spans),
                )
            )
    rows = sample(rows, opts)
    out = [
        replace(r, index=i, block_hashes=tuple(span_hashes(r.spans, opts.block_size, root, memo)))
        for i, r in enumerate(rows)
    ]
    return Workload(
        name="mooncake",
        block_size=opts.block_size,
        requests=out,
        description=f"Mooncake trace {path.name}: {len(out)} requests, time / {scale:g}",
        salt=MOONCAKE_SALT,
        params={"path": str(path), "time_scale": scale},
    )


@dataclass(frozen=True, slots=True)
class AzureSessions:
    """How Azure requests (lengths only) are tied into conversations.

    Each request, with probability ``p_follow``, is the next turn of an open session picked
    uniformly among those whose context (last prompt + its output) is shorter than this
    request's prompt and whose last turn is at least ``min_gap_s`` old (the reply has to be
    generated and read first); its prompt is then that context followed by ``prompt - context``
    new tokens. Otherwise (or when no session fits) it opens a new session whose prompt is
    ``system_tokens`` of a shared system prompt (one of ``system_prompts``) and new tokens.
    A session closes after ``idle_s`` without a turn; at most ``max_open`` stay open (oldest
    dropped). Prompt lengths and arrivals are exactly the trace's.
    """

    p_follow: float = 0.5
    min_gap_s: float = 10.0
    idle_s: float = 600.0
    max_open: int = 512
    system_tokens: int = 0
    system_prompts: int = 1


@dataclass(slots=True)
class _Session:
    sid: int
    spans: list[Span]
    context: int  # prompt + output tokens
    last_s: float
    output_seg: int = 0
    output_tokens: int = 0
    turns: int = field(default=1)


def _azure_rows(path: Path) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        t0: datetime | None = None
        for rec in reader:
            ts = datetime.fromisoformat(rec["TIMESTAMP"].strip())
            if t0 is None:
                t0 = ts
            rows.append(((ts - t0).total_seconds(), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    rows.sort(key=lambda r: r[0])
    return rows


def load_azure(path: Path, opts: WorkloadOptions, model: AzureSessions | None = None) -> Workload:
    model = model or AzureSessions()
    root = opts.namespace().root()
    scale = opts.time_scale or 1.0
    rng = random.Random(opts.seed)
    open_: dict[int, _Session] = {}
    next_seg = 1 << 32  # segment ids: system prompts below, generated text above
    reqs: list[Request] = []
    for t, prompt, output in _azure_rows(path):
        prompt = max(1, prompt)
        while open_:  # ordered by last turn: expire from the oldest
            oldest = next(iter(open_.values()))
            if t - oldest.last_s <= model.idle_s:
                break
            del open_[oldest.sid]
        session: _Session | None = None
        if open_ and rng.random() < model.p_follow:
            fits = [s for s in open_.values() if s.context < prompt and t - s.last_s >= model.min_gap_s]
            if fits:
                session = rng.choice(fits)
        if session is not None:
            new = prompt - session.context
            spans = [*session.spans, (session.output_seg, session.output_tokens), (next_seg, new)]
            session.turns += 1
            del open_[session.sid]  # re-inserted below as the most recent
        else:
            sys_tokens = min(model.system_tokens, prompt)
            spans = [(rng.randrange(model.system_prompts), sys_tokens)] if sys_tokens else []
            if prompt > sys_tokens:
                spans.append((next_seg, prompt - sys_tokens))
            session = _Session(sid=len(reqs), spans=[], context=0, last_s=t)
        next_seg += 1
        spans = [(s, n) for s, n in spans if n > 0]
        session.spans = spans
        session.output_seg = next_seg
        next_seg += 1
        session.output_tokens = output
        session.context = prompt + output
        session.last_s = t
        open_[session.sid] = session
        while len(open_) > model.max_open:
            del open_[next(iter(open_))]
        reqs.append(
            Request(
                index=len(reqs),
                arrival_s=t / scale,
                prompt_tokens=prompt,
                block_hashes=(),
                output_tokens=output,
                session=session.sid,
                spans=tuple(spans),
            )
        )
    reqs = sample(reqs, opts)
    out = [
        replace(r, index=i, block_hashes=tuple(span_hashes(r.spans, opts.block_size, root)))
        for i, r in enumerate(reqs)
    ]
    return Workload(
        name="azure",
        block_size=opts.block_size,
        requests=out,
        description=f"Azure 2023 {path.name} with sessions (p_follow={model.p_follow}), time / {scale:g}",
        salt=AZURE_SALT,
        params={"path": str(path), "time_scale": scale, "sessions": asdict(model)},
    )
