"""Workload record types: what every workload source produces and the simulator consumes.

Kept apart from the loaders (``bench.workloads``) so trace readers and generators can import the
types without importing the dispatcher that imports them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixgate.bench.textgen import Span, spans_text
from prefixgate.cachetier.hashing import Namespace

TRACE_FORMATS = ("mooncake", "azure")
GENERATED_FORMATS = ("rag", "chat", "agent", "longdoc")
FORMATS = TRACE_FORMATS + GENERATED_FORMATS


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    arrival_s: float
    prompt_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks, root first
    output_tokens: int
    session: int = -1
    spans: tuple[Span, ...] = ()  # trace workloads: the prompt as text segments (text built on demand)
    body: Mapping[str, Any] | None = None  # generated workloads: the OpenAI chat request
    tenant: str = ""  # who sent it, for the scheduler's fair share ("": the traces have one sender)


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """How to read or generate a workload. ``time_scale`` > 1 compresses time (arrivals / X)."""

    block_size: int = 64
    time_scale: float = 1.0
    limit: int | None = None  # keep the first N requests (after sampling)
    fraction: float | None = None  # keep each request with this probability (seeded)
    seed: int = 0
    normalize: bool = True  # generated workloads: render with normalization on
    model: str = "prefixgate-sim"
    tenant: str = ""
    requests: int | None = None  # generated workloads: how many (default per format)
    rate: float | None = None  # generated workloads: mean arrivals per second (before time_scale)

    def namespace(self) -> Namespace:
        return Namespace(model=self.model, tenant=self.tenant, block_size=self.block_size)


@dataclass(slots=True)
class Workload:
    name: str
    block_size: int
    requests: list[Request]
    description: str = ""
    salt: str = ""  # text salt of span segments
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def openai_body(self, req: Request, model: str, *, stream: bool = True) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) to send ``req`` to an OpenAI-compatible server.

        Trace requests become ``/v1/completions`` with the segment text as the prompt: the
        completion renderer keeps ASCII text byte for byte, so block boundaries stay where the
        trace put them. Generated requests are chat requests as generated.
        """
        if req.body is not None:
            body = dict(req.body)
            body["model"] = model
            body["stream"] = stream
            return "/v1/chat/completions", body
        return "/v1/completions", {
            "model": model,
            "prompt": spans_text(req.spans, self.salt),
            "max_tokens": max(1, req.output_tokens),
            "stream": stream,
        }


def sample(requests: Sequence[Request], opts: WorkloadOptions) -> list[Request]:
    """Seeded fraction then first N; renumbers and keeps arrival order."""
    out = list(requests)
    if opts.fraction is not None and opts.fraction < 1.0:
        rng = random.Random(opts.seed)
        out = [r for r in out if rng.random() < opts.fraction]
    if opts.limit is not None:
        out = out[: opts.limit]
    return out
