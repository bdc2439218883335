"""Tenant accounting without I/O: prices from every settings source, values, bounds."""

from __future__ import annotations

from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry

from prefixgate.gateway.config import load_settings
from prefixgate.gateway.core import usage
from prefixgate.gateway.core.usage import Prices, UsageLedger, Value
from prefixgate.gateway.httpfront.usage_json import report_json
from prefixgate.gateway.state.memory import MemoryState
from prefixgate.gateway.state.store import UsageCounts


def test_prices_come_from_defaults_toml_env_and_flags(tmp_path: Path) -> None:
    s = load_settings(environ={})
    assert (s.price_input_miss, s.price_input_hit, s.price_output, s.price_currency) == (8.0, 2.0, 0.0, "CNY")
    toml = tmp_path / "g.toml"
    toml.write_text('price_input_miss = 4\nprice_currency = "USD"\n')
    s = load_settings(toml, environ={"PREFIXGATE_PRICE_INPUT_HIT": "1.5"}, overrides={"price_output": 12.0})
    assert (s.price_input_miss, s.price_input_hit, s.price_output, s.price_currency) == (
        4.0,
        1.5,
        12.0,
        "USD",
    )


def test_value_prices_computed_cached_and_output_tokens() -> None:
    c = UsageCounts(requests=3, prompt_tokens=4_000_000, cached_tokens=3_000_000, output_tokens=500_000)
    assert c.computed_tokens == 1_000_000
    assert Prices(8, 2, 10).value(c) == Value(input_miss=8.0, input_hit=6.0, output=5.0, total=19.0)


def test_a_request_adds_what_the_report_values_it_at() -> None:
    """The value counters take each request's parts as ``Prices.value`` gives them (rounded to 6
    places), clamped as the buffer is: negative counts are 0, cached at most the prompt."""
    prices = Prices(8, 2, 10)
    ledger = UsageLedger(MemoryState(), prices, CollectorRegistry())
    requests = [(520, 128, 8), (1, 0, 0), (7, 9, 3), (-5, -1, -2), (333_333, 3, 1), (0, 0, 0)]
    want = {"input_miss": 0.0, "input_hit": 0.0, "output": 0.0}
    for prompt, cached, output in requests:
        ledger.record("t", "m", prompt, cached, output)
        p = max(0, prompt)
        value = prices.value(UsageCounts(1, p, max(0, min(cached, p)), max(0, output)))
        for part, v in value.parts().items():
            want[part] += v
    for part, v in want.items():
        assert ledger.m_value.labels("t", "m", part).value == v, part
    assert ledger.m_computed.labels("t", "m").value == 520 - 128 + 1 + 0 + 0 + 333_330
    assert ledger.m_cached.labels("t", "m").value == 128 + 7 + 3
    # a price of 0 adds nothing to its part: no series is written
    free = UsageLedger(MemoryState(), Prices(8, 0, 0), CollectorRegistry())
    free.record("t", "m", 100, 50, 5)
    assert (
        free.m_value.labels("t", "m", "input_hit").value == 0 == free.m_value.labels("t", "m", "output").value
    )
    assert free.m_value.labels("t", "m", "input_miss").value == 0.0004


async def test_the_buffer_and_the_tenant_labels_are_bounded(monkeypatch: object) -> None:
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setattr(usage, "MAX_PENDING", 3)
    mp.setattr(usage, "MAX_TENANT_LABELS", 2)
    try:
        state = MemoryState()
        ledger = UsageLedger(state, Prices(), CollectorRegistry())
        for t in ("a", "b", "c", "d", "a"):
            ledger.record(t, "m", prompt=10, cached=20, output=1)  # cached is capped at the prompt
        assert ledger.dropped == 1 and set(ledger._pending) == {("a", "m"), ("b", "m"), ("c", "m")}
        assert ledger.m_prompt.labels("_other", "m").value == 20  # c and d
        await ledger.flush()
        assert await state.usage("a") == {("a", "m"): UsageCounts(2, 20, 20, 2)}
        assert ledger._pending == {}
    finally:
        mp.undo()


def test_the_admin_command_line_asks_for_one_tenant_and_renders_pins() -> None:
    from prefixgate.cli import build_parser
    from prefixgate.gateway.ops.admin_cli import plan_request, render_pins

    args = build_parser().parse_args(["admin", "usage", "--tenant", "acme corp"])
    method, path, body, _render = plan_request(args)
    assert (method, path, body) == ("GET", "/admin/usage?tenant=acme+corp", None)
    args = build_parser().parse_args(["admin", "pins"])
    assert plan_request(args)[:2] == ("GET", "/admin/cache/pins")
    (table,) = render_pins({"data": [{"tenant": "t", "node": "prefill-1", "blocks": 46, "until": 1e12}]})
    assert table.row_count == 1  # type: ignore[union-attr]


async def test_the_usage_answer_is_the_report_in_the_api_shape_key_for_key() -> None:
    ledger = UsageLedger(MemoryState(), Prices(8, 2, 16, "USD"), CollectorRegistry())
    ledger.record("b", "m", prompt=1_000_000, cached=500_000, output=1_000)
    answer = orjson.dumps(report_json(await ledger.report("b")))
    value = '"value":{"input_miss":4.0,"input_hit":1.0,"output":0.016,"total":5.016}'
    counts = (
        '"requests":1,"prompt_tokens":1000000,"cached_tokens":500000,"computed_tokens":500000,'
        '"output_tokens":1000'
    )
    assert answer.decode() == (
        '{"object":"usage","tenant":"b","prices":{"currency":"USD","per_million_tokens":'
        '{"input_miss":8,"input_hit":2,"output":16}},'
        f'"data":[{{"tenant":"b","model":"m",{counts},{value}}}],"totals":{{{counts},{value}}}}}'
    )
