"""Split serving over OpenAI-compatible HTTP workers: SGLang's and vLLM's own PD over HTTP.

A worker given as ``--prefill http://H:P [BOOTSTRAP_PORT]`` or ``--decode http://H:P`` with
``--backend sglang|vllm`` is an ``HttpPDClient``: an HTTP worker (``http_openai``) that takes part
in split serving through the handoff of its engine family (ENGINES.md §5.2, §5.3):

- SGLang (``BootstrapHTTPHandoff``): the same body, plus ``bootstrap_host`` (the prefill
  worker's host), ``bootstrap_port`` (its bootstrap port: the one given with ``--prefill``, else
  ``disaggregation_bootstrap_port`` from its ``/server_info``, else SGLang's default) and a fresh
  random ``bootstrap_room``, goes to both workers at once; they meet at the room. The client
  gets the decode leg's stream; the prefill leg is asked not to stream and its answer is read
  aside (closing its connection aborts it when the request ends early).
- vLLM (``RelayHTTPHandoff``, the NIXL proxy's way): the prefill worker gets the body with
  ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1`` and
  ``stream: false``; the ``kv_transfer_params`` of its answer go into the decode request.

Blame: a prefill leg that fails is the prefill worker's failure (stage PREFILL); a decode leg
that fails is the decode worker's (stage DECODE), except when, in SGLang's way, the prefill leg
fails too within a short grace (a decode leg waiting for a room nobody fills fails because of
its prefill leg). ``cached_tokens`` is the prefill leg's count when its answer reports one
(``usage.prompt_tokens_details``), else the decode leg's; the usage counts are the decode leg's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from prefixgate.gateway.nodeclient import reported
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    FailedStream,
    Handoff,
    NodeClient,
    NodeFailure,
    OpenAIBody,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenStream,
)
from prefixgate.gateway.nodeclient.http_openai import (
    MAX_PROBE_BYTES,
    RELAYED,
    HttpOpenAIClient,
    SSEStream,
    _read_bounded,
)
from prefixgate.gateway.vocab import FailureKind, Stage

BACKENDS = ("sglang", "vllm")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
ROOM_LIMIT = (1 << 63) - 1  # HTTP rooms are int64 (ENGINES.md §5.2)
BLAME_GRACE_S = 0.3  # a failed decode leg waits this long for its prefill leg's own verdict
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

    def __init__(self, address: str, options: HttpPDOptions) -> None:
        super().__init__(address)
        self.pd = options
        self.host = httpx.URL(address).host
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
            with contextlib.suppress(httpx.HTTPError, ValueError, TimeoutError):
                async with self._http.stream("GET", "/server_info", timeout=timeout) as r:
                    if r.status_code == 200:
                        info = orjson.loads(await _read_bounded(r, MAX_PROBE_BYTES))
                        if isinstance(info, Mapping):
                            value = info.get("disaggregation_bootstrap_port")
                            port = value if type(value) is int and 0 < value < 65536 else 0
            self._bootstrap_port = port or DEFAULT_BOOTSTRAP_PORT
        return self._bootstrap_port


def _cached(answer: Mapping[str, Any], sent_prompt: int) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer, checked as ``reported``
    checks it (None: not reported, or not a sane count)."""
    return reported.openai_usage(answer.get("usage"), sent_prompt=sent_prompt).cached


def _as_decode(e: NodeFailure) -> NodeFailure:
    """A decode leg's failure (``SSEStream`` says GENERATE: it knows no split)."""
    if e.stage != Stage.GENERATE:
        return e
    return NodeFailure(e.node_id, Stage.DECODE, e.kind, e.detail)


def _body(prompt: Prompt, prefill: HttpPDClient) -> OpenAIBody:
    return prompt.openai or prefill.fallback_body(prompt)


