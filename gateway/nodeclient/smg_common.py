"""What SGLang and vLLM share on the SMG engine protocol (``smg-grpc-proto``): the channel, the
failure mapping, runtime detection, status from GetServerInfo/GetModelInfo/GetLoads, the token
stream (ids in, text out through ``gateway.tokens.detokenize``), abort on close, and the KV index
from ``SubscribeKvEvents``.

What differs per runtime (request messages, Abort, split serving) is a ``Runtime``:
``smg_sglang.SGLANG`` and ``smg_vllm.VLLM``. A ``grpc://`` worker is one ``SmgNodeClient``; its
runtime is given (``--backend``) or detected on the first probe the way smg detects it: the
first of the two services whose ``HealthCheck`` answers.

Capabilities are what the protocol offers: generation, split serving, KV events (until the
engine answers UNIMPLEMENTED), a whole-node ``FlushCache``; no per-block evict, no pin, no warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import grpc
import structlog

from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway import tracing
from prefixgate.gateway.nodeclient import reported
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    CostProfile,
    Handoff,
    KVEvent,
    KVFormat,
    NodeFailure,
    NodeStatus,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenLogprob,
)
from prefixgate.gateway.nodeclient.smg_events import BatchCursor, ChainRehasher, Change, Overflow
from prefixgate.gateway.nodeclient.smg_prompt import EngineRequest, tokenized_field
from prefixgate.gateway.tokenpool import kvcolumns
from prefixgate.gateway.tokens.detokenize import Detokenizer, vocabulary
from prefixgate.gateway.vocab import EventKind, FailureKind, Stage
from prefixgate.openai.embeddings import parse_embeddings, response_body
from prefixgate.openai.errors import APIError
from prefixgate.openai.features import Feature

log = structlog.get_logger("prefixgate.nodeclient.smg")

# docs/engines.md, Channel: keepalive and message sizes. HTTP/2 keepalive 30 s / 10 s while
# idle; the SGLang servicer takes messages up to 256 MiB and pings no closer than 10 s apart.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
ABORT_TIMEOUT_S = 2.0
# A KV event batch this large (a long prompt's blocks: ~124K tokens are ~400 KB) is read and
# rehashed on a worker thread; inline it held the event loop for tens of milliseconds
REHASH_OFF_LOOP_BYTES = 64 * 1024
# A prompt this long (32K tokens) has its ids made into the request's field on a worker thread
# (``smg_prompt``: under a millisecond below, 3 ms at 124K tokens)
REQUEST_OFF_LOOP_BYTES = 4 * 32 * 1024
RESUBSCRIBE_LIMIT = 8  # clear+resubscribe rounds in a row without a data batch, then give up
CONSTRAINT_TRAILER = "smg-constraint-failed"
TOKEN_TEXT_CACHE = 1 << 16  # tokens whose text a client keeps (for log probabilities)
REPLACEMENT = "\ufffd"

KINDS: dict[grpc.StatusCode, FailureKind] = {
    grpc.StatusCode.UNAVAILABLE: FailureKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED,
    grpc.StatusCode.CANCELLED: FailureKind.CANCELLED,
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
    grpc.StatusCode.OUT_OF_RANGE: FailureKind.INVALID,
    grpc.StatusCode.UNIMPLEMENTED: FailureKind.INVALID,
    grpc.StatusCode.NOT_FOUND: FailureKind.INVALID,  # no such model / adapter on the engine
    grpc.StatusCode.ABORTED: FailureKind.CANCELLED,
}


def failure(node_id: str, stage: Stage, err: BaseException) -> NodeFailure:
    """A failed call, in the gateway's words. FAILED_PRECONDITION is the request's fault when the
    engine says a grammar failed (``smg-constraint-failed``), else the node's (e.g. a prefill
    node without a bootstrap port): another node may serve it."""
    if isinstance(err, grpc.aio.AioRpcError):
        code = err.code()
        kind = KINDS.get(code, FailureKind.INTERNAL)
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            trailers = {k: v for k, v in (err.trailing_metadata() or ())}
            kind = FailureKind.CONSTRAINT if CONSTRAINT_TRAILER in trailers else FailureKind.INTERNAL
        return NodeFailure(node_id, stage, kind, f"{code.name}: {err.details() or ''}")
    if isinstance(err, TimeoutError):
        return NodeFailure(node_id, stage, FailureKind.TIMEOUT, "timed out")
    return NodeFailure(node_id, stage, FailureKind.INTERNAL, repr(err))


class Codec(Protocol):
    """The engine's tokenizer as the gateway uses it here (``tokenizers.Tokenizer`` is one)."""

    def encode(
        self,
        sequence: Any,
        pair: Any | None = ...,
        is_pretokenized: bool = ...,
        add_special_tokens: bool = ...,
    ) -> Any: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class SmgOptions:
    """How the gateway talks to one ``grpc://`` worker.

    ``backend``: "sglang" | "vllm" | "" (detect). ``bootstrap_port``: the prefill node's SGLang
    bootstrap port as given with ``--prefill URL PORT`` (None: the engine's own
    ``disaggregation_bootstrap_port``, else 8998). ``root_of(model, lora, cache_salt)``: the
    namespace root the gateway hashes prompts of that namespace from (KV events are re-hashed
    with it; ``model`` is the name the engine gives, ``EngineInfo.model_name``).
    ``codec``: the engine's tokenizer (None: loaded from ``GetModelInfo.tokenizer_path``).
    """

    backend: str = ""
    bootstrap_port: int | None = None
    block_size: int = 0
    root_of: Callable[[str, str, str], int | None] | None = None
    codec: Codec | None = None
    # The tokenizer of the engine's model (``EngineInfo.model_name``), before ``codec``: a gateway
    # with one tokenizer per model detokenizes each worker's ids with its model's.
    codec_for: Callable[[str], Codec | None] | None = None
    # A long KV event batch's bytes in columns, read out of the gateway's process (a tokenizer
    # child: ``TokenizerPool.kv_batch``), or None (read here). Called on a worker thread.
    kv_batch_far: Callable[[bytes], kvcolumns.Batch | None] | None = None


