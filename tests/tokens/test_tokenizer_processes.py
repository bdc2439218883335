"""Long uncached text is tokenized by child processes (``gateway.tokenpool``): the ids are a
plain encode's; a child killed or hung in the middle of a request is replaced and the request's
text tokenized by its caller instead; closing the pool (and stopping the gateway) ends every
child; and a gateway preparing a long cold chat tokenizes none of it in its own process, nor on
its event loop, which answers ``/healthz`` all along."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.service import GatewayService
from prefixgate.gateway.httpfront.app import create_app
from prefixgate.gateway.tokenpool import pool as pool_module
from prefixgate.gateway.tokenpool.pool import TokenizerPool
from prefixgate.gateway.tokens import open_tokenizer_dir
from prefixgate.gateway.tokens.segments import REMOTE_FROM
from tests.tokenpools import DIGEST, started_pool

CALL_BASE_S = pool_module.CALL_BASE_S

HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
PIECES = st.sampled_from(
    [" ", "\n", "the", " cat", "9", "12.5", "é", "日本", "🙂", "<|im_start|>", "<|im_end|>", "\t", "!!"]
)


def plain(text: str) -> bytes:
    return pack_ids(HF.encode(text, add_special_tokens=False).ids)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(n))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def pool() -> Iterator[TokenizerPool]:
    with started_pool(2) as p:
        yield p


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(PIECES, min_size=0, max_size=600).map("".join), min_size=1, max_size=5))
def test_a_childs_ids_equal_a_plain_encode(pool: TokenizerPool, texts: list[str]) -> None:
    assert pool.encode_many(texts) == [plain(t) for t in texts]


def test_a_long_chat_is_tokenized_by_a_child_as_a_plain_encode(pool: TokenizerPool) -> None:
    tok = open_tokenizer_dir(TOKENIZER_DIR)
    tok.segments.remote = pool
    doc = words(20_000, 1)
    assert len(doc) >= REMOTE_FROM
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": words(300, 2) + " <|im_end|>"}]
    before = pool.stats.calls
    layout, tokens = tok.encode_chat(chat)
    assert tokens == plain(layout.text) and pool.stats.calls == before + 1
    assert tok.encode_chat(chat)[1] == tokens  # the cache (in this process) answers the second
    assert pool.stats.calls == before + 1


def test_the_event_loop_never_waits_for_a_child(pool: TokenizerPool) -> None:
    async def on_the_loop() -> list[bytes] | None:
        return pool.encode_many([words(20_000, 3)])

    assert asyncio.run(on_the_loop()) is None


def busy_child(p: TokenizerPool, timeout: float = 10.0) -> int:
    """The pid of a child in the middle of a request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with p._cond:
            if p._busy:
                return next(iter(p._busy)).pid
        time.sleep(0.001)
    raise AssertionError("no child took the request")


def test_a_child_killed_mid_request_is_replaced_and_its_text_tokenized_here() -> None:
    p = TokenizerPool(TOKENIZER_DIR, DIGEST, 1)
    tok = open_tokenizer_dir(TOKENIZER_DIR)
    tok.segments.remote = p
    try:
        assert p.start(wait_s=30)
        text = words(120_000, 4)  # some 300K tokens: a child takes a while over it
        with ThreadPoolExecutor(1) as ex:
            answer = ex.submit(tok.encode, text)
            victim = busy_child(p)
            os.kill(victim, signal.SIGKILL)
            assert answer.result(timeout=30) == plain(text)
        assert p.stats.failed == 1 and victim not in p.pids and gone(victim)
        assert p.start(wait_s=30)  # the replacement, started when the child was found dead
        calls = p.stats.calls
        assert tok.segments.fresh([words(20_000, 5)]) == [plain(words(20_000, 5))]
        assert p.stats.calls == calls + 1
    finally:
        p.close()


def test_a_hung_child_is_killed_at_its_deadline_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    # a short deadline, so that the hung child is found out within the test; its replacement is
    # then held to the default one (a loaded machine took longer than 0.3 s to encode the text)
    monkeypatch.setattr(pool_module, "CALL_BASE_S", 0.3)
    p = TokenizerPool(TOKENIZER_DIR, DIGEST, 1)
    try:
        assert p.start(wait_s=30)
        (hung,) = p.pids
        os.kill(hung, signal.SIGSTOP)
        text = words(20_000, 6)
        t0 = time.monotonic()
        assert p.encode_many([text]) is None  # the caller tokenizes it
        assert 0.3 <= time.monotonic() - t0 < 3.0
        assert p.stats.failed == 1 and gone(hung)
        assert p.start(wait_s=30) and hung not in p.pids
        monkeypatch.setattr(pool_module, "CALL_BASE_S", CALL_BASE_S)  # the replacement, at the default
        assert p.encode_many([text]) == [plain(text)]
    finally:
        p.close()


