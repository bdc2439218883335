"""``bench.detok_cost`` end to end: a table per stream kind and size, JSON as documented."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prefixgate.bench import detok_cost


def test_detok_cost_prints_a_row_per_stream_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "detok.json"
    assert detok_cost.main(["--sizes", "1024", "4096", "--max-seconds", "5", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert all(kind in table for kind in ("text", "out of vocabulary", "skipped specials", "partial UTF-8"))
    res = orjson.loads(out.read_bytes())["results"]
    assert [(r["kind"], r["size_bytes"]) for r in res][:2] == [("text", 1024), ("text", 4096)]
    assert len(res) == 8 and all(r["complete"] and r["us_per_token"] > 0 for r in res)
    oov = [r for r in res if r["kind"] == "out of vocabulary"]
    assert all(r["text_bytes"] == 3 * r["ids"] for r in oov)  # each shown as U+FFFD


def test_mounted_under_the_prefixgate_command() -> None:
    from prefixgate.cli import build_parser

    assert build_parser().parse_args(["bench", "detok", "--sizes", "1024"]).func is detok_cost.run
