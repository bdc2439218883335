"""The profile reader charges each sampled stack to the right stage of the request path."""

from __future__ import annotations

from pathlib import Path

from prefixgate.bench import stages

LOOP = "run (/v/lib/python3.11/asyncio/runners.py:190);Runner.run (/v/lib/python3.11/asyncio/runners.py:118)"


def _raw(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "p.raw"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_innermost_meaningful_frame_names_the_stage() -> None:
    stack = [
        "Runner.run (/v/lib/python3.11/asyncio/runners.py:118)",
        "run_asgi (/v/site-packages/uvicorn/protocols/http/httptools_impl.py:401)",
        "finished (/w/gateway/core/accounting.py:60)",
        "inc (/v/site-packages/prometheus_client/metrics.py:300)",
        "__enter__ (/v/lib/python3.11/contextlib.py:137)",
    ]
    assert stages.classify(stack) == "metrics"
    assert stages.classify(stack[:3]) == "pipeline"
    assert stages.classify(stack[:2]) == "HTTP parsing"
    assert stages.classify(stack[:1]) == stages.NATIVE


def test_function_rules_need_their_file() -> None:
    assert stages.classify(["_stream (/w/gateway/httpfront/app.py:180)"]) == "response framing"
    assert stages.classify(["_stream (/w/gateway/other.py:1)"]) == stages.NATIVE


def test_breakdown_shares_count_the_loop_thread_only(tmp_path: Path) -> None:
    raw = _raw(
        tmp_path,
        [
            f"{LOOP};_sse (/w/gateway/httpfront/app.py:70) 3",
            f"{LOOP} 1",
            "_bootstrap (/v/threading.py:1002);Thread.run (/v/threading.py:982) 5",
        ],
    )
    b = stages.breakdown(raw)
    assert b["samples"] == 4
    assert b["stages"]["response framing"]["share"] == 0.75
    assert b["stages"][stages.NATIVE]["share"] == 0.25
    assert b["stages"][stages.OTHER_THREAD]["samples"] == 5
    assert b["stages"][stages.OTHER_THREAD]["share"] == 0.0
