"""What a ``grpc://`` engine reports is checked at the adapter: counts that are not sane (a wrapped
``uint32`` -1, cached tokens past the prompt) are dropped or clamped, finish reasons reach the
client as OpenAI's, and an engine that gave up (``abort``, ``error``) fails the attempt. The
engine is the scripted SGLang double on real gRPC, answering ``Generate`` with the test's script."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from prefixgate.cachetier.tokenizer import pack_ids
from prefixgate.gateway.nodeclient import NodeFailure, Prompt, reported
from prefixgate.gateway.nodeclient.smg_common import Output, SmgNodeClient, SmgOptions
from prefixgate.gateway.nodeclient.smg_vllm import VLLM
from prefixgate.gateway.vocab import FailureKind
from prefixgate.openai.schema import Sampling
from tests.smgwire import doubles
from tests.smgwire.conftest import HF

WRAPPED = 4294967295  # a uint32 -1
SENT = 20  # the prompt's ids, as the gateway sends them
TEXT = HF.encode("Hello there", add_special_tokens=False).ids


class Scripted(doubles.ScriptedSglang):
    """The double, answering every ``Generate`` with ``messages``."""

    def __init__(self) -> None:
        super().__init__(None)
        self.messages: list[Any] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for m in self.messages:
            yield m

    async def Abort(self, request: Any, context: Any) -> Any:
        return spb.AbortResponse()


def chunk(ids: list[int], prompt: int, completion: int, cached: int) -> Any:
    c = spb.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )
    return spb.GenerateResponse(chunk=c)


def complete(finish: str, prompt: int, completion: int, cached: int) -> Any:
    c = spb.GenerateComplete(
        finish_reason=finish, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )
    return spb.GenerateResponse(complete=c)


Engine = Callable[[list[Any]], Awaitable[SmgNodeClient]]


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    servers: list[Any] = []
    clients: list[SmgNodeClient] = []

    async def start(messages: list[Any]) -> SmgNodeClient:
        servicer = Scripted()
        servicer.messages = messages
        server, addr = await doubles.serve(doubles.add_sglang(servicer))
        servers.append(server)
        c = SmgNodeClient(f"grpc://{addr}", addr, SmgOptions(backend="sglang", codec=HF))
        clients.append(c)
        return c

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        await s.stop(0)


async def run(client: SmgNodeClient) -> tuple[str, str, int, int]:
    """(text, finish, completion tokens, cached tokens) of one generation."""
    stream = client.generate(
        Prompt("r", pack_ids(list(range(100, 100 + SENT))), [], Sampling(max_tokens=8)), timeout=5
    )
    text, finish, completion = "", "", 0
    async with asyncio.timeout(5):
        async for d in stream:
            text += d.text
            completion = d.completion_tokens or completion
            finish = d.finish_reason or finish
    await stream.aclose()
    return text, finish, completion, stream.cached_tokens


CASES: dict[str, tuple[list[Any], tuple[int, int]]] = {
    # messages -> (completion tokens, cached tokens) the gateway goes by
    "wrapped -1": ([chunk(TEXT, 20, 2, WRAPPED), complete("stop", 20, 2, WRAPPED)], (2, 0)),
    "past the engine's prompt": ([chunk(TEXT, 16, 2, 0), complete("stop", 16, 2, 18)], (2, 16)),
    "past the prompt sent": ([chunk(TEXT, 0, 2, 0), complete("stop", 0, 2, 500)], (2, SENT)),
    "completion wrapped": ([chunk(TEXT, 20, 2, 16), complete("stop", 20, WRAPPED, 16)], (2, 16)),
    "sane": ([chunk(TEXT, 20, 2, 16), complete("stop", 20, 2, 16)], (2, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_counts_that_are_not_sane_are_dropped_or_clamped(engine: Engine, case: str) -> None:
    messages, expected = CASES[case]
    text, finish, completion, cached = await run(await engine(messages))
    assert (text, finish) == ("Hello there", "stop")
    assert (completion, cached) == expected


@pytest.mark.parametrize(
    ("raw", "relayed"), [("length", "length"), ("eos", "stop"), ("made up", "stop"), ("", "stop")]
)
async def test_finish_reasons_reach_the_client_as_openais(engine: Engine, raw: str, relayed: str) -> None:
    _, finish, _, _ = await run(await engine([chunk(TEXT, 20, 2, 0), complete(raw, 20, 2, 0)]))
    assert finish == relayed


@pytest.mark.parametrize("raw", ["abort", "error"])
async def test_an_engine_that_gave_up_fails_the_attempt(engine: Engine, raw: str) -> None:
    with pytest.raises(NodeFailure) as info:
        await run(await engine([chunk(TEXT, 20, 2, 0), complete(raw, 20, 2, 0)]))
    assert info.value.kind == FailureKind.INTERNAL


def test_the_vllm_runtime_reads_counts_the_same_way() -> None:
    done = vpb.GenerateResponse(
        complete=vpb.GenerateComplete(prompt_tokens=26, cached_tokens=WRAPPED, completion_tokens=3)
    )
    out = VLLM.parse(done, 0)
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (26, 3, 0)
    delta = vpb.GenerateResponse(
        chunk=vpb.GenerateStreamChunk(
            token_ids=[1], prompt_tokens=26, completion_tokens=WRAPPED, cached_tokens=40
        )
    )
    out = VLLM.parse(delta, 5)  # a delta on top of 5: past the bound, dropped
    assert (out.completion_tokens, out.cached_tokens) == (0, 26)


COUNTS = st.one_of(
    st.integers(min_value=-2, max_value=40),
    st.sampled_from([WRAPPED, reported.MAX_TOKEN_COUNT, reported.MAX_TOKEN_COUNT + 1]),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(COUNTS, COUNTS, COUNTS)
def test_a_responses_counts_are_what_the_check_keeps(prompt: Any, completion: Any, cached: Any) -> None:
    # the response skips the check where it would change nothing: it must keep what the check keeps
    out = Output(False, [], 0, prompt, completion, cached)
    u = reported.checked(prompt, completion, cached)
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (
        u.prompt or 0,
        u.completion or 0,
        u.cached or 0,
    )
