"""``bench.replay`` and ``bench.hotpath`` end to end: table printed, JSON shaped as documented."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prefixgate.bench import hotpath, replay


def test_replay_mooncake_slice_writes_the_documented_json(
    mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    rc = replay.main(
        ["--trace", str(mooncake_trace), "--limit", "300", "--block-size", "512", "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "prefixgate" in text and "bound: global LRU" in text
    report = orjson.loads(out.read_bytes())
    assert set(report["policies"]) == set(replay.DEFAULT_POLICIES)
    for fig in report["policies"].values():
        for key in ("hit_rate", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "imbalance", "prefill_tokens"):
            assert key in fig
        assert fig["requests"] == 300
    assert 0.0 < report["bound"]["hit_rate"] <= report["bound"]["unbounded_hit_rate"] + 1e-9
    assert report["workload"]["name"] == "mooncake" and report["workload"]["time_scale"] == 10.0
    assert report["config"]["capacity_blocks"] == replay.DEFAULT_CAPACITY_TOKENS // 512


def test_replay_generated_with_and_without_normalization(tmp_path: Path) -> None:
    out = tmp_path / "rag.json"
    args = ["--format", "rag", "--requests", "300", "--normalize", "both", "--policies", "prefixgate"]
    assert replay.main([*args, "--json", str(out)]) == 0
    report = orjson.loads(out.read_bytes())
    on = report["policies"]["prefixgate"]["hit_rate"]
    off = report["without_normalization"]["policies"]["prefixgate"]["hit_rate"]
    assert on > off
    assert replay.main(["--format", "rag", "--policies", "nope", "--requests", "10"]) == 2


def test_hotpath_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "hot.json"
    assert hotpath.main(["--sizes", "1024", "8192", "--iterations", "5", "--json", str(out)]) == 0
    res = orjson.loads(out.read_bytes())["results"]
    assert [r["target_tokens"] for r in res] == [1024, 8192]
    assert all(r["total_p50_ms"] > 0 and r["blocks"] == r["prompt_tokens"] // 64 for r in res)


def test_mounted_under_the_prefixgate_command() -> None:
    from prefixgate.cli import build_parser

    args = build_parser().parse_args(["bench", "replay", "--format", "rag", "--requests", "5"])
    assert args.func is replay.run and args.requests == 5
    assert build_parser().parse_args(["bench", "hotpath", "--sizes", "1024"]).func is hotpath.run
