"""Interop with a client nobody here wrote: ``smg`` 1.13.0 (the SGLang model gateway) in front of
our tiny-engine nodes over the SMG gRPC engine protocol, single pool and PD, answering the
``openai`` client streamed and not, with the text our nodes produce for the same tokens.

``smg`` is never a project dependency; the dev extras install it. It runs as ``$PREFIXGATE_SMG``
(path of an ``smg`` executable), else as its own module beside this interpreter (``python -m
smg``), else as the ``smg`` on ``PATH``; the test skips, saying why, when none of that works (fails
on CI). Not the ``smg`` script beside the interpreter: sglang-router, also in the dev extras,
installs a script of that name too (its own router), and whichever package is installed last owns
it.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import grpc
import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.ops import processes
from prefixgate.gateway.ops.processes import Child
from tests.helpers import REPO, free_port, wait_answered

SMG_VERSION = "1.13.0"
TINY = "tiny:preset=small"
BS = 16
MODEL = "prefixgate-tiny"
HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
LONG = "Tell me about prefix caches, KV pages and the tokens they hold, in some detail. " * 3


def _smg_executable() -> tuple[str, ...]:
    """The command that runs smg: ``$PREFIXGATE_SMG``, else smg's module in this interpreter,
    else the ``smg`` on PATH; never installed at test time (the test is skipped, failed on CI)."""
    explicit = os.environ.get("PREFIXGATE_SMG")
    if explicit:
        return (explicit,)
    if importlib.util.find_spec("smg") is not None:
        return (sys.executable, "-m", "smg")
    found = shutil.which("smg")
    if found:
        return (found,)
    reason = f"smg {SMG_VERSION} is not installed (pip install -e '.[dev]')"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _start(argv: list[str], env: dict[str, str] | None = None) -> Child:
    return processes.start(Path(argv[0]).name, argv, env=env, cwd=REPO)


def _node(*args: str) -> tuple[Child, dict[str, object]]:
    cmd = [
        sys.executable,
        "-m",
        "prefixgate.backends",
        "--port",
        "0",
        "--engine",
        TINY,
        "--block-size",
        str(BS),
    ]
    p = _start([*cmd, "--log-level", "warning", *args])
    m = p.wait_for(r'^(\{"event": "node_ready".*\})$', timeout=60)
    return p, json.loads(m.group(1))


def _wait_routed(base: str, proc: Child, timeout: float = 90.0) -> None:
    wait_answered(base, proc, MODEL, timeout=timeout)


def _smg(exe: tuple[str, ...], *workers: str, env: dict[str, str] | None = None) -> tuple[Child, str]:
    port, prom = free_port(), free_port()
    argv = [*exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    argv += ["--prometheus-port", str(prom), "--log-level", "warn", "--shutdown-grace-period-secs", "1"]
    p = processes.start("smg", [*argv, *workers], env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_routed(base, p)
    except BaseException:
        p.stop(timeout=10)
        raise
    return p, base


@pytest.fixture(scope="module")
def smg_exe() -> tuple[str, ...]:
    t0 = time.monotonic()
    exe = _smg_executable()
    print(f"smg {SMG_VERSION}: {' '.join(exe)} (found in {time.monotonic() - t0:.1f}s)")
    return exe


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, dict[str, object]]]:
    procs: list[Child] = []
    try:
        # its OpenAI endpoint too, under the engine's model name (the endpoint's own default
        # name is the simulated engine's)
        mono_p, mono = _node("--role", "monolithic", "--http-port", "0", "--http-model", MODEL)
        procs.append(mono_p)
        pre_p, pre = _node("--role", "prefill", "--bootstrap-port", "0")
        procs.append(pre_p)
        dec_p, dec = _node("--role", "decode")
        procs.append(dec_p)
        yield {"monolithic": mono, "prefill": pre, "decode": dec}
    finally:
        for p in procs:
            p.stop(timeout=10)


def _p50_ms(fn: object, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[n // 2]


def _direct(address: str, content: str, max_new: int) -> str:
    """Greedy text of our node for the chat, rendered with the shipped template (what smg does)."""
    rendered = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    ids = HF.encode(rendered, add_special_tokens=False).ids
    req = pb.GenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new),
    )
    with grpc.insecure_channel(address) as ch:
        out = [m.complete for m in pb_grpc.SglangSchedulerStub(ch).Generate(req, timeout=30)]
    return str(HF.decode(list(out[-1].output_ids)))


def _check_openai(base: str, expected: str) -> None:
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert first.choices[0].message.content == expected and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == expected
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0  # the repeated prompt hit the prefix cache


def test_smg_single_pool_in_front_of_our_nodes(
    smg_exe: tuple[str, ...], nodes: dict[str, dict[str, object]]
) -> None:
    address = str(nodes["monolithic"]["address"])
    expected = _direct(address, LONG, 12)
    proc, base = _smg(smg_exe, "--worker-urls", f"grpc://{address}", "--policy", "cache_aware")
    try:
        _check_openai(base, expected)
        # one small measurement, printed (-s): a cached 12-token chat, direct vs through smg
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 12,
            "temperature": 0,
        }
        with httpx.Client(timeout=30) as http:
            via = _p50_ms(lambda: http.post(f"{base}/v1/chat/completions", json=body).raise_for_status())
        direct = _p50_ms(lambda: _direct(address, LONG, 12))
        print(f"p50 of 20 (cached prompt, 12 tokens): direct gRPC {direct:.1f} ms, through smg {via:.1f} ms")
    finally:
        proc.stop(timeout=15)


BURST = 24
HUB_STALL_S = 6.0  # how long the stand-in Hugging Face Hub holds each request it gets
BURST_BOUND_S = 4.0  # far above a healthy burst (well under a second), below one Hub stall


class _StalledHub(http.server.BaseHTTPRequestHandler):
    """A Hugging Face Hub that is there but never answers in time (as one offline, or behind a
    slow resolver, is): it counts the requests it gets and holds each for ``HUB_STALL_S``."""

    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        time.sleep(HUB_STALL_S)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def _stalled_hub() -> Iterator[tuple[str, list[str]]]:
    class Hub(_StalledHub):
        hits: ClassVar[list[str]] = []  # this server's own

    hits = Hub.hits
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


async def _burst(base: str) -> list[float]:
    async def one(client: httpx.AsyncClient, i: int) -> float:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i} {LONG}"}], "max_tokens": 2}
        t0 = time.monotonic()
        (await client.post(f"{base}/v1/chat/completions", json=body)).raise_for_status()
        return time.monotonic() - t0

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=BURST)) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(BURST))))


def test_smg_answers_a_burst_of_chats_without_asking_the_hub(
    smg_exe: tuple[str, ...], nodes: dict[str, dict[str, object]]
) -> None:
    """smg reads the model's ``config.json`` from the tokenizer source on every chat (does the
    model take media?) and, when the directory has none, takes it for a Hugging Face repo id and
    asks the Hub, one request at a time. Our tokenizer directory ships one, so a burst of chats
    never waits on the Hub (here a loopback stand-in that stalls, via ``HF_ENDPOINT``)."""
    address = str(nodes["monolithic"]["address"])
    with _stalled_hub() as (hub, hits):
        env = {"HF_ENDPOINT": hub, "HF_HUB_OFFLINE": "0"}
        proc, base = _smg(smg_exe, "--worker-urls", f"grpc://{address}", "--policy", "cache_aware", env=env)
        try:
            times = asyncio.run(_burst(base))
        finally:
            proc.stop(timeout=15)
    print(f"burst of {BURST} through smg: max {max(times):.3f} s")
    assert hits == []
    assert max(times) < BURST_BOUND_S, sorted(times)


def test_smg_pd_in_front_of_our_prefill_and_decode_nodes(
    smg_exe: tuple[str, ...], nodes: dict[str, dict[str, object]]
) -> None:
    pre, dec = nodes["prefill"], nodes["decode"]
    expected = _direct(str(dec["address"]), LONG, 12)
    workers = ["--pd-disaggregation", "--prefill", f"grpc://{pre['address']}", str(pre["bootstrap_port"])]
    workers += ["--decode", f"grpc://{dec['address']}", "--policy", "cache_aware"]
    proc, base = _smg(smg_exe, *workers)
    try:
        _check_openai(base, expected)
    finally:
        proc.stop(timeout=15)
