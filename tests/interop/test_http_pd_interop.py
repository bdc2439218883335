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
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers import REPO, Proc, free_port

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
    peers = Path(os.environ.get("PEERS") or Path(tempfile.gettempdir()) / "prefixgate-peers") / r.venv
    if (peers / "bin" / r.argv[0]).exists():
        return peers
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixgate"
    venv = cache / f"{r.package}-{r.version}"
    if (venv / "bin" / r.argv[0]).exists() and (venv / ".installed").exists():
        return venv
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True, timeout=120
        )
        pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, f"{r.package}=={r.version}"], check=True, capture_output=True, timeout=300)
        (venv / ".installed").touch()
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        reason = (
            f"{r.package} {r.version} is not installed and pip could not install it: {e} {detail[-300:]!r}"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return venv


def _start(argv: list[str]) -> Proc:
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    p = Proc(proc)
    p.start_reader()
    return p


@dataclass
class NodeInfo:
    proc: Proc
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


def _wait_routed(base: str, proc: Proc, timeout: float = 60.0) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.proc.poll() is None:
        try:
            if httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    tail = "\n".join(list(proc.lines)[-30:])
    raise TimeoutError(f"router at {base} never routed a request (exit={proc.proc.poll()}):\n{tail}")


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def router(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[str]:
    r = ROUTERS[request.param]
    t0 = time.monotonic()
    venv = _venv(r)
    print(f"{r.package} {r.version}: {venv} (found or installed in {time.monotonic() - t0:.1f}s)")
    port, prom = free_port(), free_port()
    p = _start(_router_argv(r, venv, cluster, port, prom))
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_routed(base, p)
        yield base
    finally:
        p.stop(timeout=10)


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
