"""A model's chat template is bounded: a render that runs away stops itself at its deadline or
output bound (``TemplateLimitError``), and the gateway renders off its event loop, so a template
running to its bound never holds ``/healthz``; the client gets a 500 ``server_error`` (the
template, not the request, is at fault)."""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
from pathlib import Path

import httpx
import pytest

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.gateway.tokens import ChatTemplate, TemplateLimitError
from prefixgate.gateway.tokens.template import MAX_INT_BITS, RENDER_TIMEOUT_S

# The runaway cases stop at any deadline; 0.2 s instead of the shipped RENDER_TIMEOUT_S keeps them
# quick (one test renders at the shipped deadline through the gateway).
SHORT_S = 0.2
CHAT = [{"role": "user", "content": "hi"}]

RUNAWAY = {
    # nested loops whose body calls nothing: only the loop guard sees them
    "loops": "{% set xs = range(1000) | list %}"
    "{% for a in xs %}{% for b in xs %}{% for c in xs %}{% endfor %}{% endfor %}{% endfor %}",
    # a loop that calls (each call checks the deadline)
    "calls": "{% for a in range(100000) %}{% for b in range(100000) %}{{ ''.strip() }}"
    "{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "loop recursion": "{% for m in [[1]] recursive %}{{ loop([m]) }}{% endfor %}",
}


@pytest.mark.parametrize("case", list(RUNAWAY))
def test_a_runaway_template_stops_itself_at_its_deadline(case: str) -> None:
    template = ChatTemplate(RUNAWAY[case], timeout_s=SHORT_S)
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError):
        template.render(CHAT)
    # left alone each would run for minutes; 2 s of margin absorbs a loaded machine's unwinding
    assert time.monotonic() - t0 < SHORT_S + 2.0


ONE_OP = {
    "a string times a huge number": "{{ 'x' * 10 ** 10 }}",
    "a list times a huge number": "{{ [1, 2] * 10 ** 9 }}",
    "a huge power": "{{ 10 ** (10 ** 8) }}",  # jinja's ** groups to the left
    "squaring on": "{% set ns = namespace(n=3) %}"
    "{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
}


@pytest.mark.parametrize("case", list(ONE_OP))
def test_one_operation_past_the_bounds_is_refused_before_it_runs(case: str) -> None:
    template = ChatTemplate(ONE_OP[case], timeout_s=SHORT_S)
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match="over"):
        template.render(CHAT)
    assert time.monotonic() - t0 < 0.5


def test_the_output_is_bounded_while_it_is_rendered() -> None:
    template = ChatTemplate("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", max_chars=1 << 20)
    with pytest.raises(TemplateLimitError, match=f"renders over {1 << 20} characters"):
        template.render(CHAT)


def test_ordinary_arithmetic_and_loops_render_as_before() -> None:
    source = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ m.content * 2 }}"
        "{% if not loop.last %},{% endif %}{% endfor %}|{{ 2 ** 10 }}|{{ 7 * 6 }}|{{ [0] * 3 }}"
        "{% for x in missing %}never{% else %}empty{% endfor %}"
    )
    out = ChatTemplate(source).render([{"content": "a"}, {"content": "b"}])
    assert out == "1/2:aa,2/2:bb|1024|42|[0, 0, 0]empty" and MAX_INT_BITS >= 1 << 10


def test_the_deadline_at_its_real_value() -> None:
    """The bound as shipped: a template that would run for minutes stops just past it."""
    template = ChatTemplate(RUNAWAY["loops"])
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=f"more than {RENDER_TIMEOUT_S:g} s"):
        template.render(CHAT)
    took = time.monotonic() - t0
    assert RENDER_TIMEOUT_S <= took < RENDER_TIMEOUT_S + 0.5, took


# 10^8 loop steps: several seconds of rendering where nothing bounds it, past the deadline.
SLOW = (
    "{% for a in range(1000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
)


async def test_a_slow_template_never_holds_healthz_and_is_a_500(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(SLOW)
    svc = GatewayService(Settings(tokenizer_path=str(tmp_path)))
    await svc.start()
    # The gateway's process freezes its heap once started (gateway.ops.server), so a full
    # collection never walks it. Served in the test's process, the heap is the whole test run's
    # (every module and value of the tests before this one: a full collection of 4 million
    # objects takes 0.3 s of an idle core), and a pause of it would be counted here as the loop
    # held. Frozen here as the gateway freezes its own.
    gc.freeze()
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(svc)), base_url="http://gw", timeout=30
    )
    worst = 0.0  # the longest time between two answers of /healthz, asked every 20 ms

    async def probe() -> None:
        nonlocal worst
        last = time.monotonic()
        while True:
            r = await http.get("/healthz")
            assert r.status_code in (200, 503)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
            await asyncio.sleep(0.02)

    try:
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        body = {"model": svc.settings.default_model, "messages": CHAT, "max_tokens": 1}
        async with asyncio.timeout(8):
            r = await http.post("/v1/chat/completions", json=body)
        took = time.monotonic() - t0
        await asyncio.sleep(0.1)  # a probe after the request, which sees any stall it missed
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
    finally:
        await http.aclose()
        await svc.stop()
        gc.unfreeze()
    error = r.json()["error"]
    assert r.status_code == 500 and error["type"] == "server_error" and error["code"] == "chat_template_limit"
    assert "chat template" in error["message"] and "not the request" in error["message"]
    assert took < RENDER_TIMEOUT_S + 1.0, took
    assert worst < 0.5, worst  # the loop answered all along