def test_close_ends_every_child_busy_or_idle() -> None:
    p = TokenizerPool(TOKENIZER_DIR, DIGEST, 2)
    tok = open_tokenizer_dir(TOKENIZER_DIR)
    tok.segments.remote = p
    assert p.start(wait_s=30)
    pids = p.pids
    text = words(120_000, 7)
    with ThreadPoolExecutor(1) as ex:
        answer = ex.submit(tok.encode, text)
        busy_child(p)
        t0 = time.monotonic()
        p.close(timeout=2.0)
        assert time.monotonic() - t0 < 3.0
        assert answer.result(timeout=30) == plain(text)  # the busy child's caller did it itself
    assert all(gone(pid) for pid in pids) and p.pids == []
    assert p.encode_many([text]) is None


class Recording:
    """A ``tokenizers.Tokenizer`` that notes each encode: on the event loop's thread? how long?"""

    def __init__(self, hf: Any, loop_thread: int) -> None:
        self._hf, self._loop_thread = hf, loop_thread
        self.calls: list[tuple[bool, int]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._hf, name)
        if not name.startswith("encode"):
            return attr

        def encode(texts: Any, *args: Any, **kwargs: Any) -> Any:
            size = len(texts) if isinstance(texts, str) else sum(len(t) for t in texts)
            self.calls.append((threading.get_ident() == self._loop_thread, size))
            return attr(texts, *args, **kwargs)

        return encode


async def test_a_gateway_prepares_a_long_cold_chat_in_a_child_and_answers_healthz() -> None:
    svc = GatewayService(Settings(tokenizer_path=str(TOKENIZER_DIR)))
    await svc.start()
    app = httpx.ASGITransport(app=create_app(svc))
    http = httpx.AsyncClient(transport=app, base_url="http://gw", timeout=30)
    tok = svc.tokenizer
    (p,) = svc.tokenizer_pools
    recording = Recording(tok.segments._hf, threading.get_ident())  # type: ignore[attr-defined]
    tok.segments._hf = recording  # type: ignore[attr-defined]
    # Between two answers of /healthz, asked every 10 ms: the longest time, and the most CPU the
    # event loop's thread spent. The CPU is what work on the loop holds it for; the time also
    # counts the turns the machine gave other processes (a suite of four workers on two cores
    # left this thread unscheduled for a third of a second once).
    worst = worst_cpu = 0.0

    async def probe() -> None:
        nonlocal worst, worst_cpu
        last, last_cpu = time.monotonic(), time.thread_time()
        while True:
            assert (await http.get("/healthz")).status_code == 200
            now, now_cpu = time.monotonic(), time.thread_time()
            worst, last = max(worst, now - last), now
            worst_cpu, last_cpu = max(worst_cpu, now_cpu - last_cpu), now_cpu
            await asyncio.sleep(0.01)

    def chat(seed: int) -> dict[str, Any]:
        text = words(25_000, seed)  # some 100K tokens, one message
        return {"model": svc.settings.default_model, "messages": [{"role": "user", "content": text}]}

    try:
        assert await asyncio.to_thread(p.start, 30)
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        r = await http.post("/v1/chat/completions", json=chat(8))
        await asyncio.sleep(0.05)  # a probe after the request, which sees any stall it missed
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        pids = p.pids
    finally:
        await http.aclose()
        await svc.stop()
    assert r.status_code == 503  # prepared, then no node to serve it
    assert p.stats.calls == 1  # the chat's text went to a child
    assert all(size < REMOTE_FROM for _, size in recording.calls)  # none of it was tokenized here
    assert not any(on_loop for on_loop, _ in recording.calls)
    assert worst_cpu < 0.1, (worst_cpu, worst)
    assert pids and all(gone(pid) for pid in pids)  # the service's stop ended its children


def test_children_that_load_another_tokenizer_disable_the_pool() -> None:
    # The gateway's digest stands for its own tokenizer.json; children that load another file
    # (here: the digest of different bytes) must never tokenize for it.
    p = TokenizerPool(TOKENIZER_DIR, hashlib.sha256(b"another tokenizer").hexdigest(), 2)
    try:
        assert not p.start(wait_s=30)  # disabled once the first child said which file it loaded
        assert p.encode_many([words(20_000, 7)]) is None  # the caller tokenizes
        assert p.pids == []  # every child stopped
        assert p.stats.calls == 0
    finally:
        p.close()
