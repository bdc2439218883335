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
    """``$PREFIXGATE_TRACES``, else ``<repo>/../shared/traces`` (where CI puts them; bench/README.md,
    "Traces")."""
    env = os.environ.get("PREFIXGATE_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


DEFAULT_TRACES = {
    "mooncake": "mooncake/conversation_trace.jsonl",
    "azure": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
}
TRACE_NAMES = {"mooncake": "Mooncake conversation", "azure": "Azure LLM inference 2023"}


class TraceMissing(FileNotFoundError):
    """A trace file that is not there; its message is one line saying where traces come from, so a
    benchmark run without the public traces ends with a hint, not a traceback."""


def trace_path(fmt: str, path: str | Path | None = None) -> Path:
    """The trace file of ``fmt``: ``path``, else the public trace under ``traces_dir()``."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise TraceMissing(f"no trace file at {p} (--trace)")
        return p
    p = traces_dir() / DEFAULT_TRACES[fmt]
    if not p.is_file():
        raise TraceMissing(
            f"no {TRACE_NAMES[fmt]} trace at {p}: set PREFIXGATE_TRACES to the directory holding "
            f'{DEFAULT_TRACES[fmt]}, or pass --trace FILE (bench/README.md, "Traces")'
        )
    return p


def load_workload(fmt: str, path: str | Path | None = None, opts: WorkloadOptions | None = None) -> Workload:
    """Read a trace or generate a workload. ``path`` defaults to the shared trace of the format."""
    opts = opts or WorkloadOptions()
    if fmt in TRACE_FORMATS:
        p = trace_path(fmt, path)
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
    "TraceMissing",
    "Workload",
    "WorkloadOptions",
    "guess_format",
    "load_workload",
    "sample",
    "trace_path",
    "traces_dir",
]
