"""Benchmark workloads: one request record for traces and generated traffic alike.

A ``Request`` carries what the simulator needs (arrival time, prompt size, block hashes,
output size) and what a live driver needs to send it (``Workload.openai_body``). Formats:

- ``mooncake``: the Mooncake trace, ids turned into deterministic text (``bench.traces``);
- ``azure``: Azure 2023 lengths and arrivals with a sessions model (``bench.traces``);
- ``rag``, ``chat``, ``agent``, ``longdoc``: generated OpenAI chat requests rendered through
  ``prefixgate.openai.normalize`` (``bench.generated``).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixgate.bench import generated, traces
from prefixgate.bench.workload_types import (
    FORMATS,
    GENERATED_FORMATS,
    TRACE_FORMATS,
    Request,
    Workload,
    WorkloadOptions,
    sample,
)


def traces_dir() -> Path:
    """``$PREFIXGATE_TRACES``, else ``<repo>/../shared/traces`` (where CI puts them)."""
    env = os.environ.get("PREFIXGATE_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


DEFAULT_TRACES = {
    "mooncake": "mooncake/conversation_trace.jsonl",
    "azure": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
}


def load_workload(fmt: str, path: str | Path | None = None, opts: WorkloadOptions | None = None) -> Workload:
    """Read a trace or generate a workload. ``path`` defaults to the shared trace of the format."""
    opts = opts or WorkloadOptions()
    if fmt in TRACE_FORMATS:
        p = Path(path) if path else traces_dir() / DEFAULT_TRACES[fmt]
        if fmt == "mooncake":
            return traces.load_mooncake(p, opts)
        return traces.load_azure(p, opts)
    if fmt in GENERATED_FORMATS:
        return generated.generate(fmt, opts)
    raise ValueError(f"unknown workload format {fmt!r}; choose from {', '.join(FORMATS)}")


def guess_format(path: str | Path) -> str:
    name = str(path).lower()
    if name.endswith(".csv"):
        return "azure"
    if name in GENERATED_FORMATS:
        return name
    return "mooncake"


__all__ = [
    "DEFAULT_TRACES",
    "FORMATS",
    "GENERATED_FORMATS",
    "TRACE_FORMATS",
    "Request",
    "Workload",
    "WorkloadOptions",
    "guess_format",
    "load_workload",
    "sample",
    "traces_dir",
]
