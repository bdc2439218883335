"""An OpenAI-compatible HTTP endpoint on a node (``prefixgate node ... --http-port P``).

Why: so the same simulated nodes can sit behind prefixgate *and* behind peer routers
(sglang-router, vllm-router, LiteLLM) that speak HTTP to their workers, and a benchmark can
compare them on identical hardware. Every request is a monolithic ``Generate`` on this node.

It serves what those routers probe: ``GET /health``, ``/health_generate``, ``/v1/models``,
``/server_info`` (``/get_server_info``), ``/model_info`` (``/get_model_info``), ``/get_load``,
``/metrics``, ``/version``; ``POST /v1/chat/completions`` and ``/v1/completions`` (JSON or SSE
ending with ``data: [DONE]``, ``usage.prompt_tokens_details.cached_tokens`` = what this node
reused), ``/generate`` (SGLang native, minimal), ``/v1/chat/completions/render``,
``/v1/completions/render`` and ``/tokenize`` (token ids of our tokenizer, which vllm-router's
``cache_aware`` policy needs), ``/flush_cache`` (drop every cached block).

Prompts are what the node's engine sees over its SMG gRPC face, where the client renders the chat
with the tokenizer the node ships (``backends.hftok``) and its chat template, as ``transformers``'
``apply_chat_template`` does: chats go through that template (``gateway.tokens.EngineTokenizer``,
the gateway's own implementation of it) and every prompt is tokenized with that tokenizer, so the
same chat over HTTP and over gRPC gives the engine the same ids (same ``prompt_tokens``, same
greedy text, same prefill cost). Blocks are hashed in the gateway's namespace
``Namespace(model, tenant="", block_size, tokenizer.name)``, so a block a request leaves here is
the block a gateway with that tokenizer (``tokenizer = "engine"``) would name. Normalization is off
by default: a real engine applies its chat template to the messages as sent, and a router in
front of it gets no help from prefixgate's normalizer; ``normalize=True`` renders exactly as the
gateway does with normalization on. No model or tokenizer path is reported, so sglang-router
does not try to load a tokenizer.

``n`` (up to ``schema.MAX_N``) is served on chat and text completions: choice ``i`` samples with
``choice_sampling`` (under a ``seed``, the seed the gateway gives choice ``i``), carries its
``index``, and ``usage`` counts the prompt once and every choice's completion tokens. Choice 0 is
prefilled first, the others then reuse its blocks: the prompt is computed once.

PD (split serving) over HTTP, both engines' ways, reusing the node's bootstrap handoff
(``backends.bootstrap``: the decode node presents a room to the prefill node's bootstrap
listener, the prefill node pushes the KV pages to the decode node's gRPC port):

- SGLang (sglang-router / smg ``--pd-disaggregation``): the router sends the same body, with
  ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to a prefill and a decode node
  at once. A prefill node waits for the room's decode leg, prefills and pushes, and answers with
  the first token; a decode node presents the room, receives the pages and streams the answer.
  With ``n``, choice ``i``'s legs meet at its own room (``PDRequest.rooms_for``).
- vLLM (NIXL proxy, vllm-router ``--vllm-pd-disaggregation``): the prefill request carries
  ``kv_transfer_params: {"do_remote_decode": true}``; the prefill node computes the prompt (its
  pages stay in its pool), opens a bootstrap room for it and answers with ``kv_transfer_params``
  naming it (``remote_host``, ``remote_port`` = its bootstrap port, ``bootstrap_room``,
  ``do_remote_prefill: true``). The decode request carries those params: the decode node
  presents the room and the prefill node pushes the (now cached) pages, as in SGLang's way.
  The decode leg reports the first prefill's cached tokens. One choice only (``n`` > 1: 400).

Runs on uvicorn in the node's own event loop, next to the gRPC server.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, TypeVar, cast

import grpc
import orjson
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixgate.backends import grammar
from prefixgate.backends.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S, BootstrapServer, handshake
from prefixgate.backends.engine import Constraint, Engine, Sampling, TokenLogprob
from prefixgate.backends.errors import FailedPrecondition, NodeError
from prefixgate.backends.generation import Chunk, Generation
from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.backends.node import Node, PrefillCall, PrefillResult
from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.tokenizer import pack_ids, unpack_ids
from prefixgate.gateway.core.streams import tagged_merge
from prefixgate.gateway.tokens import EngineTokenizer, open_tokenizer_dir
from prefixgate.openai.errors import APIError, from_domain, invalid
from prefixgate.openai.exceptions import GatewayError
from prefixgate.openai.normalize import NormalizationError, render_completion
from prefixgate.openai.schema import MAX_N, MAX_SEED, ParsedRequest, choice_seed, parse_json, parse_request

_log = structlog.get_logger("prefixgate.node_http")

DEFAULT_MODEL = "prefixgate-sim"
MAX_MODEL_LEN = 139_264

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
}


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    model: str = DEFAULT_MODEL
    normalize: bool = False  # render as the gateway does with normalization on
    max_body_bytes: int = 16 * 1024 * 1024
    default_max_tokens: int = 256
    max_tokens_limit: int = 8_192
    max_documents: int = 256


# -- pure: request -> prompt tokens, chunks -> wire -----------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: bytes  # packed LE uint32
    hashes: list[int]

    @property
    def count(self) -> int:
        return len(self.tokens) // 4


@lru_cache(maxsize=1)
def shipped_tokenizer() -> EngineTokenizer:
    """The tokenizer and chat template every node ships (one per process: the segment cache is shared)."""
    return open_tokenizer_dir(TOKENIZER_DIR)


class Renderer:
    """Request bodies -> prompt tokens and block hashes: the shipped tokenizer and its chat template."""

    def __init__(self, model: str, block_size: int, normalize: bool) -> None:
        self.tokenizer = shipped_tokenizer()
        self.block_size = block_size
        self.normalize = normalize
        self.root = Namespace(model, "", block_size, self.tokenizer.name).root()

    def tokens(self, req: ParsedRequest) -> bytes:
        if req.document_ids:
            raise invalid(
                "document_ids are resolved by the gateway; send 'documents' to a node", "document_ids"
            )
        try:
            if req.kind == "chat":
                _layout, tokens = self.tokenizer.encode_chat(
                    req.messages, documents=req.documents, tools=req.tools, normalize=self.normalize
                )
                return tokens
            if req.prompt_token_ids is not None:
                return pack_ids(req.prompt_token_ids)
            layout = render_completion(req.prompt or "", documents=req.documents, normalize=self.normalize)
        except NormalizationError as e:
            raise invalid(str(e), e.param) from None
        return self.tokenizer.encode(layout.text)

    def text_tokens(self, text: str) -> bytes:
        return self.tokenizer.encode(render_completion(text, normalize=self.normalize).text)

    def prompt(self, tokens: bytes) -> Prompt:
        if not tokens:
            raise invalid("the prompt is empty", "prompt")
        return Prompt(tokens, block_hashes(tokens, self.block_size, self.root))


def sampling_of(req: ParsedRequest, engine: Engine) -> Sampling:
    """The node's sampling for ``req``: log probabilities on an engine that has them, and
    ``response_format`` as the engine's constraint where the engine can follow one (a 400 naming
    the field otherwise, or when its schema does not compile, as OpenAI-compatible servers answer)."""
    s = req.sampling
    if s.logprobs and "logprobs" not in engine.features:
        raise invalid("log probabilities are not supported by this node's engine", "logprobs")
    sampling = Sampling.normalized(
        s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, logprobs=s.logprobs, top_logprobs=s.top_logprobs
    )
    if s.constraint is None:
        return sampling
    if "response_format" not in engine.features:
        raise invalid(f"'response_format' is not supported by the {engine.name} engine", "response_format")
    constraint = Constraint(s.constraint.kind, s.constraint.text)
    try:
        grammar.check(constraint)
    except grammar.ConstraintFailed as e:
        raise invalid(e.message, "response_format") from None
    return replace(sampling, constraint=constraint)


def wire_logprobs(
    lps: Sequence[TokenLogprob], chat: bool, text_of: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of one chunk: chat ``content`` entries, or the completions arrays."""

    def entry(t: int, v: float) -> dict[str, Any]:
        s = text_of(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    if chat:
        content = [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(text_of(lp.token))
    return {
        "tokens": [text_of(lp.token) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text_of(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def usage(lasts: Sequence[Chunk]) -> dict[str, Any]:
    """The usage of a request whose choices ended with ``lasts`` (choice order): the prompt once
    (and what of it choice 0 found cached), the completion tokens of every choice."""
    head = lasts[0]
    completion = sum(c.completion_tokens for c in lasts)
    return {
        "prompt_tokens": head.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": head.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": head.cached_tokens},
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Answer:
    """One choice's whole answer: its text, its last chunk (finish and usage), its log probabilities."""

    text: str
    last: Chunk
    logprobs: list[TokenLogprob]


class Wire:
    """OpenAI response objects for one request (chat or text completion), each choice by its index."""

    def __init__(
        self,
        kind: str,
        model: str,
        include_usage: bool,
        text_of: Callable[[int], str] | None = None,
    ) -> None:
        self.chat = kind == "chat"
        self.text_of = text_of  # set: log probabilities are asked for
        self.offsets: dict[int, int] = {}  # text completions: each choice's text offset so far
        rid = uuid.uuid4().hex
        self.base = {
            "id": f"chatcmpl-{rid}" if self.chat else f"cmpl-{rid}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "prefixgate-node",
        }
        self.include_usage = include_usage

    def logprobs(self, lps: Sequence[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        if self.text_of is None:
            return None
        offset = self.offsets.get(index, 0)
        out = wire_logprobs(lps, self.chat, self.text_of, offset)
        self.offsets[index] = offset + sum(len(self.text_of(lp.token)) for lp in lps)
        return out

    def chunk(
        self, text: str, finish: str, first: bool, lps: Sequence[TokenLogprob] = (), index: int = 0
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if not first and not text:
                delta = {}
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish or None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish or None}
        choice["logprobs"] = self.logprobs(lps, index)
        out: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, lasts: Sequence[Chunk]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage(lasts)}

    def whole(self, answers: Sequence[Answer]) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, a in enumerate(answers):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": a.text}
            else:
                choice["text"] = a.text
            choice["finish_reason"] = a.last.finish_reason or "length"
            choice["logprobs"] = self.logprobs(a.logprobs, index)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.base, "object": obj, "choices": choices, "usage": usage([a.last for a in answers])}


def sglang_sampling(body: Mapping[str, Any]) -> Sampling:
    """``sampling_params`` of SGLang's ``/generate``."""
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, Mapping):
        raise invalid("'sampling_params' must be an object", "sampling_params")
    try:
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
    except (TypeError, ValueError):
        raise invalid("sampling_params: numbers expected", "sampling_params") from None
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]
    seed = sp.get("sampling_seed")
    return Sampling.normalized(
        max(1, max_new), temperature, top_p, seed if isinstance(seed, int) else None, stop
    )


# -- PD requests (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PDLink:
    """What the HTTP endpoint needs for split serving: where this node takes KV pages (its gRPC
    address, for ``TransferKV``), its bootstrap listener (a prefill node) and the host it gives
    decode nodes to reach that listener."""

    kv_address: Callable[[], str]
    bootstrap: BootstrapServer | None = None
    advertise_host: str = "127.0.0.1"
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class Room:
    """A bootstrap room: SGLang's three body fields, or vLLM's ``kv_transfer_params``."""

    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class PDRequest:
    leg: str  # "prefill" | "decode" | "sglang" (the node's role decides)
    rooms: tuple[Room, ...] = ()  # one, or one per choice (SGLang's lists)

    @property
    def room(self) -> Room | None:
        return self.rooms[0] if self.rooms else None

    def rooms_for(self, n: int) -> list[Room]:
        """The room of each of ``n`` choices: the lists' entries when there is one per choice
        (sglang-router sends lists of ``n`` for a chat with ``n``), else, as SGLang's engines
        expand one room, ``bootstrap_room + i`` for choice ``i``."""
        if len(self.rooms) == n:
            return list(self.rooms)
        if len(self.rooms) == 1:
            r = self.rooms[0]
            return [replace(r, room=r.room + i) for i in range(n)]
        raise invalid(
            f"'bootstrap_room' has {len(self.rooms)} rooms for {n} choices: give one, or one per choice",
            "bootstrap_room",
        )


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise invalid(f"'{name}' must be an integer", name)
    try:
        return int(v)
    except ValueError:
        raise invalid(f"'{name}' must be an integer", name) from None


def _each(v: Any, name: str, count: int) -> list[Any]:
    """SGLang's bootstrap field ``v`` as ``count`` values: a list of them, or one for all."""
    if not isinstance(v, list):
        return [v] * count
    if len(v) == 1:
        return v * count
    if len(v) != count:
        raise invalid(f"'{name}' has {len(v)} entries, 'bootstrap_room' {count}", name)
    return v


def _sglang_rooms(body: Mapping[str, Any]) -> tuple[Room, ...]:
    """SGLang's ``bootstrap_host/port/room``: one each, or lists of one per choice."""
    raw = body["bootstrap_room"]
    rooms = [_int(r, "bootstrap_room") for r in (raw if isinstance(raw, list) else [raw])]
    if not rooms or len(rooms) > MAX_N:
        raise invalid(f"'bootstrap_room' must hold 1 to {MAX_N} rooms", "bootstrap_room")
    out = []
    hosts = _each(body.get("bootstrap_host"), "bootstrap_host", len(rooms))
    ports = _each(body.get("bootstrap_port"), "bootstrap_port", len(rooms))
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if not isinstance(host, str) or not host:
            raise invalid("'bootstrap_host' is required with 'bootstrap_room'", "bootstrap_host")
        out.append(Room(host.strip("[]"), 0 if port is None else _int(port, "bootstrap_port"), room))
    return tuple(out)


def pd_request(body: Mapping[str, Any]) -> PDRequest | None:
    """The PD part of a request body (None: a whole request)."""
    if body.get("bootstrap_room") is not None:
        return PDRequest("sglang", _sglang_rooms(body))
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise invalid("'kv_transfer_params' must be an object", "kv_transfer_params")
    if params.get("do_remote_decode"):
        return PDRequest("prefill")
    if params.get("do_remote_prefill"):
        host = params.get("remote_host")
        if not isinstance(host, str) or not host:
            raise invalid("kv_transfer_params.remote_host is required", "kv_transfer_params")
        port = _int(params.get("remote_port"), "kv_transfer_params.remote_port")
        room = _int(params.get("bootstrap_room"), "kv_transfer_params.bootstrap_room")
        return PDRequest("decode", (Room(host.strip("[]"), port, room),))
    return None


# -- the app ------------------------------------------------------------------------------------


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


Handler = Callable[[Request], Awaitable[Response]]
Gen = AsyncGenerator[Chunk, None]
T = TypeVar("T")
Started = tuple[Gen, Chunk]  # a started choice: its chunks, and the first one already read


def _node_error(e: NodeError) -> APIError:
    status = _STATUS.get(e.code, 500)
    return APIError(status, e.message, code=e.stage, retry_after=1 if status in (429, 503) else None)


def _guard(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except GatewayError as e:
            return from_domain(e).response()
        except NodeError as e:
            return _node_error(e).response()

    return wrapped


class NodeAPI:
    """The HTTP handlers over one ``Node``."""

    def __init__(self, node: Node, options: HTTPOptions | None = None, pd: PDLink | None = None) -> None:
        self.node = node
        self.options = options or HTTPOptions()
        self.renderer = Renderer(self.options.model, node.block_size, self.options.normalize)
        self.pd = pd
        self._parked: set[asyncio.Task[PrefillResult]] = set()  # vLLM-style prefills waiting for decode

    async def close(self) -> None:
        tasks = list(self._parked)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- helpers

    async def _json(self, request: Request) -> dict[str, Any]:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes; the limit is {limit}")
        parts: list[bytes] = []
        total = 0
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            parts.append(part)
        return parse_json(b"".join(parts))

    def _parse(self, body: Mapping[str, Any], kind: str) -> ParsedRequest:
        o = self.options
        model = body.get("model")
        models = {o.model, model} if isinstance(model, str) and model else {o.model}
        return parse_request(
            body,
            kind,
            models=models,
            default_max_tokens=o.default_max_tokens,
            max_tokens_limit=o.max_tokens_limit,
            max_documents=o.max_documents,
        )

    def _headers(self, first: Chunk) -> dict[str, str]:
        return {
            "x-prefixgate-node": self.node.node_id,
            "x-prefixgate-cached-tokens": str(first.cached_tokens),
        }

    async def _start(self, prompt: Prompt, sampling: Sampling) -> tuple[Gen, Chunk]:
        """Begin generation and wait for the first chunk, so a refusal is an HTTP status."""
        gen = cast(Gen, self.node.generate(prompt.tokens, prompt.hashes, sampling))
        try:
            first = await anext(gen)
        except BaseException:
            await gen.aclose()
            raise
        return gen, first

    async def _after(self, first: Started, rest: Sequence[Awaitable[Started]]) -> list[Started]:
        """The choices after ``first``, started at once (``first`` closed when one cannot start)."""
        if not rest:
            return []
        try:
            return await _all(rest)
        except BaseException:
            await first[0].aclose()
            raise

    async def _run(
        self, body: Mapping[str, Any], prompt: Prompt, sampling: Sampling, n: int = 1
    ) -> tuple[list[Started], dict[str, Any]]:
        """Start a request's ``n`` choices: whole here, or this node's leg of a PD pair. Returns
        each choice's chunks and first chunk (choice order), and fields to add to the response
        (vLLM's ``kv_transfer_params``).

        Choice ``i`` samples with ``choice_sampling(sampling, i)``. Whole: choice 0 is prefilled
        first, the others then start at once and reuse its blocks, so the prompt is computed once.
        SGLang's PD: choice ``i``'s legs meet at its own room on both nodes (``PDRequest.rooms_for``:
        the ``i``-th of the lists sglang-router sends, or ``bootstrap_room + i`` as SGLang's
        engines expand one room): the decode leg presents every room at once; the prefill leg takes them all,
        prefills choice 0's, then the others' (its blocks cached: only the last partial block is
        computed again), each choice its own first token and sampling state, pushed to the decode
        node (which keeps one copy of the shared blocks)."""
        pd = pd_request(body)
        role = self.node.config.role
        choices = [choice_sampling(sampling, i) for i in range(n)]
        if pd is None or (pd.leg == "sglang" and role not in ("prefill", "decode")):
            first = await self._start(prompt, choices[0])
            return [first, *await self._after(first, [self._start(prompt, s) for s in choices[1:]])], {}
        if self.pd is None:
            raise invalid("this node's HTTP endpoint takes no disaggregated requests", "kv_transfer_params")
        if pd.leg != "sglang" and n > 1:
            raise invalid("'n' must be 1 with kv_transfer_params: vLLM's PD hands over one choice", "n")
        if pd.leg == "decode" or (pd.leg == "sglang" and role == "decode"):
            rooms = pd.rooms_for(n)
            return await _all([self._decode_leg(r, s) for r, s in zip(rooms, choices, strict=True)]), {}
        bootstrap = self._bootstrap()
        if pd.leg == "sglang":
            computed = asyncio.Event()
            legs = [
                self._hand_off(bootstrap, prompt, s, r.room, None, computed if i else None)
                for i, (r, s) in enumerate(zip(pd.rooms_for(n), choices, strict=True))
            ]
            results = await _all([_setting(computed, legs[0]), *legs[1:]])
            return [(_one(self._prefill_chunk(r)), self._prefill_chunk(r)) for r in results], {}
        # vLLM: compute now, keep the pages, hand them to whichever decode node presents the room.
        rid = uuid.uuid4().hex
        r = await self.node.prefill(PrefillCall(rid, prompt.tokens, prompt.hashes, sampling))
        room = secrets.randbits(63)
        task = asyncio.create_task(self._hand_off(bootstrap, prompt, sampling, room, r.cached_tokens))
        self._parked.add(task)
        task.add_done_callback(self._parked_done)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.node.node_id,
            "remote_block_ids": [],
            "remote_host": self.pd.advertise_host if self.pd is not None else "127.0.0.1",
            "remote_port": bootstrap.port,
            "bootstrap_room": room,
            "tp_size": 1,
        }
        chunk = self._prefill_chunk(r)
        return [(_one(chunk), chunk)], {"kv_transfer_params": params}

    def _parked_done(self, task: asyncio.Task[PrefillResult]) -> None:
        self._parked.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_detail = str(task.exception())[:200]
            _log.info("parked prefill ended without a decode leg", error=log_detail)

    def _bootstrap(self) -> BootstrapServer:
        b = self.pd.bootstrap if self.pd is not None else None
        if b is None:
            raise FailedPrecondition(
                "this node has no bootstrap port (--bootstrap-port): it cannot prefill for PD"
            )
        return b

    def _prefill_chunk(self, r: PrefillResult) -> Chunk:
        c = Chunk(
            [r.first_token],
            r.first_text,
            r.finish_reason or "length",
            r.prompt_tokens,
            1,
            r.cached_tokens,
            r.queue_seconds,
            r.prefill_seconds,
        )
        if r.first_logprob is not None:
            c.logprobs = [r.first_logprob]
        return c

    async def _hand_off(
        self,
        bootstrap: BootstrapServer,
        prompt: Prompt,
        sampling: Sampling,
        room: int,
        cached: int | None,
        after: asyncio.Event | None = None,
    ) -> PrefillResult:
        """Wait for the decode leg presenting ``room``, prefill (pages reused when this node
        computed them already; ``after``: once that is set, when another choice computes them),
        push the pages there, tell it the handle."""
        peer = await bootstrap.wait_decode(room, "")
        call = PrefillCall(
            uuid.uuid4().hex, prompt.tokens, prompt.hashes, sampling, decode_address=peer.kv_address
        )
        try:
            if after is not None:
                await after.wait()
            r = await self.node.prefill(call)
        except NodeError as e:
            peer.reply({"error": e.message, "code": e.code.name})
            raise
        except BaseException:
            peer.reply({"error": "prefill leg aborted", "code": "ABORTED"})
            raise
        peer.reply(
            {
                "kv_handle": r.kv_handle,
                "first_token": r.first_token,
                "first_text": r.first_text,
                "first_logprob": _lp_json(r.first_logprob),
                "finished": r.finished,
                "finish_reason": r.finish_reason,
                "cached_tokens": r.cached_tokens if cached is None else cached,
                "prompt_tokens": r.prompt_tokens,
                "transfer_seconds": r.transfer_seconds,
                "transfer_bytes": r.transfer_bytes,
            }
        )
        return r

    async def _decode_leg(self, room: Room, sampling: Sampling) -> tuple[Gen, Chunk]:
        """Present ``room`` to the prefill node, take the pages, decode here."""
        assert self.pd is not None
        reply = await handshake(
            room.host, room.port, room.room, "", self.pd.kv_address(), self.pd.bootstrap_timeout_s
        )
        cached = int(reply.get("cached_tokens") or 0)
        chunks = cast(Gen, self.node.decode(str(reply["kv_handle"]), sampling))
        prompt_tokens = int(reply.get("prompt_tokens") or 0)
        token = int(reply["first_token"])
        text = reply.get("first_text")
        if not isinstance(text, str):  # a prefill leg that does not send it (the gRPC one)
            e = self.node.engine
            text = Generation(sampling, e.eos_token, e.token_text).push([token])[1]
        first = Chunk([token], text, "", prompt_tokens, 1, cached)
        first_lp = _lp_of(reply.get("first_logprob"))
        if first_lp is not None and sampling.logprobs:
            first.logprobs = [first_lp]

        async def leg() -> Gen:
            try:
                async for c in chunks:
                    c.cached_tokens = cached
                    yield c
            finally:
                await chunks.aclose()

        return leg(), first

    # -- OpenAI

    async def completions(self, request: Request, kind: str) -> Response:
        body = await self._json(request)
        req = self._parse(body, kind)
        prompt = self.renderer.prompt(self.renderer.tokens(req))
        engine = self.node.engine
        started, extra = await self._run(body, prompt, sampling_of(req, engine), req.n)
        first = started[0][1]
        text_of = engine.token_text if req.sampling.logprobs else None
        wire = Wire(kind, req.model, req.include_usage, text_of)
        if req.stream:
            return StreamingResponse(
                self._stream(wire, started),
                media_type="text/event-stream",
                headers={**self._headers(first), "cache-control": "no-cache"},
            )
        parts: list[list[str]] = [[f.text] for _, f in started]
        lps = [list(f.logprobs) for _, f in started]
        lasts = [f for _, f in started]
        chunks = merged(started)
        try:
            async for i, c in chunks:
                parts[i].append(c.text)
                lps[i].extend(c.logprobs)
                lasts[i] = c
        finally:
            await chunks.aclose()
            await _close(started)
        answers = [Answer("".join(p), last, lp) for p, last, lp in zip(parts, lasts, lps, strict=True)]
        return JSON({**wire.whole(answers), **extra}, headers=self._headers(first))

    async def _stream(self, wire: Wire, started: list[Started]) -> AsyncIterator[bytes]:
        lasts = [f for _, f in started]
        chunks = merged(started)
        try:
            for i, (_, f) in enumerate(started):
                yield sse(wire.chunk(f.text, f.finish_reason, True, f.logprobs, i))
            async for i, c in chunks:
                lasts[i] = c
                if c.text or c.finish_reason or c.logprobs:
                    yield sse(wire.chunk(c.text, c.finish_reason, False, c.logprobs, i))
            if wire.include_usage:
                yield sse(wire.usage_chunk(lasts))
            yield DONE
        finally:
            await chunks.aclose()
            await _close(started)

    async def chat(self, request: Request) -> Response:
        return await self.completions(request, "chat")

    async def text(self, request: Request) -> Response:
        return await self.completions(request, "completion")

    # -- SGLang native

    async def generate(self, request: Request) -> Response:
        body = await self._json(request)
        ids = body.get("input_ids")
        text = body.get("text")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            tokens = pack_ids(ids)
        elif isinstance(text, str):
            tokens = self.renderer.text_tokens(text)
        else:
            raise invalid("'text' (a string) or 'input_ids' is required", "text")
        prompt = self.renderer.prompt(tokens)
        ((gen, first),), _extra = await self._run(body, prompt, sglang_sampling(body))
        rid = str(body.get("rid") or uuid.uuid4().hex)

        def meta(c: Chunk) -> dict[str, Any]:
            return {
                "id": rid,
                "finish_reason": {"type": c.finish_reason} if c.finish_reason else None,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "cached_tokens": c.cached_tokens,
            }

        if body.get("stream"):

            async def events() -> AsyncIterator[bytes]:
                acc = first.text
                try:
                    yield sse({"text": acc, "meta_info": meta(first)})
                    async for c in gen:
                        acc += c.text
                        yield sse({"text": acc, "meta_info": meta(c)})
                    yield DONE
                finally:
                    await gen.aclose()

            return StreamingResponse(events(), media_type="text/event-stream", headers=self._headers(first))
        parts, last = [first.text], first
        try:
            async for c in gen:
                parts.append(c.text)
                last = c
        finally:
            await gen.aclose()
        return JSON({"text": "".join(parts), "meta_info": meta(last)}, headers=self._headers(first))

    # -- tokens for routers

    async def render(self, request: Request) -> Response:
        body = await self._json(request)
        kind = "chat" if request.url.path.startswith("/v1/chat/") else "completion"
        req = self._parse(body, kind)
        ids = unpack_ids(self.renderer.tokens(req))
        out = {
            "request_id": uuid.uuid4().hex,
            "model": req.model,
            "token_ids": ids,
            "prompt_token_ids": ids,
            "sampling_params": {
                "max_tokens": req.sampling.max_tokens,
                "temperature": req.sampling.temperature,
            },
            "stream": req.stream,
        }
        return JSON(out if kind == "chat" else [out])

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        if "messages" in body:
            tokens = self.renderer.tokens(self._parse({"model": self.options.model, **body}, "chat"))
        else:
            prompt = body.get("prompt", body.get("text", ""))
            if not isinstance(prompt, str):
                raise invalid("'prompt' must be a string", "prompt")
            tokens = self.renderer.text_tokens(prompt)
        ids = unpack_ids(tokens)
        return JSON({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None})

    # -- probes

    async def health(self, request: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(self, request: Request) -> Response:
        m = self.options.model
        data = [
            {
                "id": m,
                "object": "model",
                "created": 0,
                "owned_by": "prefixgate",
                "max_model_len": MAX_MODEL_LEN,
            }
        ]
        return JSON({"object": "list", "data": data})

    async def server_info(self, request: Request) -> Response:
        s = self.node.snapshot()
        role = self.node.config.role
        bootstrap = self.pd.bootstrap if self.pd is not None else None
        return JSON(
            {
                "served_model_name": self.options.model,
                "dp_size": 1,
                "tp_size": 1,
                "disaggregation_mode": role if role in ("prefill", "decode") else "null",
                "disaggregation_bootstrap_port": bootstrap.port if bootstrap is not None else None,
                "context_length": MAX_MODEL_LEN,
                "max_total_num_tokens": s.capacity_blocks * self.node.block_size,
                "page_size": self.node.block_size,
                "version": "prefixgate-node",
                "status": "ready",
                "internal_states": [{"load": s.running_requests + s.queued_requests}],
            }
        )

    async def model_info(self, request: Request) -> Response:
        return JSON({"is_generation": True, "model_type": "prefixgate-sim", "weight_version": "default"})

    async def get_load(self, request: Request) -> Response:
        s = self.node.snapshot()
        return JSON(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": s.running_requests + s.queued_requests,
                    "num_waiting_reqs": s.queued_requests,
                    "num_tokens": s.queued_tokens,
                }
            ]
        )

    async def metrics(self, request: Request) -> Response:
        s = self.node.snapshot()
        m = self.options.model
        text = (
            f'vllm:num_requests_running{{model_name="{m}"}} {s.running_requests}\n'
            f'vllm:num_requests_waiting{{model_name="{m}"}} {s.queued_requests}\n'
            f"prefixgate_node_prompt_tokens_total {s.prompt_tokens}\n"
            f"prefixgate_node_prefix_hit_tokens_total {s.prefix_hit_tokens}\n"
        )
        return Response(text, media_type="text/plain; version=0.0.4")

    async def version(self, request: Request) -> Response:
        return JSON({"version": "prefixgate-node"})

    async def flush_cache(self, request: Request) -> Response:
        n = len(self.node.evict(everything=True))
        return JSON({"evicted_blocks": n})

    def routes(self) -> list[Route]:
        g = _guard
        return [
            Route("/v1/chat/completions", g(self.chat), methods=["POST"]),
            Route("/v1/completions", g(self.text), methods=["POST"]),
            Route("/generate", g(self.generate), methods=["POST"]),
            Route("/v1/chat/completions/render", g(self.render), methods=["POST"]),
            Route("/v1/completions/render", g(self.render), methods=["POST"]),
            Route("/tokenize", g(self.tokenize), methods=["POST"]),
            Route("/flush_cache", g(self.flush_cache), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            *(Route(p, self.health, methods=["GET"]) for p in ("/health", "/health_generate", "/ping")),
            *(Route(p, self.server_info, methods=["GET"]) for p in ("/server_info", "/get_server_info")),
            *(Route(p, self.model_info, methods=["GET"]) for p in ("/model_info", "/get_model_info")),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ]


def create_app(node: Node, options: HTTPOptions | None = None, pd: PDLink | None = None) -> Starlette:
    return Starlette(routes=NodeAPI(node, options, pd).routes())


def _lp_json(lp: TokenLogprob | None) -> list[Any] | None:
    return None if lp is None else [lp.token, lp.logprob, [[t, v] for t, v in lp.top]]


def _lp_of(raw: Any) -> TokenLogprob | None:
    """The prefill leg's first log probability, as ``_lp_json`` sent it."""
    try:
        token, value, top = raw
        return TokenLogprob(int(token), float(value), tuple((int(t), float(v)) for t, v in top))
    except (TypeError, ValueError):
        return None


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index`` of a request's ``n``: its own sampling stream (choice 0 is the request as
    sent). Seeded: the seed the gateway gives choice ``index`` when it runs ``n`` as ``n``
    requests (``schema.choice_seed``), so choice ``i`` is reproducible and the same either way;
    unseeded: the engine mixes ``index`` into the seed it draws from the prompt."""
    if index == 0:
        return sampling
    if sampling.seed is not None:
        return replace(sampling, seed=choice_seed(sampling.seed, index) & MAX_SEED)
    return replace(sampling, choice=index)


async def _all(starts: Sequence[Awaitable[T]]) -> list[T]:
    """Start choices at once; when one cannot start, the others are stopped (the started ones'
    chunks closed) and its error raised."""
    tasks = [asyncio.ensure_future(s) for s in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            done = t.result() if not t.cancelled() and t.exception() is None else None
            if isinstance(done, tuple):
                await done[0].aclose()
        raise


async def _setting(event: asyncio.Event, work: Awaitable[PrefillResult]) -> PrefillResult:
    """``work``, then ``event`` set (whether it succeeded or not)."""
    try:
        return await work
    finally:
        event.set()


def merged(started: Sequence[Started]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """The chunks after each choice's first, tagged with the choice's index, as they come."""
    return tagged_merge([g for g, _ in started])


async def _close(started: Sequence[Started]) -> None:
    for gen, _ in started:
        await gen.aclose()


async def _one(chunk: Chunk) -> Gen:
    """The chunks of a prefill leg after its first (and only) one: none."""
    return
    yield chunk


# -- serving in the node's loop -------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without signal capture: the node process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class NodeHTTP:
    """The HTTP endpoint of a node, served on the running loop. ``start`` returns the port."""

    def __init__(
        self,
        node: Node,
        host: str = "127.0.0.1",
        port: int = 0,
        options: HTTPOptions | None = None,
        pd: PDLink | None = None,
    ):
        self.node = node
        self.host = host
        self.port = port
        self.options = options or HTTPOptions()
        self.api = NodeAPI(node, self.options, pd)
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            Starlette(routes=self.api.routes()),
            http="httptools",
            lifespan="off",
            log_level="error",
            access_log=False,
            timeout_graceful_shutdown=1,
            backlog=2048,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="node-http")
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"node HTTP endpoint on {self.address} did not start")
            if time.monotonic() > deadline:
                raise OSError(f"node HTTP endpoint on {self.address} did not start in 10 s")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 5.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        self._server, self._task = None, None
        await self.api.close()