class _SplitStream:
    """The decode leg's stream, once a handoff's ``_begin`` started it; the prefill leg's work
    is the subclass's. ``aclose`` ends both legs (idempotent)."""

    def __init__(self, prefill: HttpPDClient, decode: HttpPDClient, prompt: Prompt, timeout: float) -> None:
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self.p = prefill
        self.d = decode
        self.prompt = prompt
        self.timeout = timeout
        # One id for both legs (vLLM pairs them by it), fresh per attempt: a retry never meets the
        # remains of an attempt that an engine still holds.
        self.rid = f"{prompt.request_id}-{uuid.uuid4().hex[:8]}"
        self._decode: SSEStream | None = None
        self._prefill_cached: int | None = None  # what the prefill leg reported
        self._started = False
        self._closed = False

    def __aiter__(self) -> _SplitStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._closed:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                return await self._begin()
            assert self._decode is not None
            try:
                d = await anext(self._decode)
            except NodeFailure as e:
                raise _as_decode(e) from e
            self._take_cached()
            return d
        except BaseException:
            await self.aclose()
            raise

    async def _begin(self) -> TokenDelta:
        raise NotImplementedError

    def _decode_leg(self, body: OpenAIBody) -> SSEStream:
        leg = dataclasses.replace(self.prompt, request_id=self.rid, openai=body)
        self._decode = SSEStream(self.d, leg, self.timeout)
        return self._decode

    async def _first_decoded(self) -> TokenDelta:
        assert self._decode is not None
        try:
            d = await anext(self._decode)
        except StopAsyncIteration:
            detail = "stream ended before any token"
            raise NodeFailure(self.d.address, Stage.DECODE, FailureKind.INTERNAL, detail) from None
        except NodeFailure as e:
            raise _as_decode(e) from e
        return d

    def _report(self, answer: Mapping[str, Any]) -> None:
        self._prefill_cached = _cached(answer, self.prompt.token_count)
        cached = self._prefill_cached or 0
        self.prefill = PrefillReport(cached, 0.0, 0.0, 0.0, 0)
        self.cached_tokens = cached

    def _take_cached(self) -> None:
        if self._prefill_cached is None and self._decode is not None:
            self.cached_tokens = self._decode.cached_tokens

    async def aclose(self) -> None:
        self._closed = True
        if self._decode is not None:
            await self._decode.aclose()


