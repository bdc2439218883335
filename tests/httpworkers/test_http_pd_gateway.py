"""prefixgate in front of HTTP workers in PD mode: ``--prefill http://H:P [BOOTSTRAP] --decode
http://H:P --backend sglang|vllm`` over our tiny-engine nodes' HTTP endpoints (which speak both
engines' PD over HTTP), answering the real ``openai`` client, streamed and not, with the greedy
text the node gives whole and the text sglang-router / vllm-router give through the same nodes
(their install and launch are the interop test's, ``tests/interop/test_http_pd_interop.py``).

The prefill work happens on the prefill node only (its prompt-token counter moves, the decode
node's does not); a repeated prompt reports the prefill node's cached tokens; a client that goes
away ends both legs; a prefill node killed under the gateway costs no request (the gateway falls
back) and a killed decode node none either (its partner serves), each blamed alone; pools that
cannot hand KV to each other are refused at startup.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from openai import OpenAI

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import REPO, free_port, spawn
from tests.interop.test_http_pd_interop import (
    BS,
    LONG,
    MODEL,
    ROUTERS,
    TINY,
    Cluster,
    NodeInfo,
    _ask,
    _router_argv,
    _start,
    _venv,
    _wait_routed,
)

pytestmark = pytest.mark.timeout(300)


def _spawn_node(role: str, *args: str) -> Child:
    cmd = [sys.executable, "-m", "prefixgate.backends", "--role", role, "--port", "0", "--engine", TINY]
    cmd += ["--block-size", str(BS), "--http-port", "0", "--http-model", MODEL, "--ready-line"]
    return _start([*cmd, "--log-level", "warning", *args])


def _ready(p: Child) -> NodeInfo:
    m = p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=120)
    ready = json.loads(m.group(1))
    return NodeInfo(p, f"http://{ready['http_address']}", int(ready.get("bootstrap_port") or 0))


def _nodes(*roles: str) -> list[NodeInfo]:
    """Nodes started together (prefill nodes with a bootstrap port), each once ready."""
    procs = [_spawn_node(r, *(("--bootstrap-port", "0") if r == "prefill" else ())) for r in roles]
    try:
        return [_ready(p) for p in procs]
    except BaseException:
        for p in procs:
            p.stop(timeout=10)
        raise


@pytest.fixture(scope="module")
def nodes() -> Iterator[Cluster]:
    started = _nodes("monolithic", "prefill", "decode")
    try:
        yield Cluster(*started)
    finally:
        for n in started:
            n.proc.stop(timeout=10)


def _gateway(args: list[str], env: dict[str, str] | None = None) -> tuple[Child, str]:
    port = free_port()
    # The nodes render messages as sent (a real engine does): so does the gateway, for equal text.
    env = {"PREFIXGATE_NORMALIZATION": "false", **(env or {})}
    p = spawn(["gateway", "--port", str(port), "--grpc-port", str(free_port()), *args], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_routed(base, p)
    except BaseException:
        p.stop(timeout=10)
        raise
    return p, base


def _pd_args(prefill: NodeInfo, decode: NodeInfo, backend: str) -> list[str]:
    return [
        "--prefill",
        prefill.url,
        str(prefill.bootstrap_port),
        "--decode",
        decode.url,
        "--backend",
        backend,
    ]


@dataclass
class Pair:
    backend: str
    gateway: str
    router: str


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def pair(request: pytest.FixtureRequest, nodes: Cluster) -> Iterator[Pair]:
    """prefixgate and the backend's own router, both in front of the same PD pair."""
    backend = str(request.param)
    r = ROUTERS[backend]
    venv = _venv(r)
    port, prom = free_port(), free_port()
    router = _start(_router_argv(r, venv, nodes, port, prom))
    gateway: Child | None = None
    try:
        _wait_routed(f"http://127.0.0.1:{port}", router)
        gateway, base = _gateway(_pd_args(nodes.prefill, nodes.decode, backend))
        yield Pair(backend, base, f"http://127.0.0.1:{port}")
    finally:
        if gateway is not None:
            gateway.stop(timeout=10)
        router.stop(timeout=10)


