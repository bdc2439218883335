"""Tenant usage on the embedded store: ``/admin/usage``, ``/v1/usage``, the counters and the CLI
agree with what the responses reported."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.admin.conftest import ADMIN_TOKEN, MODEL, AdminStack, chat
from tests.helpers import REPO, document


def _totals(stack: AdminStack) -> dict[str, Any]:
    with stack.admin() as c:
        r = c.get("/admin/usage", params={"tenant": ""})
    assert r.status_code == 200, r.text
    totals: dict[str, Any] = r.json()["totals"]
    return totals


def _metric(stack: AdminStack, name: str) -> float:
    with stack.http() as c:
        text = c.get("/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_usage_counts_what_the_engines_reported(stack: AdminStack) -> None:
    before = _totals(stack)
    prompt_metric = _metric(stack, "prefixgate_tenant_prompt_tokens_total")
    text = document(71, 900)
    docs = [{"id": "usage-doc", "text": text}]
    got = [chat(stack, [{"role": "user", "content": f"q{i}"}], docs).json()["usage"] for i in range(2)]
    with stack.http() as c:
        warm = c.post("/v1/prefill", json={"model": MODEL, "prompt": document(72, 300)})
    assert warm.status_code == 200, warm.text
    (node,) = warm.json()["nodes"]
    after = _totals(stack)
    prompt = sum(u["prompt_tokens"] for u in got) + node["cached_tokens"] + node["computed_tokens"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in got) + node["cached_tokens"]
    assert got[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert after["requests"] - before["requests"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["output_tokens"] - before["output_tokens"] == sum(u["completion_tokens"] for u in got)
    assert after["value"]["total"] > before["value"]["total"]
    assert _metric(stack, "prefixgate_tenant_prompt_tokens_total") - prompt_metric == prompt
    with stack.http() as c:  # keyless: the caller's tenant is the one shared tenant
        own = c.get("/v1/usage").json()
        assert c.get("/admin/usage", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert own["totals"]["prompt_tokens"] >= after["prompt_tokens"]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixgate.cli",
            "admin",
            "usage",
            "--url",
            stack.root,
            "--token",
            ADMIN_TOKEN,
        ],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "Usage" in cli.stdout and MODEL in cli.stdout and "CNY" in cli.stdout


def test_n_choices_count_one_request_and_the_prompt_once(stack: AdminStack) -> None:
    before = _totals(stack)
    got = chat(stack, [{"role": "user", "content": document(73, 200)}], n=2, temperature=1).json()
    after = _totals(stack)
    assert len(got["choices"]) == 2
    usage = got["usage"]
    assert after["requests"] - before["requests"] == 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == usage["prompt_tokens"]
    assert after["cached_tokens"] - before["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert after["computed_tokens"] - before["computed_tokens"] == (
        usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    )
    assert after["output_tokens"] - before["output_tokens"] == usage["completion_tokens"]
