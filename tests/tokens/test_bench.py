"""``bench hotpath --tokenizer-path``: the engine tokenizer's rows, shaped as documented."""

from __future__ import annotations

from pathlib import Path

import orjson

from prefixgate.bench import hotpath


def test_hotpath_times_the_engine_tokenizer(tmp_path: Path) -> None:
    out = tmp_path / "hot.json"
    args = ["--sizes", "1024", "4096", "--iterations", "3", "--tokenizer-path", "shipped", "--json", str(out)]
    assert hotpath.main(args) == 0
    rows = orjson.loads(out.read_bytes())["engine"]
    assert [(r["cache"], r["target_tokens"]) for r in rows] == [
        (cache, n) for n in (1024, 4096) for cache in ("none (whole text)", "cold", "repeated docs")
    ]
    for r in rows:  # about the size asked for, in the model's own tokens
        assert 0.8 * r["target_tokens"] <= r["prompt_tokens"] <= 1.2 * r["target_tokens"]
        assert r["blocks"] == r["prompt_tokens"] // 64 and r["tokenize_p50_ms"] > 0