def test_the_gateway_serves_pd_like_the_router_and_the_node(pair: Pair, nodes: Cluster) -> None:
    content = f"(prefixgate {pair.backend}) {LONG}"  # its own prompt: the first time is a miss
    direct = _ask(nodes.monolithic.url, content, stream=False)
    assert direct[0] and direct[1:3] == ("length", 12)
    decode_prefilled = nodes.decode.prompt_tokens()
    prefilled = nodes.prefill.prompt_tokens()

    first = _ask(pair.gateway, content, stream=False)
    assert first[:3] == direct[:3]
    assert first[3] == 0
    routed = _ask(pair.router, content, stream=True)
    assert routed[:3] == direct[:3]
    streamed = _ask(pair.gateway, content, stream=True)
    assert streamed[:3] == direct[:3]
    assert streamed[3] >= BS  # the repeated prompt's full blocks were reused on the prefill node

    text = OpenAI(base_url=f"{pair.gateway}/v1", api_key="unused", max_retries=0, timeout=60)
    whole = OpenAI(base_url=f"{nodes.monolithic.url}/v1", api_key="unused", max_retries=0, timeout=60)
    got, want = (
        c.completions.create(model=MODEL, prompt=content, max_tokens=8, temperature=0) for c in (text, whole)
    )
    assert got.choices[0].text == want.choices[0].text and got.choices[0].text

    assert nodes.prefill.prompt_tokens() > prefilled  # the prefill node computed the prompts
    assert nodes.decode.prompt_tokens() == decode_prefilled  # the decode node only decoded


