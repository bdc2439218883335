"""``prefixgate bench chaos``: the seeded schedule keeps a node of each role up and repairs every
fault; a short run on our own protocol prints its table, runs the whole schedule, and ends with
every node back and nothing in flight."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prefixgate.bench import chaos
from prefixgate.cli import build_parser

PREFILL, DECODE = ["prefill-1", "prefill-2"], ["decode-1", "decode-2", "decode-3", "decode-4"]


@pytest.mark.parametrize("seconds", [6.0, 120.0])
def test_plan_never_downs_a_whole_role_and_repairs_every_fault(seconds: float) -> None:
    for seed in range(40):
        events = chaos.plan(seed, seconds, PREFILL, DECODE)
        assert events == chaos.plan(seed, seconds, PREFILL, DECODE)  # seeded
        assert [e.at_s for e in events] == sorted(e.at_s for e in events)
        assert [e.at_s for e in events if e.action == "redis"] == [seconds * 0.5]
        assert all(0 < e.at_s <= seconds * 0.85 for e in events)
        faults = [e for e in events if e.action in chaos.FAULTS]
        assert {e.action for e in faults} == set(chaos.FAULTS)
        assert {e.target for e in faults} & set(PREFILL) and {e.target for e in faults} & set(DECODE)
        down: set[str] = set()
        for e in events:
            if e.action in chaos.FAULTS:
                assert e.target not in down
                down.add(e.target)
            elif e.action != "redis":
                assert e.target in down and e.action in chaos.FAULTS.values()
                down.remove(e.target)
            assert not set(PREFILL) <= down and not set(DECODE) <= down, (seed, e)
        assert not down  # every node back


def test_short_run_prints_the_table_and_runs_the_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chaos.json"
    # 4 s at 3 clients and a 3 s settle: the whole schedule (3 faults, a Redis restart) in CI time
    argv = ["bench", "chaos", "--seconds", "4", "--protocol", "prefixgate", "--concurrency", "3"]
    args = build_parser().parse_args([*argv, "--settle", "3", "--json", str(out)])
    rc = args.func(args)
    text = capsys.readouterr().out
    assert "chaos: prefixgate protocol, 4 s" in text and "TTFT p99" in text, text
    assert "after settling: in flight 0 (nodes 0)" in text, text
    (res,) = orjson.loads(out.read_bytes())
    assert rc == (0 if res["rows"]["all"]["failed"] == 0 and not res["leaks"] else 1)
    assert res["rows"]["all"]["requests"] > 12
    assert res["schedule_errors"] == 0, res["schedule"]
    # every planned event ran, or was skipped with its repair (no other node of its role up)
    actions = sorted(e["action"] for e in res["schedule"])
    assert actions == sorted(e.action for e in chaos.plan(1, 4.0, PREFILL, DECODE)), actions
    ran = {e["action"] for e in res["schedule"] if not e["skipped"]}
    assert "redis" in ran and ran & set(chaos.FAULTS), res["schedule"]
    assert res["end"]["inflight"] == 0 and res["end"]["node_inflight"] == 0
    # every node came back on its address: the gateway holds a connection to each again
    assert all(res["end"]["kinds"].get(f"tcp to {n}", 0) >= 1 for n in PREFILL + DECODE), res["end"]
