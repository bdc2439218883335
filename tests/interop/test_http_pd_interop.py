"""Interop with routers nobody here wrote, in PD mode over HTTP: ``sglang-router`` 0.3.2
(``--pd-disaggregation``: the same body with ``bootstrap_host/port/room`` to a prefill and a
decode node at once) and ``vllm-router`` 0.1.17 (``--vllm-pd-disaggregation``: prefill with
``kv_transfer_params.do_remote_decode`` and ``max_tokens: 1``, then decode with the params the
prefill answered) in front of our tiny-engine nodes' HTTP endpoints, answering the ``openai``
client streamed and not with the greedy text the node gives directly.

The routers are never project dependencies. Each is taken from the peers' scratch venv
(``$PEERS`` or ``$TMPDIR/prefixgate-peers``, ``venv-sglang`` / ``venv-vllmr``) when it exists,
else from ``$XDG_CACHE_HOME/prefixgate/<package>-<version>`` (default ``~/.cache``), where this
test installs it with pip (about 15 s) when missing. Without any of that the test skips, saying
why, except under CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import REPO, free_port, spawn, wait_answered

pytestmark = pytest.mark.timeout(300)

TINY = "tiny:preset=small"
BS = 16
MODEL = "prefixgate-tiny"
LONG = "Tell me about prefix caches, KV pages and the tokens they hold, in some detail. " * 3


@dataclass(frozen=True)
class Router:
    name: str
    package: str
    version: str
    venv: str  # the peers' scratch venv name
    argv: tuple[str, ...]  # after the venv's bin dir: how to launch it


ROUTERS = {
    "sglang": Router(
        "sglang", "sglang-router", "0.3.2", "venv-sglang", ("python", "-m", "sglang_router.launch_router")
    ),
    "vllm": Router("vllm", "vllm-router", "0.1.17", "venv-vllmr", ("vllm-router",)),
}


def _venv(r: Router) -> Path:
    """The venv the router runs from: this one (the dev extras install the routers), else the
    peers' scratch venv; never installed at test time (the test is skipped, failed on CI)."""
    for venv in (
        Path(sys.prefix),
        Path(os.environ.get("PEERS") or Path(tempfile.gettempdir()) / "prefixgate-peers") / r.venv,
    ):
        if (venv / "bin" / r.argv[0]).exists() and (
            r.name != "sglang" or any(venv.glob("lib/python*/site-packages/sglang_router"))
        ):
            return venv
    reason = f"{r.package} {r.version} is not installed (pip install -e '.[dev]')"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _start(argv: list[str]) -> Child:
    return processes.start(Path(argv[0]).name, argv, cwd=REPO)


