"""Split serving over OpenAI-compatible HTTP workers: SGLang's and vLLM's own PD over HTTP.

A worker given as ``--prefill http://H:P [BOOTSTRAP_PORT]`` or ``--decode http://H:P`` with
``--backend sglang|vllm`` is an ``HttpPDClient``: an HTTP worker (``http_openai``) that takes part
in split serving through the handoff of its engine family (``handoff``), this module being the
HTTP transport of its legs (a non-streamed prefill call, the decode worker's SSE stream; closing
a leg's connection aborts it on the engine) and the bodies' dialects:

- SGLang (``HttpBootstrapPair``): the same body, plus ``bootstrap_host`` (the prefill worker's
  host), ``bootstrap_port`` (its bootstrap port: the one given with ``--prefill``, else
  ``disaggregation_bootstrap_port`` from its ``/server_info``, else SGLang's default) and a fresh
  random int64 ``bootstrap_room``, to both workers at once.
- vLLM (``HttpRelayPair``, the NIXL proxy's way): the prefill worker gets the body with
  ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1`` and
  ``stream: false``; the ``kv_transfer_params`` of its answer go into the decode request.

``cached_tokens`` is the prefill leg's count when its answer reports one
(``usage.prompt_tokens_details``), else the decode leg's; the usage counts are the decode leg's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from yarl import URL

from prefixgate.gateway.nodeclient import reported
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    Handoff,
    NodeClient,
    NodeFailure,
    OpenAIBody,
    Prompt,
    TokenDelta,
)
from prefixgate.gateway.nodeclient.handoff import (
    DEFAULT_BOOTSTRAP_PORT,
    HTTP_ROOM_LIMIT,
    BootstrapHandoff,
    PrefillAnswer,
    RelayHandoff,
)
from prefixgate.gateway.nodeclient.http_openai import (
    CALL_ERRORS,
    RELAYED,
    HttpOpenAIClient,
    SSEStream,
)
from prefixgate.gateway.vocab import FailureKind, Stage

BACKENDS = ("sglang", "vllm")
PROBE_TIMEOUT_S = 5.0
CAPABILITIES = Capabilities(openai_body=True, split=True, features=RELAYED, tenant_salt=True)
# Fields a prefill-only request must not carry (vLLM proxy: the prefill computes one token).
VLLM_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class HttpPDOptions:
    """How an HTTP worker takes part in split serving."""

    backend: str  # "sglang" | "vllm"
    bootstrap_port: int | None = None  # a prefill worker's (SGLang); None: ask the worker

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            wanted = " or ".join(BACKENDS)
            raise ValueError(f"HTTP split serving needs --backend {wanted}, got {self.backend!r}")


class HttpPDClient(HttpOpenAIClient):
    """An HTTP worker in a prefill or decode pool."""

    def __init__(
        self, address: str, options: HttpPDOptions, engine_priority: str = "off", api_key: str = ""
    ) -> None:
        super().__init__(address, engine_priority, api_key)
        self.pd = options
        self.host = URL(address).host or ""
        self._bootstrap_port: int | None = options.bootstrap_port

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def handoff(self) -> Handoff:
        return BOOTSTRAP_HANDOFF if self.pd.backend == "sglang" else RELAY_HANDOFF

    async def bootstrap_port(self, timeout: float) -> int:
        """The port decode workers meet this prefill worker at: the one configured, else the
        worker's ``/server_info`` ``disaggregation_bootstrap_port`` (asked once), else SGLang's
        default."""
        if self._bootstrap_port is None:
            port = 0
            with contextlib.suppress(*CALL_ERRORS):
                code, raw = await self._get("/server_info", timeout)
                if code == 200:
                    info = orjson.loads(raw)
                    if isinstance(info, Mapping):
                        value = info.get("disaggregation_bootstrap_port")
                        port = value if type(value) is int and 0 < value < 65536 else 0
            self._bootstrap_port = port or DEFAULT_BOOTSTRAP_PORT
        return self._bootstrap_port


def _as_decode(e: NodeFailure) -> NodeFailure:
    """A decode leg's failure (``SSEStream`` says GENERATE: it knows no split)."""
    if e.stage != Stage.GENERATE:
        return e
    return NodeFailure(e.node_id, Stage.DECODE, e.kind, e.detail)


