"""A benchmark run without the public traces ends with a one-line hint and a non-zero status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("argv", "trace"),
    [
        (["bench", "replay"], "mooncake/conversation_trace.jsonl"),
        (["bench", "replay", "--format", "azure"], "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"),
        (["bench", "peers", "--peers", ""], "mooncake/conversation_trace.jsonl"),
    ],
)
def test_a_missing_trace_is_one_line_saying_where_traces_come_from(
    argv: list[str], trace: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PREFIXGATE_TRACES": str(tmp_path), "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "prefixgate.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode != 0
    assert "Traceback" not in output
    lines = output.splitlines()
    assert len(lines) == 1, output
    assert str(tmp_path / trace) in lines[0]
    assert "PREFIXGATE_TRACES" in lines[0] and "--trace" in lines[0]