class BootstrapStream(_SplitStream):
    """SGLang: both legs at once, meeting at a fresh bootstrap room."""

    def __init__(self, prefill: HttpPDClient, decode: HttpPDClient, prompt: Prompt, timeout: float) -> None:
        super().__init__(prefill, decode, prompt, timeout)
        self._prefill_task: asyncio.Task[Mapping[str, Any]] | None = None

    async def _bodies(self) -> tuple[OpenAIBody, OpenAIBody]:
        req = _body(self.prompt, self.p)
        port = await self.p.bootstrap_port(min(self.timeout, PROBE_TIMEOUT_S))
        host = self.p.host
        pd = {
            "bootstrap_host": f"[{host}]" if ":" in host else host,
            "bootstrap_port": port,
            "bootstrap_room": secrets.randbelow(ROOM_LIMIT),
        }
        decode = {**req.body, **pd}
        prefill = {k: v for k, v in decode.items() if k != "stream_options"}
        prefill["stream"] = False
        return OpenAIBody(req.kind, prefill), OpenAIBody(req.kind, decode)

    async def _begin(self) -> TokenDelta:
        prefill_body, decode_body = await self._bodies()
        self._prefill_task = asyncio.ensure_future(
            self.p.answer(prefill_body, self.rid, Stage.PREFILL, self.timeout)
        )
        # The report as soon as the prefill leg is done: a first token that never comes is then
        # the decode node's (``stream.prefill`` set), not the prefill node's.
        self._prefill_task.add_done_callback(self._prefill_done)
        self._decode_leg(decode_body)
        first = asyncio.ensure_future(self._first_decoded())
        try:
            await asyncio.wait({first, self._prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and self._prefill_task.exception() is not None:
                self._prefill_task.result()  # raises the prefill worker's failure
            try:
                delta = await first
            except NodeFailure:
                await self._blame_prefill_first()
                raise
            answer = await self._prefill_task
        finally:
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
        if self.prefill is None:
            self._report(answer)
        self._take_cached()
        return delta

    def _prefill_done(self, task: asyncio.Task[Mapping[str, Any]]) -> None:
        if not task.cancelled() and task.exception() is None and self.prefill is None:
            self._report(task.result())

    async def _blame_prefill_first(self) -> None:
        """The decode leg failed before its first token: when the prefill leg fails too (within
        a short grace), that failure is the one raised."""
        task = self._prefill_task
        assert task is not None
        await asyncio.wait({task}, timeout=BLAME_GRACE_S)
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.result()

    async def aclose(self) -> None:
        task = self._prefill_task
        if task is not None and not task.done():
            task.cancel()  # closes the prefill leg's connection: the engine aborts it
            with contextlib.suppress(BaseException):
                await task
        elif task is not None and not task.cancelled():
            task.exception()  # retrieved: a failure already reported (or superseded) is no news
        await super().aclose()


class RelayStream(_SplitStream):
    """vLLM: prefill first (one token, not streamed), then decode with its ``kv_transfer_params``."""

    def _prefill_body(self, req: OpenAIBody) -> OpenAIBody:
        body = {k: v for k, v in req.body.items() if k not in VLLM_PREFILL_DROPS}
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
        return OpenAIBody(req.kind, body)

    async def _begin(self) -> TokenDelta:
        req = _body(self.prompt, self.p)
        answer = await self.p.answer(self._prefill_body(req), self.rid, Stage.PREFILL, self.timeout)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, Mapping):
            detail = "the prefill answer has no kv_transfer_params (is it a vLLM kv_producer?)"
            raise NodeFailure(self.p.address, Stage.PREFILL, FailureKind.INTERNAL, detail)
        self._report(answer)
        self._decode_leg(OpenAIBody(req.kind, {**req.body, "kv_transfer_params": dict(params)}))
        delta = await self._first_decoded()
        self._take_cached()
        return delta


def _pair(prefill: NodeClient, decode: NodeClient, backend: str) -> NodeFailure | None:
    """Why this pair cannot serve split over HTTP in ``backend``'s way (None: it can)."""
    if not isinstance(prefill, HttpPDClient) or not isinstance(decode, HttpPDClient):
        refused = "an HTTP prefill worker hands KV only to an HTTP decode worker"
        return NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
    if decode.pd.backend != backend:
        refused = f"a {backend} prefill worker cannot hand KV to a {decode.pd.backend} decode worker"
        return NodeFailure(decode.address, Stage.TRANSFER, FailureKind.FORMAT_REFUSED, refused)
    return None


class BootstrapHTTPHandoff:
    """SGLang split serving on a (prefill, decode) pair of HTTP workers."""

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> TokenStream:
        refused = _pair(prefill, decode, "sglang")
        if refused is not None:
            return FailedStream(refused)
        assert isinstance(prefill, HttpPDClient) and isinstance(decode, HttpPDClient)
        return BootstrapStream(prefill, decode, prompt, timeout)


class RelayHTTPHandoff:
    """vLLM (NIXL proxy) split serving on a (prefill, decode) pair of HTTP workers."""

    def start(
        self, prompt: Prompt, prefill: NodeClient, decode: NodeClient, *, timeout: float
    ) -> TokenStream:
        refused = _pair(prefill, decode, "vllm")
        if refused is not None:
            return FailedStream(refused)
        assert isinstance(prefill, HttpPDClient) and isinstance(decode, HttpPDClient)
        return RelayStream(prefill, decode, prompt, timeout)


BOOTSTRAP_HANDOFF = BootstrapHTTPHandoff()
RELAY_HANDOFF = RelayHTTPHandoff()
