"""The SMG gRPC transport of split serving (``handoff``): the legs of a (prefill, decode) pair of
``grpc://`` workers. Each leg is one Generate call whose request the runtime built
(``smg_sglang``, ``smg_vllm``); ending one early is ``Abort`` and then the call cancelled
(docs/engines.md, Aborts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from prefixgate.gateway.nodeclient.base import NodeClient, NodeFailure, Prompt
from prefixgate.gateway.nodeclient.handoff import PairFactory, PrefillAnswer
from prefixgate.gateway.nodeclient.smg_common import (
    GenerateStream,
    Output,
    Runtime,
    SmgNodeClient,
    failure,
)
from prefixgate.gateway.nodeclient.smg_prompt import EngineRequest
from prefixgate.gateway.vocab import FailureKind, Stage

DETECT_TIMEOUT_S = 5.0


class SmgPrefillLeg:
    """A prefill leg read to its ``complete`` (a relay's one token, a bootstrap's end after the
    hand-off): the prefix it reused, and the transfer parameters it returned. ``request``: the
    leg's serialized request; ``whole``: it asks for one ``complete`` (``stream=false``)."""

    def __init__(
        self,
        client: SmgNodeClient,
        request: bytes,
        rid: str,
        timeout: float,
        sent_prompt: int,
        *,
        whole: bool,
    ) -> None:
        self.client, self.request, self.rid, self.timeout = client, request, rid, timeout
        self.sent_prompt = sent_prompt
        self.whole = whole
        self.call: Any = None
        self._task: asyncio.Task[PrefillAnswer] | None = None
        self._done = False  # the engine ended the call, or it was aborted: nothing to abort

    @property
    def node_id(self) -> str:
        return self.client.address

    def start(self) -> asyncio.Future[PrefillAnswer]:
        self.call = self.client.generate_call(self.request, self.timeout, whole=self.whole, traced=False)
        self._task = asyncio.ensure_future(self._drain())
        return self._task

    async def _drain(self) -> PrefillAnswer:
        runtime = self.client.runtime
        assert runtime is not None
        complete: Output | None = None
        try:
            if self.whole:
                out = runtime.parse(await self.call, 0)
                complete = out if out.complete else None
            else:
                async for msg in self.call:
                    out = runtime.parse(msg, 0)
                    if out.complete:
                        complete = out
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._done = True
            raise failure(self.node_id, Stage.PREFILL, e) from e
        self._done = True
        if complete is None:
            detail = "prefill leg ended without complete"
            raise NodeFailure(self.node_id, Stage.PREFILL, FailureKind.INTERNAL, detail)
        sent = self.sent_prompt
        cached = min(complete.cached_tokens, sent) if sent else complete.cached_tokens
        return PrefillAnswer(cached, complete.kv_transfer_params_json or None)

    async def abort(self) -> None:
        if self.call is None or self._done:
            return
        self._done = True  # Abort first, then the call and the task reading it go
        self.client.spawn(self.client.abort_then_cancel(self.rid, self.call, self._task))


class SmgDecodeLeg(GenerateStream):
    """A decode leg: a generation on the decode node whose first response is read ahead (its
    first item: the KV is there), then streamed as any generation is. ``request``: its
    serialized request, set by the pair before ``start``."""

    def __init__(self, client: SmgNodeClient, prompt: Prompt, timeout: float) -> None:
        super().__init__(client, prompt, timeout, Stage.DECODE)
        self.request = b""

    def start(self) -> asyncio.Future[None]:
        whole = not self.engine_stream
        self.call = self.client.generate_call(self.request, self.timeout, whole=whole, traced=False)
        self._reader = asyncio.ensure_future(self._read_first())
        return self._reader

    async def _read_first(self) -> None:
        out = await self.read()
        if out is None:
            raise NodeFailure(
                self.node_id, Stage.DECODE, FailureKind.INTERNAL, "stream ended before any token"
            )
        self._early = out

    async def abort(self) -> None:
        await self.aclose()


async def prepared(
    prefill: SmgNodeClient,
    decode: SmgNodeClient,
    prompt: Prompt,
    timeout: float,
    runtime: Runtime,
    *,
    stream: bool,
) -> tuple[EngineRequest, SmgDecodeLeg]:
    """Both workers detected, the request built (the decode node's tokenizer, a fresh request
    id for both legs), and the decode leg that will send it; both must run ``runtime``.
    ``stream``: whether the decode leg streams (else it asks for one ``complete``)."""
    try:
        await prefill.detect(min(timeout, DETECT_TIMEOUT_S))
    except NodeFailure as e:
        raise NodeFailure(prefill.address, Stage.PREFILL, e.kind, e.detail) from e
    leg = SmgDecodeLeg(decode, prompt, timeout)
    leg.engine_stream = stream
    try:
        request = await leg._prepare()
    except (grpc.aio.AioRpcError, TimeoutError) as e:
        raise failure(decode.address, Stage.DECODE, e) from e
    if decode.runtime is not runtime or prefill.runtime is not runtime:
        detail = f"not a {runtime.name} pair"
        raise NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, detail)
    return request, leg


T = TypeVar("T")


def smg_pairs(
    make: Callable[[SmgNodeClient, SmgNodeClient, Prompt, float], T], refused: str
) -> PairFactory[T]:
    """A handoff's pair factory for SMG workers (``refused``: why a pair with another kind of node
    cannot serve)."""

    def pair(prompt: Prompt, prefill: NodeClient, decode: NodeClient, timeout: float) -> T | NodeFailure:
        if not isinstance(prefill, SmgNodeClient) or not isinstance(decode, SmgNodeClient):
            return NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
        return make(prefill, decode, prompt, timeout)

    return pair