class HttpPrefillLeg:
    """A prefill leg: one non-streamed call; cancelling it closes its connection (the engine
    aborts the request). ``parse`` reads the engine's answer (the dialect's)."""

    def __init__(
        self,
        worker: HttpPDClient,
        body: OpenAIBody,
        rid: str,
        timeout: float,
        parse: Callable[[Mapping[str, Any]], PrefillAnswer],
    ) -> None:
        self.worker, self.body, self.rid, self.timeout, self.parse = worker, body, rid, timeout, parse
        self._task: asyncio.Task[PrefillAnswer] | None = None

    @property
    def node_id(self) -> str:
        return self.worker.address

    def start(self) -> asyncio.Future[PrefillAnswer]:
        self._task = asyncio.ensure_future(self._run())
        return self._task

    async def _run(self) -> PrefillAnswer:
        return self.parse(await self.worker.answer(self.body, self.rid, Stage.PREFILL, self.timeout))

    async def abort(self) -> None:
        await _cancel(self._task)


class HttpDecodeLeg:
    """A decode leg: the worker's SSE stream; its first item is its first delta. Closing its
    connection aborts the request on the engine."""

    def __init__(
        self, worker: HttpPDClient, prompt: Prompt, body: OpenAIBody, rid: str, timeout: float
    ) -> None:
        self.worker = worker
        self._rid = rid
        self._sse = SSEStream(worker, dataclasses.replace(prompt, request_id=rid, openai=body), timeout)
        self._first: asyncio.Task[None] | None = None
        self._early: TokenDelta | None = None

    @property
    def node_id(self) -> str:
        return self.worker.address

    @property
    def rid(self) -> str:
        return self._rid

    @property
    def cached_tokens(self) -> int:
        return self._sse.cached_tokens

    def start(self) -> asyncio.Future[None]:
        self._first = asyncio.ensure_future(self._read_first())
        return self._first

    async def _read_first(self) -> None:
        try:
            self._early = await anext(self._sse)
        except StopAsyncIteration:
            detail = "stream ended before any token"
            raise NodeFailure(self.node_id, Stage.DECODE, FailureKind.INTERNAL, detail) from None
        except NodeFailure as e:
            raise _as_decode(e) from e

    def __aiter__(self) -> HttpDecodeLeg:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._early is not None:
            d, self._early = self._early, None
            return d
        try:
            return await anext(self._sse)
        except NodeFailure as e:
            raise _as_decode(e) from e

    async def abort(self) -> None:
        await _cancel(self._first)
        await self._sse.aclose()


async def _cancel(task: asyncio.Future[Any] | None) -> None:
    """A leg's task ended if it still runs (the connection it reads closes: the engine aborts)."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def _new_rid(prompt: Prompt) -> str:
    """One id for both legs (vLLM pairs them by it), fresh per attempt: a retry never meets the
    remains of an attempt that an engine still holds."""
    return f"{prompt.request_id}-{uuid.uuid4().hex[:8]}"


def _prefill_answer(sent_prompt: int, answer: Mapping[str, Any], params: Any = None) -> PrefillAnswer:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer, checked as ``reported``
    checks it (None: not reported, or not a sane count)."""
    cached = reported.openai_usage(answer.get("usage"), sent_prompt=sent_prompt).cached
    return PrefillAnswer(cached, params)