def test_a_closed_stream_ends_both_legs(pair: Pair, nodes: Cluster) -> None:
    """A client that goes away mid-stream: nothing keeps running on either node."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"(gone {pair.backend}) {LONG}"}],
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60, trust_env=False) as c,
        c.stream("POST", f"{pair.gateway}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert got
        assert _running(nodes.decode) >= 1  # still decoding while the client reads
    deadline = time.monotonic() + 20
    load = {}
    while time.monotonic() < deadline:
        load = {n.url: _running(n) for n in (nodes.prefill, nodes.decode)}
        if not any(load.values()):
            break
        time.sleep(0.2)
    assert not any(load.values()), f"requests still running after the client left: {load}"


def _running(n: NodeInfo) -> int:
    obj = httpx.get(f"{n.url}/get_load", timeout=5, trust_env=False).json()
    ranks = obj if isinstance(obj, list) else [obj]
    return sum(int(r.get("num_reqs") or 0) for r in ranks)


@pytest.mark.parametrize("backend", sorted(ROUTERS))
def test_a_killed_prefill_node_fails_no_request(backend: str, nodes: Cluster) -> None:
    (prefill,) = _nodes("prefill")
    gateway: Child | None = None
    try:
        # Probes far apart: the first request after the kill meets the dead node itself.
        slow_probes = {"PREFIXGATE_STATS_INTERVAL_S": "30"}
        gateway, base = _gateway(_pd_args(prefill, nodes.decode, backend), slow_probes)
        content = f"(killed {backend}) {LONG}"
        direct = _ask(nodes.monolithic.url, content, stream=False)
        assert _ask(base, content, stream=True)[:3] == direct[:3]
        prefill.proc.stop(signal.SIGKILL, timeout=10)
        answers = [_ask(base, content, stream=i % 2 == 0) for i in range(4)]
        assert [a[:3] for a in answers] == [direct[:3]] * 4  # served (by the decode node, whole)
        failed = [json.loads(line) for line in gateway.lines if '"node_attempt_failed"' in line]
        assert failed and all(f["node"] == prefill.url.removeprefix("http://") for f in failed), failed
        assert {f["stage"] for f in failed} == {"prefill"}
        listed = httpx.get(f"{base}/admin/nodes", timeout=5, trust_env=False).json()["data"]
        by_role = {n["role"]: n for n in listed}
        assert by_role["decode"]["last_error"] is None  # never blamed for its partner's death
        assert by_role["decode"]["circuit"] == "closed"
        assert by_role["prefill"]["last_error"]
        metrics = httpx.get(f"{base}/metrics", timeout=5, trust_env=False).text
        assert 'prefixgate_fallbacks_total{reason="split_failed"}' in metrics or (
            'prefixgate_fallbacks_total{reason="unavailable"}' in metrics
        )
    finally:
        if gateway is not None:
            gateway.stop(timeout=10)
        prefill.proc.stop(timeout=10)


@pytest.mark.parametrize("backend", sorted(ROUTERS))
def test_a_killed_decode_node_is_blamed_and_its_partner_serves(backend: str, nodes: Cluster) -> None:
    decodes = _nodes("decode", "decode")
    gateway: Child | None = None
    try:
        slow_probes = {"PREFIXGATE_STATS_INTERVAL_S": "30"}
        args = [*_pd_args(nodes.prefill, decodes[0], backend), "--decode", decodes[1].url]
        gateway, base = _gateway(args, slow_probes)
        content = f"(decode killed {backend}) {LONG}"
        # The node the gateway decodes this prompt on (it stays its choice: the pair is idle) dies.
        doomed = _decoded_on(base, content)
        (dead,) = [d for d in decodes if d.url == f"http://{doomed}"]
        direct = _ask(nodes.monolithic.url, content, stream=False)
        dead.proc.stop(signal.SIGKILL, timeout=10)
        for i in range(4):
            assert _ask(base, content, stream=i % 2 == 1)[:3] == direct[:3]
        failed = [json.loads(line) for line in gateway.lines if '"node_attempt_failed"' in line]
        assert failed, "the dead decode node was never tried"
        assert {(f["node"], f["stage"]) for f in failed} == {(doomed, "decode")}
    finally:
        if gateway is not None:
            gateway.stop(timeout=10)
        for d in decodes:
            d.proc.stop(timeout=10)


def _decoded_on(base: str, content: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.headers["x-prefixgate-decode-node"]


def _refused(*args: str) -> str:
    r = subprocess.run(
        processes.prefixgate("gateway", "--port", "0", *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--prefill", "http://127.0.0.1:9", "--decode", "grpc://127.0.0.1:10", "--backend", "sglang"],
            "--prefill http:// workers cannot be paired with --decode grpc://127.0.0.1:10",
        ),
        (
            [
                "--prefill",
                "grpc://127.0.0.1:9",
                "8998",
                "--decode",
                "http://127.0.0.1:10",
                "--backend",
                "vllm",
            ],
            "--decode http:// workers cannot be paired with --prefill grpc://127.0.0.1:9",
        ),
        (
            ["--prefill", "127.0.0.1:9", "--decode", "http://127.0.0.1:10"],
            "--decode http:// workers cannot be paired with --prefill 127.0.0.1:9",
        ),
        (
            ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"],
            "--prefill and --decode http:// workers need --backend sglang or vllm",
        ),
    ],
)
def test_pools_that_cannot_hand_kv_over_are_refused_at_startup(args: list[str], said: str) -> None:
    assert said in _refused(*args)


def _choices_and_logprobs(r: httpx.Response) -> list[tuple[str, list[tuple[str, float, int]]]]:
    assert r.status_code == 200, r.text
    out = []
    for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
        lps = [(e["token"], round(e["logprob"], 5), len(e["top_logprobs"])) for e in c["logprobs"]["content"]]
        out.append((c["message"]["content"], lps))
    return out


def test_n_choices_with_logprobs_over_sglang_pd(nodes: Cluster) -> None:
    """n=2 with logprobs through a PD pair (greedy: both choices are the node's one answer)."""
    content = f"(n with logprobs) {LONG}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    (want,) = _choices_and_logprobs(
        httpx.post(f"{nodes.monolithic.url}/v1/chat/completions", json=body, timeout=60, trust_env=False)
    )
    assert want[0] and len(want[1]) == 6 and all(top == 2 for _, _, top in want[1])
    gateway, base = _gateway(_pd_args(nodes.prefill, nodes.decode, "sglang"))
    try:
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "n": 2}, timeout=60, trust_env=False)
        assert r.headers["x-prefixgate-route"] == "disaggregated"
        assert _choices_and_logprobs(r) == [want, want]
    finally:
        gateway.stop(timeout=10)
