"""Boot docker-compose.yml without Docker and use it like a laptop user would.

Every prefixgate service runs its compose ``command`` and ``environment`` as a local process
(``topology.local_plan`` rewrites only addresses: ``redis:6379`` is the local Redis, each node's
``host:50051`` a free loopback port); a private key prefix keeps this stack's index apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.compose.localrun import LocalCompose
from tests.compose.topology import REPO, container_ports, load_compose, local_plan, services
from tests.helpers import document, free_port

pytestmark = pytest.mark.redis

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "prefixgate.json"
PROMPT_TOKENS = 4_000  # the default tokenizer counts 4 bytes a token


def _redis() -> redis.Redis:
    """The local Redis; under CI=true its absence fails the tests instead of skipping them."""
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        client.close()
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true and no Redis at {REDIS_HOST}:{REDIS_PORT}: {e}")
        pytest.skip(f"no Redis at {REDIS_HOST}:{REDIS_PORT}: {e}")
    return client


def _keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=prefix + "*", count=1000))


@dataclass
class Booted:
    root: str  # http://127.0.0.1:PORT
    prefix: str  # this stack's Redis key prefix
    redis: redis.Redis
    stack: LocalCompose
    boot_s: float

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.root + "/v1", api_key="unused", max_retries=0, timeout=60)


def _wait_ready(root: str, timeout: float) -> dict[str, Any]:
    """/readyz answers 200 once the gateway sees routable nodes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(root + "/readyz", timeout=5)
            last = r.text
            if r.status_code == 200:
                body: dict[str, Any] = r.json()
                return body
        time.sleep(0.2)
    raise TimeoutError(f"gateway not ready after {timeout}s: {last}")


@pytest.fixture(scope="module")
def booted() -> Iterator[Booted]:
    client = _redis()
    compose = load_compose()
    prefix = f"pgtest:compose:{uuid.uuid4().hex[:12]}:"
    port_map = {(n, p): free_port() for n, s in services(compose).items() for p in container_ports(s, {})}
    port_map[("redis", 6379)] = REDIS_PORT
    plan = local_plan(compose, port_map, host_env={}, extra_env={"PREFIXGATE_REDIS_PREFIX": prefix})
    stack = LocalCompose(plan, external={"redis": lambda: bool(client.ping())})
    root = f"http://127.0.0.1:{port_map[('gateway', 8000)]}"
    t0 = time.perf_counter()
    try:
        stack.up(timeout=60)
        _wait_ready(root, timeout=30)
        yield Booted(root, prefix, client, stack, time.perf_counter() - t0)
    finally:
        codes = stack.down()
        leaked = stack.leaked()
        for name in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(stack.procs[name].proc.pid, signal.SIGKILL)
        keys = _keys(client, prefix)
        if keys:
            client.delete(*keys)
        remaining = _keys(client, prefix)
        client.close()
    assert not leaked, f"processes left running: {leaked}"
    crashed = {n: rc for n, rc in codes.items() if rc not in (0, -signal.SIGTERM)}
    assert not crashed, f"services did not stop cleanly on SIGTERM: {crashed}"
    assert not remaining, f"Redis keys left under {prefix}: {len(remaining)}"


def test_openai_client_gets_a_cache_hit_through_the_compose_stack(booted: Booted) -> None:
    client = booted.client()
    model = client.models.list().data[0].id
    messages: Any = [
        {"role": "system", "content": "Answer from the report."},
        {"role": "user", "content": document(7, PROMPT_TOKENS) + "\n\nWhat does the report say?"},
    ]
    first = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=8)
    answer = first.parse()
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens >= PROMPT_TOKENS
    assert first.headers["x-prefixgate-route"] == "disaggregated"
    assert first.headers["x-prefixgate-prefill-node"] in ("prefill-1", "prefill-2")  # the compose node ids
    # The index lives in Redis under this stack's prefix.
    assert _keys(booted.redis, booted.prefix), "the gateway wrote nothing to the Redis index"

    cached = 0
    for _ in range(20):  # the index is written off the request path: allow it a moment
        again = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens or 0
        if cached > 0:
            break
        time.sleep(0.25)
    assert cached > 0, "the repeated prompt found no cached tokens"
    assert cached >= answer.usage.prompt_tokens // 2, (cached, answer.usage.prompt_tokens)


def _exported_series(text: str) -> tuple[set[str], dict[str, float]]:
    """Every series name the exposition allows (by family type) and each sample's summed value."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created", ""),
        "gauge": ("",),
    }
    names: set[str] = set()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        for sample in family.samples:
            names.add(sample.name)
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return names, values


def test_dashboard_queries_name_metrics_the_gateway_exports(booted: Booted) -> None:
    client = booted.client()
    model = client.models.list().data[0].id
    for i in range(2):
        client.completions.create(model=model, prompt=document(100 + i, 600), max_tokens=4)
    text = httpx.get(booted.root + "/metrics", timeout=10).text
    exported, values = _exported_series(text)

    dashboard = json.loads(DASHBOARD.read_text())
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queried |= set(re.findall(r"\bprefixgate_[a-z0-9_]+\b", target["expr"]))
    assert queried, "the dashboard queries nothing"
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics the gateway does not export: {missing}"
    # The four numbers and the routing panel have data after a few requests.
    for series in (
        "prefixgate_ttft_seconds_count",
        "prefixgate_prefill_seconds_count",
        "prefixgate_kv_transfer_seconds_count",
        "prefixgate_prompt_tokens_total",
        "prefixgate_cached_tokens_total",
        "prefixgate_requests_total",
    ):
        assert values.get(series, 0) > 0, series


def test_every_service_passes_its_own_healthcheck(booted: Booted) -> None:
    """What Docker would run: the gateway's HTTP /healthz check and each node's gRPC health check."""
    for name in booted.stack.plan:
        assert booted.stack.check(name), name