class HttpBootstrapPair:
    """SGLang over HTTP (docs/engines.md, SGLang HTTP PD): the same body plus ``bootstrap_host``
    (IPv6 bracketed), ``bootstrap_port`` and ``bootstrap_room`` to both workers; the prefill
    leg asked not to stream."""

    room_limit = HTTP_ROOM_LIMIT

    def __init__(self, prefill: HttpPDClient, decode: HttpPDClient, prompt: Prompt, timeout: float) -> None:
        self.p, self.d, self.prompt, self.timeout = prefill, decode, prompt, timeout

    async def legs(self, room: int) -> tuple[HttpPrefillLeg, HttpDecodeLeg]:
        req = _body(self.prompt, self.p)
        port = await self.p.bootstrap_port(min(self.timeout, PROBE_TIMEOUT_S))
        host = self.p.host
        pd = {
            "bootstrap_host": f"[{host}]" if ":" in host else host,
            "bootstrap_port": port,
            "bootstrap_room": room,
        }
        decode = {**req.body, **pd}
        prefill = {k: v for k, v in decode.items() if k != "stream_options"}
        prefill["stream"] = False
        rid, sent = _new_rid(self.prompt), self.prompt.token_count
        return (
            HttpPrefillLeg(
                self.p,
                OpenAIBody(req.kind, prefill),
                rid,
                self.timeout,
                lambda answer: _prefill_answer(sent, answer),
            ),
            HttpDecodeLeg(self.d, self.prompt, OpenAIBody(req.kind, decode), rid, self.timeout),
        )


class HttpRelayPair:
    """vLLM over HTTP, the NIXL proxy's way (docs/engines.md, vLLM HTTP PD (NIXL proxy)): the
    prefill worker gets the body with ``kv_transfer_params: {"do_remote_decode": true, ...}``,
    ``max_tokens: 1`` and ``stream: false``; the ``kv_transfer_params`` of its answer go into
    the decode request. An answer without them fails the prefill leg (not a kv_producer)."""

    def __init__(self, prefill: HttpPDClient, decode: HttpPDClient, prompt: Prompt, timeout: float) -> None:
        self.p, self.d, self.prompt, self.timeout = prefill, decode, prompt, timeout
        self.req = _body(prompt, prefill)
        self.rid = _new_rid(prompt)

    async def prefill_leg(self) -> HttpPrefillLeg:
        body = {k: v for k, v in self.req.body.items() if k not in VLLM_PREFILL_DROPS}
        body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        return HttpPrefillLeg(self.p, OpenAIBody(self.req.kind, body), self.rid, self.timeout, self._answer)

    def _answer(self, answer: Mapping[str, Any]) -> PrefillAnswer:
        params = answer.get("kv_transfer_params")
        if not isinstance(params, Mapping):
            detail = "the prefill answer has no kv_transfer_params (is it a vLLM kv_producer?)"
            raise NodeFailure(self.p.address, Stage.PREFILL, FailureKind.INTERNAL, detail)
        return _prefill_answer(self.prompt.token_count, answer, dict(params))

    def decode_leg(self, answer: PrefillAnswer) -> HttpDecodeLeg:
        body = OpenAIBody(self.req.kind, {**self.req.body, "kv_transfer_params": answer.transfer_params})
        return HttpDecodeLeg(self.d, self.prompt, body, self.rid, self.timeout)


def _body(prompt: Prompt, prefill: HttpPDClient) -> OpenAIBody:
    return prefill.request_body(prompt)


def _pair(
    prefill: NodeClient, decode: NodeClient, backend: str
) -> tuple[HttpPDClient, HttpPDClient] | NodeFailure:
    """The pair, when it can serve split over HTTP in ``backend``'s way (else why not)."""
    if not isinstance(prefill, HttpPDClient) or not isinstance(decode, HttpPDClient):
        refused = "an HTTP prefill worker hands KV only to an HTTP decode worker"
        return NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
    if decode.pd.backend != backend:
        refused = f"a {backend} prefill worker cannot hand KV to a {decode.pd.backend} decode worker"
        return NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
    return prefill, decode


def bootstrap_pair(
    prompt: Prompt, prefill: NodeClient, decode: NodeClient, timeout: float
) -> HttpBootstrapPair | NodeFailure:
    pair = _pair(prefill, decode, "sglang")
    return pair if isinstance(pair, NodeFailure) else HttpBootstrapPair(*pair, prompt, timeout)


def relay_pair(
    prompt: Prompt, prefill: NodeClient, decode: NodeClient, timeout: float
) -> HttpRelayPair | NodeFailure:
    pair = _pair(prefill, decode, "vllm")
    return pair if isinstance(pair, NodeFailure) else HttpRelayPair(*pair, prompt, timeout)


BOOTSTRAP_HANDOFF = BootstrapHandoff(bootstrap_pair)
RELAY_HANDOFF = RelayHandoff(relay_pair)