@dataclass
class NodeInfo:
    proc: Child
    url: str
    bootstrap_port: int = 0

    def prompt_tokens(self) -> int:
        """What this node prefilled in all (its ``/metrics``)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("prefixgate_node_prompt_tokens_total "):
                return int(float(line.split()[1]))
        raise AssertionError("no prompt token counter in /metrics")


def _node(role: str, *args: str) -> NodeInfo:
    cmd = [sys.executable, "-m", "prefixgate.backends", "--role", role, "--port", "0", "--engine", TINY]
    cmd += ["--block-size", str(BS), "--http-port", "0", "--http-model", MODEL, "--ready-line"]
    p = _start([*cmd, "--log-level", "warning", *args])
    try:
        m = p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=90)
    except BaseException:
        p.stop(timeout=10)
        raise
    ready = json.loads(m.group(1))
    return NodeInfo(p, f"http://{ready['http_address']}", int(ready.get("bootstrap_port") or 0))


@dataclass
class Cluster:
    monolithic: NodeInfo
    prefill: NodeInfo
    decode: NodeInfo


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started: list[NodeInfo] = []
    try:
        for role, extra in (("monolithic", ()), ("prefill", ("--bootstrap-port", "0")), ("decode", ())):
            started.append(_node(role, *extra))
        yield Cluster(*started)
    finally:
        for n in started:
            n.proc.stop(timeout=10)


def _router_argv(r: Router, venv: Path, c: Cluster, port: int, prom: int) -> list[str]:
    head = [str(venv / "bin" / r.argv[0]), *r.argv[1:], "--host", "127.0.0.1", "--port", str(port)]
    head += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--policy", "round_robin"]
    if r.name == "sglang":
        pd = ["--pd-disaggregation", "--prefill", c.prefill.url, str(c.prefill.bootstrap_port)]
        return [*head, "--shutdown-grace-period-secs", "1", *pd, "--decode", c.decode.url]
    return [*head, "--vllm-pd-disaggregation", "--prefill", c.prefill.url, "--decode", c.decode.url]


def _wait_routed(base: str, proc: Child, timeout: float = 60.0) -> None:
    wait_answered(base, proc, MODEL, timeout=timeout)


@pytest.fixture(scope="module")
def routers(cluster: Cluster) -> Iterator[Callable[[str], str]]:
    """``routers(name)``: the base URL of that router in front of the module's PD pair, started
    on first use and shared by the module's tests."""
    started: dict[str, tuple[Child, str]] = {}

    def get(name: str) -> str:
        if name not in started:
            r = ROUTERS[name]
            t0 = time.monotonic()
            venv = _venv(r)
            print(f"{r.package} {r.version}: {venv} (found or installed in {time.monotonic() - t0:.1f}s)")
            port, prom = free_port(), free_port()
            p = _start(_router_argv(r, venv, cluster, port, prom))
            base = f"http://127.0.0.1:{port}"
            try:
                _wait_routed(base, p)
            except BaseException:
                p.stop(timeout=10)
                raise
            started[name] = (p, base)
        return started[name][1]

    try:
        yield get
    finally:
        for p, _ in started.values():
            p.stop(timeout=10)


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def router(request: pytest.FixtureRequest, routers: Callable[[str], str]) -> str:
    return routers(str(request.param))


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(base: str, content: str, stream: bool) -> tuple[str, str, int, int]:
    """(text, finish_reason, completion_tokens, cached_tokens) of a greedy chat completion."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": content}]
    c = _client(base)
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens or 0
        return (
            r.choices[0].message.content or "",
            r.choices[0].finish_reason,
            r.usage.completion_tokens,
            cached,
        )
    s = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", "", None
    for chunk in s:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return text, finish, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_the_router_serves_pd_with_the_nodes_own_text_and_reports_the_cache(
    router: str, cluster: Cluster
) -> None:
    # a prompt of its own per router, apart from its first tokens on (the routers' URLs share
    # "http://127.0.0.1:", a whole block of the node's tokenizer): the first time is a miss
    content = f"{secrets.token_hex(8)} {LONG}"
    direct = _ask(cluster.monolithic.url, content, stream=False)
    assert direct[0] and direct[1:3] == ("length", 12)
    decode_prefilled = cluster.decode.prompt_tokens()
    prefilled = cluster.prefill.prompt_tokens()

    first = _ask(router, content, stream=False)
    assert first[:3] == direct[:3] and first[3] == 0
    streamed = _ask(router, content, stream=True)
    assert streamed[:3] == direct[:3]
    assert streamed[3] >= BS  # the repeated prompt's full blocks were reused on the prefill node

    assert cluster.prefill.prompt_tokens() > prefilled  # the prefill node computed the prompts
    assert cluster.decode.prompt_tokens() == decode_prefilled  # the decode node only decoded


Choice = tuple[int, str, list[tuple[str, float, list[tuple[str, float]]]]]


def _choices(r: httpx.Response) -> list[Choice]:
    """(index, text, [(token, logprob, [(top token, top logprob)])]) of each choice, by index."""
    assert r.status_code == 200, r.text
    out = []
    for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
        lps = [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in c["logprobs"]["content"]
        ]
        out.append((c["index"], c["message"]["content"], lps))
    return out


def _within_an_ulp(got: list[Choice], want: list[Choice]) -> bool:
    """The same choices, tokens and log probabilities, each value within one unit in the last
    place: sglang-router re-encodes the numbers it relays after a best-effort (not exactly
    rounded) parse, which can move a value by its last bit."""

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= math.ulp(b)

    def flat(cs: list[Choice]) -> tuple[list[Any], list[float]]:
        keys: list[Any] = []
        values: list[float] = []
        for index, text, lps in cs:
            keys.append((index, text))
            for token, v, top in lps:
                keys.append((token, [t for t, _ in top]))
                values += [v, *(tv for _, tv in top)]
        return keys, values

    (gk, gv), (wk, wv) = flat(got), flat(want)
    return gk == wk and len(gv) == len(wv) and all(close(a, b) for a, b in zip(gv, wv, strict=True))


def test_n_with_logprobs_through_prefixgate_as_through_sglang_router(
    routers: Callable[[str], str], cluster: Cluster
) -> None:
    """``n=2`` with log probabilities over SGLang's PD: sglang-router sends ``n`` to both nodes in
    one request (with a bootstrap room per choice; the nodes run the choices), prefixgate runs a
    PD pair per choice; the same choices, tokens and log probabilities either way, the node's own."""
    sglang = routers("sglang")
    port = free_port()
    pd = [
        "--prefill",
        cluster.prefill.url,
        str(cluster.prefill.bootstrap_port),
        "--decode",
        cluster.decode.url,
    ]
    gw = spawn(["gateway", "--port", str(port), "--grpc-port", str(free_port()), *pd, "--backend", "sglang"])
    gateway = f"http://127.0.0.1:{port}"
    try:
        _wait_routed(gateway, gw)
        # no trailing space: prefixgate's normalization (on by default) would strip it from the prompt
        content = f"{secrets.token_hex(8)} {LONG.strip()}"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        url = "/v1/chat/completions"
        ((_, text, lps),) = _choices(httpx.post(cluster.monolithic.url + url, json=body, timeout=60))
        assert text and len(lps) == 6 and all(len(top) == 2 for _, _, top in lps)
        want = [(0, text, lps), (1, text, lps)]  # greedy: both choices are the node's one answer
        two = {**body, "n": 2}
        got = {base: httpx.post(base + url, json=two, timeout=60) for base in (sglang, gateway)}
        assert got[gateway].headers["x-prefixgate-route"] == "disaggregated"
        through_gateway, through_router = _choices(got[gateway]), _choices(got[sglang])
        assert through_gateway == want  # prefixgate relays the node's values exactly
        assert _within_an_ulp(through_router, through_gateway)
        usage = {base: r.json()["usage"] for base, r in got.items()}
        assert usage[sglang]["completion_tokens"] == usage[gateway]["completion_tokens"] == 12
        assert usage[sglang]["prompt_tokens"] == usage[gateway]["prompt_tokens"] > 0
    finally:
        gw.stop(timeout=10)