EngineLogprob = tuple[int, float, tuple[tuple[int, float], ...]]  # (id, logprob, top (id, logprob))


def output_logprobs(msg: Any) -> list[EngineLogprob]:
    """A chunk's or complete's ``output_logprobs`` (the same message on both runtimes): one
    entry a position, its alternatives as the engine listed them."""
    if not msg.HasField("output_logprobs"):
        return []
    lp = msg.output_logprobs
    tops = list(lp.top_logprobs)
    out: list[EngineLogprob] = []
    for i, (tid, value) in enumerate(zip(lp.token_ids, lp.token_logprobs, strict=False)):
        top = tops[i] if i < len(tops) else None
        alts = tuple(zip(top.token_ids, top.values, strict=False)) if top is not None else ()
        out.append((int(tid), float(value), tuple((int(t), float(v)) for t, v in alts)))
    return out


@dataclass(slots=True)
class Output:
    """One Generate response, runtime-neutral. Counters are cumulative (a runtime that reports
    deltas adds them up). ``logprobs``: the engine's per output token (``output_logprobs``)."""

    complete: bool
    ids: list[int]
    index: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    matched: str | int | None = None
    kv_transfer_params_json: str = ""
    logprobs: list[EngineLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        """The engine's counts as ``reported`` checks them: one that is not sane is 0 (not
        reported), ``cached_tokens`` at most the engine's own ``prompt_tokens``."""
        p, c, k = self.prompt_tokens, self.completion_tokens, self.cached_tokens
        if reported.sane(p, c, k):  # kept as they are: the usual case, once a streamed token
            return
        u = reported.checked(p, c, k)
        self.prompt_tokens = u.prompt or 0
        self.completion_tokens = u.completion or 0
        self.cached_tokens = u.cached or 0


def engine_output(msg: Any, completion_so_far: int, *, delta_counts: bool) -> Output:
    """A Generate response of either runtime (their chunk and complete messages have one shape;
    only vLLM's complete carries ``kv_transfer_params_json``). ``delta_counts``: a chunk's
    ``completion_tokens`` is its own (vLLM), added to ``completion_so_far``; else the total."""
    if msg.HasField("chunk"):
        c = msg.chunk
        completion = completion_so_far + c.completion_tokens if delta_counts else c.completion_tokens
        lps = output_logprobs(c)
        return Output(
            False, list(c.token_ids), c.index, c.prompt_tokens, completion, c.cached_tokens, logprobs=lps
        )
    c = msg.complete
    which = c.WhichOneof("matched_stop")
    completion = max(completion_so_far, c.completion_tokens) if delta_counts else c.completion_tokens
    return Output(
        True,
        list(c.output_ids),
        c.index,
        c.prompt_tokens,
        completion,
        c.cached_tokens,
        c.finish_reason,
        getattr(c, which) if which else None,
        getattr(c, "kv_transfer_params_json", ""),
        output_logprobs(c),
    )


@dataclass(slots=True)
class EngineInfo:
    """What GetModelInfo and GetServerInfo said once (never polled again, as smg does)."""

    runtime: str
    model_path: str = ""
    served_model_name: str = ""
    tokenizer_path: str = ""
    page_size: int = 0
    role: str = ""  # "prefill" | "decode" | "monolithic"
    kv_format: KVFormat = field(default_factory=KVFormat)
    instance_id: str = ""
    max_running: int = 0
    bootstrap_port: int = 0  # from server_args (SGLang)
    kv_connector: str = ""  # vLLM
    kv_events: bool = True  # until SubscribeKvEvents says UNIMPLEMENTED
    eos_token_ids: tuple[int, ...] = ()
    # The features the engine itself says it serves (our nodes' ``prefixgate_features``); None:
    # it does not say, the runtime's own stand.
    features: frozenset[str] | None = None
    constrains: bool = True  # grammar-constrained decoding on (SGLang: unless --grammar-backend none)
    max_context_tokens: int = 0  # GetModelInfo's (``context_length``); 0: not given

    @staticmethod
    def context_of(model: Any) -> int:
        """The engine's context from its GetModelInfo: ``max_context_length`` (the longest prompt
        plus output), else ``max_req_input_len`` (the longest prompt); 0 when it gives neither."""
        return int(getattr(model, "max_context_length", 0) or getattr(model, "max_req_input_len", 0) or 0)

    @property
    def model_name(self) -> str:
        """The model's name as smg gives it: ``served_model_name``, else ``model_path``."""
        return self.served_model_name or self.model_path


class Runtime(Protocol):
    """One engine family on the SMG protocol; ``features``: what its messages carry beyond plain
    sampling (``prefixgate.openai.features``)."""

    name: str
    service: str
    features: frozenset[str]
    generate_response: Any  # the class of Generate's responses
    # The engine is sent the request's stop strings and stops on them itself (vLLM); else only
    # single-token ones reach it, as stop token ids (SGLang).
    matches_stop_strings: bool

    def stub(self, channel: grpc.aio.Channel) -> Any: ...

    def health_request(self) -> Any: ...

    async def info(self, stub: Any, timeout: float) -> EngineInfo: ...

    async def loads(self, stub: Any, timeout: float) -> Any: ...

    def request(self, prompt: Prompt, rid: str, stop_token_ids: Sequence[int], *, stream: bool) -> Any: ...

    def embed_request(self, rid: str, text: str, ids: Sequence[int]) -> Any: ...

    def parse(self, msg: Any, completion_so_far: int) -> Output: ...

    async def abort(self, stub: Any, rid: str) -> None: ...

    def handoff(self) -> Handoff: ...


def stop_token_ids(codec: Codec, stops: Sequence[str]) -> list[int]:
    """Stop strings that are exactly one token, as ids (docs/engines.md, Stop
    strings); all stop strings are
    still matched by the gateway's own stop decoder."""
    out: list[int] = []
    for s in stops:
        if not s:
            continue
        ids = list(codec.encode(s, add_special_tokens=False).ids)
        if len(ids) == 1 and ids[0] not in out:
            out.append(ids[0])
    return out


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet back to bytes (each byte is one printable character)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(codec: Codec, token_id: int) -> bytes | None:
    """The bytes of a token that holds part of a UTF-8 character (its text shows U+FFFD): from
    its byte-level spelling, or a byte-fallback token (``<0xE2>``); None when neither."""
    spell = getattr(codec, "id_to_token", None)
    piece = spell(token_id) if callable(spell) else None
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    table = _byte_of_char()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def requested_stop_ids(prompt: Prompt) -> list[int]:
    """Stop token ids the request itself names (a sampling field when the schema has one)."""
    return [int(t) for t in getattr(prompt.sampling, "stop_token_ids", None) or ()]


def streams(runtime: Runtime | None, prompt: Prompt) -> bool:
    """Whether the engine is asked to stream ``prompt``'s output: when the client takes it as it
    comes, and when the gateway must see it as it comes to end it at a stop string the engine
    does not apply (SGLang is sent none: docs/engines.md, Stop strings). A worker not detected
    yet streams."""
    s = prompt.sampling
    return s.stream or runtime is None or (bool(s.stop) and not runtime.matches_stop_strings)


def new_request_id(prompt: Prompt) -> str:
    """Unique per dispatch (a retry on another node is another dispatch): ``{rid}-{64 random
    bits in hex}``."""
    return f"{prompt.request_id}-{os.urandom(8).hex()}"


# What an SMG engine's protocol lets the gateway do, with and without its KV events: made once,
# read several times a request.
_WITH_EVENTS = Capabilities(split=True, kv_events=True, flush=True, resume=True)
_WITHOUT_EVENTS = Capabilities(split=True, kv_events=False, flush=True, resume=True)


class SmgNodeClient:
    """A ``grpc://`` worker: SGLang or vLLM over the SMG engine protocol."""

    def __init__(self, address: str, target: str, options: SmgOptions | None = None) -> None:
        self._address = address
        self.target = target
        self.options = options or SmgOptions()
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.runtime: Runtime | None = None
        self.stub: Any = None
        # Generate on serialized requests (``generate_call``): streamed, and answered whole
        self._generate_stream: Any = None
        self._generate_whole: Any = None
        self.info: EngineInfo | None = None
        self._codec: Codec | None = None if self.options.codec_for else self.options.codec
        self._detect_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._no_loads = False  # GetLoads answered UNIMPLEMENTED
        self._token_texts: dict[int, tuple[str, bytes | None]] = {}

    # -- identity and capabilities -----------------------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def host(self) -> str:
        host = self.target.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host

    @property
    def capabilities(self) -> Capabilities:
        events = self.info.kv_events if self.info is not None else True
        return _WITH_EVENTS if events else _WITHOUT_EVENTS

    @property
    def handoff(self) -> Handoff | None:
        return self.runtime.handoff() if self.runtime is not None else None

    # -- detection and metadata ----------------------------------------------------------------

    async def detect(self, timeout: float) -> Runtime:
        """The runtime (given, or the first service whose HealthCheck answers), and its metadata."""
        if self.runtime is not None and self.info is not None:
            return self.runtime
        async with self._detect_lock:
            if self.runtime is None or self.info is None:
                runtime = await self._probe_runtimes(timeout)
                stub = runtime.stub(self.channel)
                info = await runtime.info(stub, timeout)
                path, answer = f"/{runtime.service}/Generate", runtime.generate_response.FromString
                # requests go as bytes (serialized once, a long prompt's off the event loop), on
                # the channel's registered call handle; a whole answer (``stream=false``: one
                # ``complete``) is read as a unary call, one batch of operations instead of one
                # per message, status and metadata
                self._generate_stream = self.channel.unary_stream(
                    path, request_serializer=None, response_deserializer=answer, _registered_method=True
                )
                self._generate_whole = self.channel.unary_unary(
                    path, request_serializer=None, response_deserializer=answer, _registered_method=True
                )
                self.runtime, self.stub, self.info = runtime, stub, info
                log.info("smg_worker_detected", address=self._address, runtime=runtime.name, role=info.role)
        assert self.runtime is not None
        return self.runtime

    async def _probe_runtimes(self, timeout: float) -> Runtime:
        from prefixgate.gateway.nodeclient.smg_sglang import SGLANG
        from prefixgate.gateway.nodeclient.smg_vllm import VLLM

        known: dict[str, Runtime] = {"sglang": SGLANG, "vllm": VLLM}
        if self.options.backend:
            return known[self.options.backend]
        last: BaseException | None = None
        for runtime in known.values():
            try:
                resp = await runtime.stub(self.channel).HealthCheck(runtime.health_request(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    last = e
                    continue
                raise failure(self._address, Stage.PROBE, e) from e
            except TimeoutError as e:
                raise failure(self._address, Stage.PROBE, e) from e
            if resp.healthy:
                return runtime
            raise NodeFailure(
                self._address, Stage.PROBE, FailureKind.UNAVAILABLE, f"unhealthy: {resp.message}"
            )
        detail = f"neither SglangScheduler nor VllmEngine answers ({last!r})"
        raise NodeFailure(self._address, Stage.PROBE, FailureKind.INVALID, detail)

    def generate_call(self, request: bytes, timeout: float, *, whole: bool, traced: bool = True) -> Any:
        """A Generate call of the detected runtime on the serialized ``request``: streamed (read
        with ``read()``), or ``whole`` (the engine answers one ``complete``: awaited). ``traced``:
        the engine joins the request's trace."""
        metadata = (tracing.CONTEXT.get() or None) if traced else None
        call = self._generate_whole if whole else self._generate_stream
        return call(request, timeout=timeout, metadata=metadata)

    async def embeddings(
        self, body: Mapping[str, Any], request_id: str, timeout: float
    ) -> tuple[int, Mapping[str, Any]]:
        """OpenAI's ``/v1/embeddings`` over the runtime's ``Embed`` call, one call an input (text
        tokenized with the engine's tokenizer): the status and the OpenAI answer. An engine that
        has no embeddings, or refuses the input, is the client's 400; the rest this worker's."""
        req = parse_embeddings(body)
        runtime = self.runtime
        if runtime is None:
            raise NodeFailure(self._address, Stage.GENERATE, FailureKind.UNAVAILABLE, "not probed yet")
        codec = self.codec()
        vectors: list[list[float]] = []
        tokens = 0
        metadata = tracing.CONTEXT.get() or None
        for i, item in enumerate(req.inputs):
            text = item if isinstance(item, str) else ""
            ids = (
                list(codec.encode(item, add_special_tokens=False).ids)
                if isinstance(item, str)
                else list(item)
            )
            message = runtime.embed_request(f"{request_id}-{i}", text, ids)
            try:
                resp = await self.stub.Embed(message, timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                refused = {grpc.StatusCode.INVALID_ARGUMENT: "input", grpc.StatusCode.UNIMPLEMENTED: "model"}
                param = refused.get(e.code())
                if param is None:
                    raise failure(self._address, Stage.GENERATE, e) from e
                code = "embeddings_unsupported" if param == "model" else None
                return 400, APIError(400, e.details() or e.code().name, param=param, code=code).body()
            except TimeoutError as e:
                raise failure(self._address, Stage.GENERATE, e) from e
            vectors.append(list(resp.embedding))
            tokens += int(resp.prompt_tokens) or len(ids)
        width = len(vectors[0]) if vectors else 0
        if req.dimensions is not None and req.dimensions != width:
            message = f"'dimensions': this model's embeddings have {width}"
            return 400, APIError(400, message, param="dimensions").body()
        return 200, response_body(req.model, vectors, req.encoding_format, tokens)

    def codec(self) -> Codec:
        """The engine's tokenizer: its model's (``codec_for``), given, or ``tokenizer.json`` under
        GetModelInfo's path."""
        if self._codec is None and self.options.codec_for is not None and self.info is not None:
            self._codec = self.options.codec_for(self.info.model_name) or self.options.codec
        if self._codec is None:
            path = Path(self.info.tokenizer_path if self.info is not None else "")
            file = path / "tokenizer.json" if path.is_dir() else path
            if not file.is_file():
                raise NodeFailure(
                    self._address,
                    Stage.GENERATE,
                    FailureKind.INVALID,
                    f"no tokenizer for this worker (GetModelInfo tokenizer_path {str(path)!r} is not "
                    "local; give the gateway the engine's tokenizer)",
                )
            from tokenizers import Tokenizer

            loaded = cast(Codec, Tokenizer.from_file(str(file)))
            self._codec = loaded
            return loaded
        return self._codec

    def token_text(self, token_id: int) -> tuple[str, bytes | None]:
        """One token on its own: its text (special tokens spelled out), and its bytes where they
        are not the text's UTF-8 (None: they are)."""
        known = self._token_texts.get(token_id)
        if known is None:
            codec = self.codec()
            if not vocabulary(codec).known(token_id):  # the engine's fault, shown as the text shows it
                return REPLACEMENT, None
            text = str(codec.decode([token_id], skip_special_tokens=False))
            known = (text, token_bytes(codec, token_id) if REPLACEMENT in text else None)
            if len(self._token_texts) >= TOKEN_TEXT_CACHE:
                self._token_texts.clear()
            self._token_texts[token_id] = known
        return known

    def token_logprob(self, lp: EngineLogprob, top: int) -> TokenLogprob:
        """The engine's log probability of one token in the gateway's words, with its ``top``
        most likely alternatives (most likely first)."""
        token_id, value, alts = lp
        text, raw = self.token_text(token_id)
        best = sorted(dict(alts).items(), key=lambda a: -a[1])[:top] if top > 0 else []
        named = [self.token_text(t) for t, _ in best]
        top_raw = tuple(r for _, r in named) if any(r is not None for _, r in named) else ()
        return TokenLogprob(
            token_id,
            text,
            value,
            tuple((t, v) for (t, _), (_, v) in zip(named, best, strict=True)),
            raw,
            top_raw,
        )

    async def status(self, timeout: float) -> NodeStatus:
        try:
            async with asyncio.timeout(timeout):
                runtime = await self.detect(timeout)
                loads = await self._loads(runtime, timeout)
        except NodeFailure:
            raise
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.PROBE, e) from e
        info = self.info
        assert info is not None
        features = runtime.features if info.features is None else runtime.features & info.features
        if not info.constrains:
            features -= {Feature.RESPONSE_FORMAT.value}
        return _status(info, loads, features)

    async def _loads(self, runtime: Runtime, timeout: float) -> Any:
        """GetLoads; an engine without it is probed with HealthCheck and reports no load."""
        if not self._no_loads:
            try:
                return await runtime.loads(self.stub, timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._no_loads = True
                log.warning("smg_get_loads_unimplemented", address=self._address)
        resp = await self.stub.HealthCheck(runtime.health_request(), timeout=timeout)
        if not resp.healthy:
            detail = f"unhealthy: {resp.message}"
            raise NodeFailure(self._address, Stage.PROBE, FailureKind.UNAVAILABLE, detail)
        return None

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, *, timeout: float) -> GenerateStream:
        return GenerateStream(self, prompt, timeout, Stage.GENERATE)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background (aborts after a close), kept until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, rid: str) -> None:
        if self.runtime is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                await self.runtime.abort(self.stub, rid)

    async def abort_then_cancel(self, rid: str, call: Any, task: asyncio.Future[Any] | None = None) -> None:
        """``Abort`` while the engine still runs the request, then cancel its call (and the task
        reading it). Cancelling first ends the request on the engine before its ``Abort`` arrives
        (an engine whose stream end does not abort would keep computing): the call stays open
        until the Abort is answered, at most ``ABORT_TIMEOUT_S``."""
        try:
            await self.abort(rid)
        finally:
            if task is not None and not task.done():
                task.cancel()
            if not call.done():
                call.cancel()
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task

    # -- KV events -------------------------------------------------------------------------------

    async def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        """The node's blocks in the gateway's hashes. Every subscription starts from nothing (the
        protocol keeps no history for a cursor): an empty SNAPSHOT first, then the changes. A gap
        in the engine's sequence, DATA_LOSS or OUT_OF_RANGE clears the node and resubscribes at 0;
        UNIMPLEMENTED turns the node's ``kv_events`` capability off (the index then learns its
        blocks from routing alone)."""
        try:
            await self.detect(5.0)
        except NodeFailure:
            return
        info = self.info
        assert info is not None and self.runtime is not None
        bs = self.options.block_size or info.page_size
        root_of = self.options.root_of
        if not info.kv_events or root_of is None or bs <= 0:
            return
        instance = uuid.uuid4().hex
        seq = 0
        yield KVEvent(seq, instance, EventKind.SNAPSHOT)
        rehash = ChainRehasher(bs, functools.partial(root_of, info.model_name))
        rounds = 0
        from smg_grpc_proto.generated import common_pb2

        # batches read as bytes: their size is known before any parsing, and a long prompt's is
        # parsed off the event loop (``_take_far``)
        subscribe = self.channel.unary_stream(
            f"/{self.runtime.service}/SubscribeKvEvents",
            request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
            response_deserializer=None,
            _registered_method=True,
        )
        while rounds < RESUBSCRIBE_LIMIT:
            rounds += 1
            cursor = BatchCursor(rehash)
            call = subscribe(
                common_pb2.SubscribeKvEventsRequest(
                    start_sequence_number=0, load_records_before_first_batch=False
                )
            )
            reason = ""
            try:
                async for raw in call:
                    try:
                        if len(raw) >= REHASH_OFF_LOOP_BYTES:
                            # one after the other still: the next batch waits for this one
                            changes = await asyncio.to_thread(self._take_far, cursor, raw)
                        else:
                            changes = cursor.take(kvcolumns.parse_batch(raw))
                    except Overflow:
                        reason = "too many blocks to track"
                        break
                    if cursor.gap:
                        reason = cursor.gap
                        break
                    if cursor.fresh:
                        rounds = 0
                    for ch in changes:
                        seq += 1
                        yield KVEvent(seq, instance, ch.kind, ch.parent, ch.hashes)
                else:
                    return  # the engine ended the stream: EventSync reconnects
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    info.kv_events = False
                    log.warning("smg_kv_events_unimplemented", address=self._address)
                    return
                if code not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE):
                    raise failure(self._address, Stage.EVENTS, e) from e
                reason = f"{code.name}: {e.details()}"
            finally:
                call.cancel()
            log.info("smg_kv_events_resubscribe", address=self._address, reason=reason)
            seq += 1
            yield KVEvent(seq, instance, EventKind.CLEARED)
            rehash.clear()
        raise NodeFailure(self._address, Stage.EVENTS, FailureKind.INTERNAL, "KV events keep breaking")

    def _take_far(self, cursor: BatchCursor, raw: bytes) -> list[Change]:
        """A long KV event batch's changes, on a worker thread: read in columns by a tokenizer
        child when one takes it (``SmgOptions.kv_batch_far``: the gateway's process then never
        walks its blocks' messages), else here."""
        far = self.options.kv_batch_far
        batch = far(raw) if far is not None else None
        return cursor.take(batch if batch is not None else kvcolumns.parse_batch(raw))

    # -- cache operations --------------------------------------------------------------------------

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        raise NodeFailure(self._address, Stage.PREFILL, FailureKind.INVALID, "this protocol cannot warm")

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        """Only ``everything`` is possible: the whole node's cache through ``FlushCache``."""
        if not everything:
            raise NodeFailure(self._address, Stage.CACHE, FailureKind.INVALID, "only a whole-node flush")
        from smg_grpc_proto.generated import common_pb2

        try:
            await self.detect(timeout)
            resp = await self.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            raise failure(self._address, Stage.CACHE, e) from e
        if not resp.success:
            raise NodeFailure(self._address, Stage.CACHE, FailureKind.INTERNAL, resp.message)
        return []

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        raise NodeFailure(self._address, Stage.CACHE, FailureKind.INVALID, "this protocol cannot pin")

    async def close(self) -> None:
        tasks = list(self._background)
        if tasks:  # deferred aborts still waiting get a moment, then go
            _done, pending = await asyncio.wait(tasks, timeout=ABORT_TIMEOUT_S)
            for t in pending:
                t.cancel()
        await self.channel.close()


def _status(info: EngineInfo, loads: Any, features: frozenset[str]) -> NodeStatus:
    bs = max(1, info.page_size)
    running = waiting = used = total = uncached = max_running = 0
    for load in getattr(loads, "loads", ()):
        running += load.num_running_reqs
        waiting += load.num_waiting_reqs
        used += load.num_used_tokens
        total += load.max_total_num_tokens
        uncached += getattr(load, "num_waiting_uncached_tokens", 0)
        max_running += load.max_running_requests
    return NodeStatus(
        node_id="",
        role=info.role,
        engine=info.runtime,
        kv_format=info.kv_format,
        capacity_blocks=total // bs,
        used_blocks=used // bs,
        queued_requests=waiting,
        queued_tokens=uncached,
        running_requests=running,
        max_concurrency=max_running or info.max_running,
        profile=CostProfile(name=info.runtime),
        instance_id=info.instance_id,
        models=(info.model_name,) if info.model_name else (),
        features=features,
        max_context_tokens=info.max_context_tokens,
    )


class GenerateStream:
    """One Generate call as a TokenStream: ids in, detokenized text out.

    The engine streams (``stream=true``): text comes from chunks only, the ``complete`` gives the
    finish and usage (its ids repeat the last chunk's); when the engine answers one ``complete``
    (``stream=false``) its ids are the output. A stop string the gateway matches ends the choice
    at once ("stop"); closing before the finish aborts the engine's work (``aclose``).

    The engine answers whole (``whole_answer``) when the client takes the answer whole
    (``Sampling.stream`` false) and the engine applies every stop string itself: then the first
    delta is the last, and nothing needs the increments (docs/engines.md, Whole answers).
    """

    def __init__(self, client: SmgNodeClient, prompt: Prompt, timeout: float, stage: Stage) -> None:
        self.client = client
        self.prompt = prompt
        self.timeout = timeout
        self.stage = stage
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self.rid = ""
        self.call: Any = None
        self._reader: asyncio.Future[Any] | None = None  # a task reading the call (a handoff leg's)
        self._early: Output | None = None  # a response read before the first delta was asked for
        self._detok: Detokenizer | None = None
        self._completion = 0
        self._chunks = 0
        self._items = 0
        self._finished = False  # the engine said complete (nothing to abort)
        self._closed = False
        self._pending: list[TokenDelta] = []
        self._oov_logged = False
        self.engine_stream = streams(client.runtime, prompt)
        self._held_ids: list[int] = []  # ids pushed whose text is held back: on the next delta

    def __aiter__(self) -> GenerateStream:
        return self

    @property
    def node_id(self) -> str:
        return self.client.address

    @property
    def whole_answer(self) -> bool:
        """The engine answers in one message: the first delta is the last (``base.TokenStream``)."""
        return not self.engine_stream

    async def _prepare(self) -> EngineRequest:
        """Detect the runtime, build the request (a long prompt's ids made into its field off
        the event loop: ``smg_prompt``)."""
        runtime = await self.client.detect(min(self.timeout, 5.0))
        codec = self.client.codec()
        self.rid = self.rid or new_request_id(self.prompt)
        self._detok = self.detokenizer(codec)
        if self.prompt.resumed:  # a migrated generation: the text of the ids it sent was shown
            self._detok.push(packed_ids(self.prompt)[-self.prompt.resumed :])
        stops = requested_stop_ids(self.prompt)
        stops += [t for t in stop_token_ids(codec, self.prompt.sampling.stop) if t not in stops]
        message = runtime.request(self.prompt, self.rid, stops, stream=self.engine_stream)
        tokens = self.prompt.tokens
        if len(tokens) >= REQUEST_OFF_LOOP_BYTES:
            return EngineRequest(message, await asyncio.to_thread(tokenized_field, tokens))
        return EngineRequest(message, tokenized_field(tokens))

    def detokenizer(self, codec: Codec) -> Detokenizer:
        keep = bool(getattr(self.prompt.sampling, "keep_special_tokens", False))
        eos = self.client.info.eos_token_ids if keep and self.client.info is not None else ()
        return Detokenizer(
            codec,
            stop=self.prompt.sampling.stop,
            stop_token_ids=requested_stop_ids(self.prompt),
            skip_special_tokens=not keep,
            hidden_token_ids=eos,  # special tokens shown (tool-call markers), the end of turn not
        )

    async def open(self) -> None:
        try:
            request = (await self._prepare()).serialize()
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._closed = True
            raise failure(self.node_id, self.stage, e) from e
        except NodeFailure as e:  # detection failed: at this stage, for the retry's bookkeeping
            self._closed = True
            raise NodeFailure(self.node_id, self.stage, e.kind, e.detail) from e
        assert self.client.runtime is not None
        self.call = self.client.generate_call(request, self.timeout, whole=not self.engine_stream)

    async def read(self) -> Output | None:
        """The next response (None: the engine ended the stream)."""
        assert self.client.runtime is not None
        try:
            if self.engine_stream:
                msg = await self.call.read()
            elif self._items:  # the whole answer was read
                return None
            else:
                # shielded: a request closed while it waits (its task cancelled) has the engine's
                # work aborted before the call is cancelled, not the call cancelled with the wait
                # (``aclose``; docs/engines.md, Aborts)
                msg = await asyncio.shield(self.call)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            await self.aclose()
            raise failure(self.node_id, self.stage, e) from e
        if msg is grpc.aio.EOF:
            return None
        self._items += 1
        return self.client.runtime.parse(msg, self._completion)

    async def __anext__(self) -> TokenDelta:
        if self._pending:
            return self._pending.pop(0)
        if self._closed:
            raise StopAsyncIteration
        if self.call is None:
            await self.open()
        while True:
            out, self._early = (self._early, None) if self._early is not None else (await self.read(), None)
            if out is None:
                await self.aclose()
                what = "before any token" if self._chunks == 0 else "without finishing"
                raise NodeFailure(self.node_id, self.stage, FailureKind.INTERNAL, f"stream ended {what}")
            delta = self.consume(out)
            if delta is not None:
                return delta

    def consume(self, out: Output) -> TokenDelta | None:
        """A response -> the delta to show (None: nothing to show yet)."""
        if out.index != 0:
            return None  # one choice a request (the gateway sends n=1)
        assert self._detok is not None
        if self.prefill is None:  # split: the prefill leg's count stands (it did the prefill)
            self.cached_tokens = max(self.cached_tokens, self.cached_of(out))
        self._completion = max(self._completion, out.completion_tokens)
        if not out.complete:
            self._chunks += 1
            text, lps, stopped = self._push(out)
            if stopped:
                return self._finish(text, "stop", lps)
            self._held_ids += out.ids
            if not (text or lps):
                return None
            ids, self._held_ids = tuple(self._held_ids), []
            return TokenDelta(text, "", self.completion, lps, token_ids=ids)
        self._finished = True
        text, lps = "", ()
        past = False
        if self._chunks == 0 and out.ids:  # stream=false: the ids are the whole output
            past = self._past_max_tokens(out)
            text, lps, stopped = self._push(out)
            if stopped:
                return self._finish(text, "stop", lps)
        tail = self._detok.finish()
        text += tail.text
        reason = (
            "stop" if tail.stopped else (reported.finish_reason(out.finish_reason, self.node_id) or "stop")
        )
        if past and not tail.stopped and reason not in reported.FAILED:
            reason = "length"
        if reason in reported.FAILED:
            self._closed = True
            detail = (
                "the engine aborted the request" if reason == "abort" else "the engine failed the request"
            )
            raise NodeFailure(self.node_id, self.stage, FailureKind.INTERNAL, detail)
        return self._finish(text, reason, lps)

    def _past_max_tokens(self, out: Output) -> bool:
        """A whole answer of more ids than ``max_tokens``: the engine went on past the limit; its
        ids and count are cut there (as ``Execution`` cuts a stream: docs/engines.md, The response
        stream)."""
        limit = self.prompt.sampling.max_tokens
        if not 0 < limit < len(out.ids):
            return False
        log.warning(
            "engine_past_max_tokens",
            request_id=self.prompt.request_id,
            node=self.node_id,
            max_tokens=limit,
            completion_tokens=len(out.ids),
        )
        del out.ids[limit:]
        del out.logprobs[limit:]
        self._completion = limit
        return True

    def cached_of(self, out: Output) -> int:
        """``out``'s cached tokens, at most the prompt sent (the ids the engine was given)."""
        sent = self.prompt.token_count
        return min(out.cached_tokens, sent) if sent else out.cached_tokens

    def _push(self, out: Output) -> tuple[str, tuple[TokenLogprob, ...], bool]:
        """The text of ``out``'s ids, their log probabilities when the request asked (one a
        token, up to the token that ended the choice), and whether one ended it."""
        assert self._detok is not None
        s = self.prompt.sampling
        if not s.logprobs:
            piece = self._detok.push(out.ids)
            self._note_out_of_vocabulary()
            return piece.text, (), piece.stopped
        # token by token: the log probabilities stop where the text stops
        by_position = {i: lp for i, lp in enumerate(out.logprobs)}
        text, lps = "", []
        for i, token_id in enumerate(out.ids):
            piece = self._detok.push([token_id])
            self._note_out_of_vocabulary()
            text += piece.text
            engine_lp = by_position.get(i)
            if engine_lp is not None and not (piece.stopped and piece.matched_stop == token_id):
                lp = (token_id, engine_lp[1], engine_lp[2])  # the chosen id is the output's
                lps.append(self.client.token_logprob(lp, s.top_logprobs))
            if piece.stopped:
                return text, tuple(lps), True
        return text, tuple(lps), False

    def _note_out_of_vocabulary(self) -> None:
        """Once a request: the engine sent ids its tokenizer does not know (shown as U+FFFD)."""
        assert self._detok is not None
        if self._oov_logged or not self._detok.out_of_vocabulary:
            return
        self._oov_logged = True
        log.warning(
            "smg_out_of_vocabulary_ids",
            address=self.node_id,
            request_id=self.prompt.request_id,
            engine_request_id=self.rid,
            first_id=self._detok.first_out_of_vocabulary,
            count_so_far=self._detok.out_of_vocabulary,
        )

    @property
    def completion(self) -> int:
        """The completion so far, a migrated generation's tokens sent before it included."""
        return self.prompt.resumed + self._completion

    def _finish(self, text: str, reason: str, lps: tuple[TokenLogprob, ...] = ()) -> TokenDelta:
        self._closed = True
        return TokenDelta(text, reason, self.completion, lps)

    async def aclose(self) -> None:
        """Cancel the engine's work if it is still running (docs/engines.md, Aborts):
        ``Abort``, then the call (and the task reading it) cancelled."""
        self._closed = True
        self._pending.clear()
        call = self.call
        if call is None or self._finished:
            return
        self._finished = True
        self.client.spawn(self.client.abort_then_cancel(self.rid, call, self._reader))


def server_args_json(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def packed_ids(prompt: Prompt) -> list[int]:
    return unpack_ids(prompt.tokens)
