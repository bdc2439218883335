"""OpenAI-compatible HTTP workers (vLLM, SGLang, TGI, ... ``http://HOST:PORT``) as nodes.

A worker serves whole requests (a monolithic node): it gets the client's request after the
gateway's normalization (``Prompt.openai``, built by ``gateway.nodeclient.openai_body``) on
``/v1/chat/completions`` or ``/v1/completions``. A request the client takes as it comes is
streamed with ``stream_options.include_usage`` and its SSE stream relayed as token deltas; one
the client takes whole (``stream`` false) is sent with ``stream`` false and the engine's JSON
answer is its one delta (``whole_answer``: the engine applies the stop strings itself, and
framing, parsing and relaying eight or eight thousand SSE events cost both sides more than
one answer; docs/engines.md, Whole answers). Usage comes
from the engine: ``prompt_tokens``, ``completion_tokens`` and
``prompt_tokens_details.cached_tokens`` (vLLM reports the latter with
``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``). A client that goes
away closes the connection, which is how these engines abort a request.

Status: ``GET /health`` and ``GET /v1/models`` (the served models and their ``max_model_len``)
each probe, and the engine's load where it reports one cheaply: SGLang's ``GET /get_load``, else
the request gauges of ``GET /metrics`` (vLLM ``vllm:num_requests_running``/``waiting``, SGLang
``sglang:num_running_reqs``/``num_queue_reqs``); without either, the gateway's own in-flight
count on the worker.

Capabilities are what the wire allows: no KV events (the index learns the worker's blocks from
routing alone), no eviction, pinning or warming, no split serving (``http_pd`` workers take part in it).

One ``aiohttp.ClientSession`` per worker (with its C HTTP parser a call costs a third of the CPU
of a pure-Python client, on a hop every request crosses): pooled keep-alive connections
(bounded), every call bounded in time, every answer in size (an SSE line or event,
``MAX_SSE_LINE_BYTES``; a whole JSON answer, ``MAX_JSON_BYTES``): past a bound the attempt fails
as the worker's fault. A response read to its end gives its connection back to the pool; one
closed before its end closes its connection, which is how the engine learns of an abort. Usage
counts and finish reasons are read through ``reported`` (never trusted as sent).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from prefixgate.cachetier.tokenizer import unpack_ids
from prefixgate.gateway import tracing
from prefixgate.gateway.nodeclient import reported
from prefixgate.gateway.nodeclient.base import (
    Capabilities,
    Handoff,
    KVEvent,
    NodeFailure,
    NodeStatus,
    OpenAIBody,
    PrefillReport,
    Prompt,
    StageTimings,
    TokenDelta,
    TokenLogprob,
)
from prefixgate.gateway.nodeclient.nominal import NOMINAL_PROFILE
from prefixgate.gateway.nodeclient.openai_body import with_priority
from prefixgate.gateway.nodeclient.sse import EventTooLarge, event_data
from prefixgate.gateway.vocab import FailureKind, Stage
from prefixgate.openai.features import Feature

# What the body relays and the stream brings back, as the engine takes and gives it; the engine
# itself refuses what it cannot do (a 400 the client gets). ``response_format`` is relayed as sent:
# OpenAI-compatible servers constrain it.
RELAYED = frozenset(
    f.value
    for f in (Feature.LOGPROBS, Feature.LOGIT_BIAS, Feature.TOOLS, Feature.SEED, Feature.RESPONSE_FORMAT)
)
CAPABILITIES = Capabilities(openai_body=True, features=RELAYED, tenant_salt=True)
ENGINE = "openai-http"
MAX_CONNECTIONS = 1024  # per worker: one per streaming request, the rest waits for the pool
KEEPALIVE_S = 30.0  # an idle connection is closed after this long (none is kept past it)
CONNECT_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT_S = 30.0  # a call that names no timeout of its own
# The longest header line of an answer: a header block up to 16 KiB is read whole, whatever its
# lines (a common HTTP client bound).
MAX_HEADER_BYTES = 16 * 1024
# What a connection reads ahead of its reader: past twice this much the socket is left unread
# until the reader catches up (so a stream buffers at most that much here).
READ_BUFFER_BYTES = 64 * 1024
MAX_PROBE_BYTES = 4 * 1024 * 1024  # /metrics of a busy engine included
MAX_ERROR_BYTES = 64 * 1024
MAX_JSON_BYTES = 32 * 1024 * 1024  # a whole (non-streamed) answer, from a server ignoring ``stream``
# One SSE line, and one event's data: a chunk holds a few tokens (a few KiB with top log
# probabilities); 16 MiB still takes a whole long answer sent in one chunk, and bounds what a
# worker sending one endless line costs (the line is held once as bytes, once as text).
MAX_SSE_LINE_BYTES = 16 * 1024 * 1024
MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024
MAX_MODELS = 256
USAGE_WAIT_S = 5.0  # after the finish, for the usage chunk and the end of the stream
LOAD_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# A generation's headers besides its request id and trace context (``_worker_headers`` too).
SSE_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
WHOLE_HEADERS = {"content-type": "application/json", "accept": "application/json"}


class _TooLarge(ValueError):
    pass


def _status_kind(code: int) -> FailureKind:
    """What an engine's HTTP status means for the gateway (retry elsewhere or not)."""
    if code in (400, 413, 422):
        return FailureKind.INVALID
    if code == 408:
        return FailureKind.TIMEOUT
    if code == 429:
        return FailureKind.OVERLOADED
    if code in (404, 502, 503, 504):
        return FailureKind.UNAVAILABLE
    return FailureKind.INTERNAL


def _error_message(raw: bytes) -> str:
    """The message of an engine's error body (OpenAI's ``error.message``, FastAPI's ``detail``)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", errors="replace")[:300]
    if isinstance(obj, Mapping):
        err = obj.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])[:300]
        for key in ("message", "detail", "error"):
            if obj.get(key):
                return str(obj[key])[:300]
    return str(obj)[:300]


# What a call to a worker raises when the transport fails: aiohttp's errors (refused, reset, a
# worker closing mid-answer, an answer that is not HTTP, timeouts), and an OSError or a
# TimeoutError that reaches us unwrapped.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError, HttpProcessingError, OSError)
# A call's failures: the transport's, and an answer past its bound or not JSON (``_TooLarge`` and
# orjson's errors are ValueErrors).
CALL_ERRORS: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, ValueError)


def _transport_failure(address: str, stage: Stage, e: Exception) -> NodeFailure:
    if isinstance(e, TimeoutError):  # aiohttp's timeouts included
        return NodeFailure(address, stage, FailureKind.TIMEOUT, f"no answer in time ({type(e).__name__})")
    if isinstance(e, aiohttp.ClientConnectorError):
        return NodeFailure(address, stage, FailureKind.UNAVAILABLE, f"cannot connect: {e}"[:300])
    return NodeFailure(address, stage, FailureKind.UNAVAILABLE, f"{type(e).__name__}: {e}"[:300])


def _finish(response: aiohttp.ClientResponse) -> None:
    """Done with ``response``: a body read to its end leaves its connection in the pool (it went
    back there at the end); one not read to its end takes its connection with it, so no half-read
    connection is ever reused and the engine sees the request go."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes: past the bound nothing more is read."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise _TooLarge(f"{response.url.path}: body over {limit} bytes")
    parts: list[bytes] = []
    size = 0
    content = response.content
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"{response.url.path}: body over {limit} bytes")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


@functools.lru_cache(maxsize=64)
def _probe_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """A probe's bounds: ``seconds`` to connect (a free pool slot included) and between reads
    (probe timeouts are few distinct values: cached)."""
    return aiohttp.ClientTimeout(total=None, connect=seconds, sock_connect=seconds, sock_read=seconds)


def _call_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """A request's bounds: ``seconds`` (what is left of its deadline) for a free pool slot and
    the connection, at most ``CONNECT_TIMEOUT_S`` for the connect itself, ``seconds`` between
    reads. Not a total: a stream that keeps coming is never cut by this client."""
    return aiohttp.ClientTimeout(
        total=None, connect=seconds, sock_connect=min(CONNECT_TIMEOUT_S, seconds), sock_read=seconds
    )


def parse_models(raw: bytes) -> tuple[str, ...]:
    """The model ids of a ``/v1/models`` answer."""
    obj = orjson.loads(raw)
    data = obj.get("data") if isinstance(obj, Mapping) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: no 'data' list")
    ids = [m["id"] for m in data[:MAX_MODELS] if isinstance(m, Mapping) and isinstance(m.get("id"), str)]
    return tuple(dict.fromkeys(ids))


def parse_context(raw: bytes) -> int:
    """The context of a ``/v1/models`` answer: the largest ``max_model_len`` of its models (vLLM
    and SGLang give one; 0 when none does)."""
    obj = orjson.loads(raw)
    data = obj.get("data") if isinstance(obj, Mapping) else None
    lengths = [
        m["max_model_len"]
        for m in (data[:MAX_MODELS] if isinstance(data, list) else [])
        if isinstance(m, Mapping) and type(m.get("max_model_len")) is int and m["max_model_len"] > 0
    ]
    return max(lengths, default=0)


def parse_get_load(raw: bytes) -> tuple[int, int]:
    """(running, waiting) from SGLang's ``/get_load`` (one entry per data-parallel rank)."""
    obj = orjson.loads(raw)
    ranks = obj if isinstance(obj, list) else [obj]
    running = waiting = 0
    seen = False
    for r in ranks:
        if isinstance(r, Mapping) and isinstance(r.get("num_reqs"), int):
            seen = True
            w = int(r.get("num_waiting_reqs") or 0)
            waiting += w
            running += max(0, int(r["num_reqs"]) - w)
    if not seen:
        raise ValueError("/get_load: no num_reqs")
    return running, waiting


def parse_metrics(text: str) -> tuple[int, int]:
    """(running, waiting) from the request gauges of a vLLM or SGLang ``/metrics`` page."""
    wanted = [line for line in text.splitlines() if line.startswith(tuple(LOAD_GAUGES))]
    totals = {"running": 0.0, "waiting": 0.0}
    seen = False
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            which = LOAD_GAUGES.get(sample.name)
            if which is not None:
                seen = True
                totals[which] += sample.value
    if not seen:
        raise ValueError("/metrics: no request gauges")
    return int(totals["running"]), int(totals["waiting"])


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("-inf")


def parse_logprobs(raw: Any, chat: bool) -> tuple[TokenLogprob, ...]:
    """An engine's log probabilities of one chunk (chat ``logprobs.content`` entries, or the
    completions arrays), one per token; () when there are none."""
    if not isinstance(raw, dict):
        return ()
    out: list[TokenLogprob] = []
    if chat:
        for e in raw.get("content") or ():
            if not isinstance(e, dict):
                continue
            top = tuple(
                (str(t.get("token", "")), _float(t.get("logprob")))
                for t in e.get("top_logprobs") or ()
                if isinstance(t, dict)
            )
            out.append(TokenLogprob(0, str(e.get("token", "")), _float(e.get("logprob")), top))
        return tuple(out)
    tokens = raw.get("tokens") or []
    values = raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or []
    for i, tok in enumerate(tokens):
        alt = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        value = values[i] if i < len(values) else None
        top = tuple((str(k), _float(v)) for k, v in alt.items())
        out.append(TokenLogprob(0, str(tok), _float(value), top))
    return tuple(out)


def _json_headers(request_id: str) -> dict[str, str]:
    """A JSON call's headers: its request id and trace context (the engine joins the trace)."""
    return {"content-type": "application/json", "x-request-id": request_id, **dict(tracing.CONTEXT.get())}


def _worker_headers(api_key: str) -> dict[str, str]:
    """What every call to a worker carries: who calls, the worker's own key, and that answers
    come uncompressed (nothing is decompressed here, and a bound on a body is a bound on what
    the worker sent)."""
    return {
        "user-agent": "prefixgate",
        "accept-encoding": "identity",
        **({"authorization": f"Bearer {api_key}"} if api_key else {}),
    }


def _tls_context() -> ssl.SSLContext:
    """How an ``https://`` worker is verified: against certifi's CA bundle, the same wherever the
    gateway runs (not the host's store, not SSL_CERT_FILE)."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class HttpOpenAIClient:
    """One OpenAI-compatible HTTP worker (``http://HOST:PORT``, optionally ``.../v1``)."""

    def __init__(self, address: str, engine_priority: str = "off", api_key: str = "") -> None:
        """``api_key``: sent to the worker as ``Authorization: Bearer KEY`` (a worker behind its
        own key); never the client's credentials, which stay at the gateway."""
        try:
            url = URL(address)
        except ValueError:
            url = URL()
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"an HTTP worker address is http://HOST:PORT, got {address!r}")
        self._address = address
        self.engine_priority = engine_priority  # how bodies carry priority (``with_priority``)
        path = url.path.rstrip("/").removesuffix("/v1")
        authority = url.host_port_subcomponent or ""  # IPv6 bracketed, a default port left out
        self.node_id = authority + path
        self._base = f"{url.scheme}://{authority}{path}"
        self._tls = url.scheme == "https"
        self._headers = _worker_headers(api_key)
        self._urls: dict[str, URL] = {}
        # Made on the loop, at the first call (an aiohttp session belongs to the loop it was
        # made on); None again once closed.
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self.models: tuple[str, ...] = ()
        self.inflight = 0
        self._load_path: str | None = None  # None: not probed yet; "": the engine reports none
        self._instance = uuid.uuid4().hex[:16]

    def _url(self, path: str) -> URL:
        """The worker's URL for ``path`` (parsed once a path)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self._base + path)
        return url

    def _session(self) -> aiohttp.ClientSession:
        """The worker's pool, made on the running loop at the first call."""
        session = self._http
        if session is None:
            if self._closed:
                raise RuntimeError(f"the client of worker {self._address} is closed")
            session = self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=MAX_CONNECTIONS,
                    limit_per_host=0,  # one host: ``limit`` is the bound
                    keepalive_timeout=KEEPALIVE_S,
                    use_dns_cache=False,  # a name is resolved at each new connection
                    ssl=_tls_context() if self._tls else True,
                ),
                headers=self._headers,
                timeout=_call_timeout(DEFAULT_TIMEOUT_S),
                cookie_jar=aiohttp.DummyCookieJar(),  # a worker's cookies are not kept or sent
                trust_env=False,  # no proxy, no netrc: a worker is reached directly
                auto_decompress=False,  # asked for identity (``_worker_headers``)
                max_line_size=MAX_HEADER_BYTES,
                max_field_size=MAX_HEADER_BYTES,
                read_bufsize=READ_BUFFER_BYTES,
            )
        return session

    @property
    def address(self) -> str:
        return self._address

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def handoff(self) -> Handoff | None:
        return None  # a whole-request worker (``http_pd.HttpPDClient`` takes part in splits)

    @property
    def load_source(self) -> str:
        """Where the worker's load comes from: an engine path, or ``in-flight`` (ours)."""
        return self._load_path or "in-flight"

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """``GET path``: the status and the body (at most ``MAX_PROBE_BYTES``)."""
        r = await self._session().get(self._url(path), timeout=_probe_timeout(timeout), allow_redirects=False)
        try:
            return r.status, await _read_bounded(r, MAX_PROBE_BYTES)
        finally:
            _finish(r)

    async def _engine_load(self, timeout: float) -> tuple[int, int] | None:
        """The engine's (running, waiting), from the first source that works (remembered)."""
        paths = ("/get_load", "/metrics") if self._load_path is None else (self._load_path,)
        for path in paths:
            if not path:
                continue
            try:
                code, raw = await self._get(path, timeout)
                if code == 200:
                    load = parse_get_load(raw) if path == "/get_load" else parse_metrics(raw.decode())
                    self._load_path = path
                    return load
            except CALL_ERRORS:
                if self._load_path is not None:
                    raise  # a source that worked and fails now: the probe fails
        self._load_path = ""
        return None

    async def status(self, timeout: float) -> NodeStatus:
        try:
            async with asyncio.timeout(timeout):
                (health, _), (code, raw) = await asyncio.gather(
                    self._get("/health", timeout), self._get("/v1/models", timeout)
                )
                if health >= 500:
                    raise NodeFailure(
                        self._address, Stage.PROBE, FailureKind.UNAVAILABLE, f"/health: {health}"
                    )
                if code != 200:
                    raise NodeFailure(
                        self._address, Stage.PROBE, _status_kind(code), f"/v1/models: HTTP {code}"
                    )
                self.models = parse_models(raw)
                context = parse_context(raw)
                load = await self._engine_load(timeout)
        except NodeFailure:
            raise
        except TRANSPORT_ERRORS as e:  # TimeoutError (an OSError) included
            raise _transport_failure(self._address, Stage.PROBE, e) from e
        except (_TooLarge, ValueError) as e:
            raise NodeFailure(self._address, Stage.PROBE, FailureKind.INTERNAL, str(e)[:300]) from e
        running, waiting = load if load is not None else (self.inflight, 0)
        return NodeStatus(
            node_id=self.node_id,
            engine=ENGINE,
            running_requests=running,
            queued_requests=waiting,
            instance_id=self._instance,
            profile=NOMINAL_PROFILE,
            models=self.models,
            max_context_tokens=context,
        )

    def generate(self, prompt: Prompt, *, timeout: float) -> SSEStream:
        return SSEStream(self, prompt, timeout)

    def fallback_body(self, prompt: Prompt) -> OpenAIBody:
        """A prompt without an OpenAI request (token ids only): ``/v1/completions`` with the
        ids, which vLLM and SGLang take; meaningful when the gateway's tokenizer is the
        engine's."""
        s = prompt.sampling
        body: dict[str, Any] = {
            "model": self.models[0] if self.models else "",
            "prompt": unpack_ids(prompt.tokens),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        if prompt.cache_salt:
            body["cache_salt"] = prompt.cache_salt
        return OpenAIBody("completion", body)

    def request_body(self, prompt: Prompt) -> OpenAIBody:
        """What this worker is sent for ``prompt``: its OpenAI request (else ``fallback_body``),
        with its priority where the engine schedules by it (``engine_priority``), not streamed
        when the client takes the answer whole."""
        body = prompt.openai or self.fallback_body(prompt)
        body = with_priority(body, prompt.priority, self.engine_priority)
        if prompt.sampling.stream:
            return body
        whole = {k: v for k, v in body.body.items() if k != "stream_options"}
        whole["stream"] = False
        return OpenAIBody(body.kind, whole)

    async def open(self, prompt: Prompt, timeout: float) -> aiohttp.ClientResponse:
        """Send the request; the response (its body not read yet) once its status is 200."""
        req = self.request_body(prompt)
        accept = SSE_HEADERS if prompt.sampling.stream else WHOLE_HEADERS
        headers = {**accept, "x-request-id": prompt.request_id}
        context = tracing.CONTEXT.get()
        if context:
            headers.update(context)  # the engine joins the request's trace
        response = await self._session().post(
            self._url(PATHS.get(req.kind, PATHS["completion"])),
            data=orjson.dumps(req.body),
            headers=headers,
            timeout=_call_timeout(timeout),
            allow_redirects=False,
        )
        if response.status != 200:
            try:
                raise await self._refusal(response, Stage.GENERATE)
            finally:
                _finish(response)
        return response

    async def _refusal(self, response: aiohttp.ClientResponse, stage: Stage) -> NodeFailure:
        """A non-200 answer as this worker's failure at ``stage``: its status and (bounded) words."""
        try:
            raw = await _read_bounded(response, MAX_ERROR_BYTES)
        except _TooLarge:
            raw = b"(error body too large)"
        detail = f"HTTP {response.status}: {_error_message(raw)}"
        return NodeFailure(self._address, stage, _status_kind(response.status), detail)

    async def _post_json(
        self, path: str, body: Mapping[str, Any], request_id: str, timeout: float
    ) -> aiohttp.ClientResponse:
        """``POST path`` with ``body`` as JSON: the response, its body not read yet."""
        return await self._session().post(
            self._url(path),
            data=orjson.dumps(body),
            headers=_json_headers(request_id),
            timeout=_call_timeout(timeout),
            allow_redirects=False,
        )

    async def answer(
        self, req: OpenAIBody, request_id: str, stage: Stage, timeout: float
    ) -> Mapping[str, Any]:
        """One non-streamed call (``req.body`` sent as is): the engine's JSON answer. Failures
        are this worker's, at ``stage``; cancelling the call closes the connection (the engine
        aborts the request)."""
        try:
            r = await self._post_json(PATHS.get(req.kind, PATHS["completion"]), req.body, request_id, timeout)
            try:
                if r.status != 200:
                    raise await self._refusal(r, stage)
                obj = orjson.loads(await _read_bounded(r, MAX_JSON_BYTES))
            finally:
                _finish(r)
        except CALL_ERRORS as e:
            raise self._call_failure(stage, e) from e
        obj = self._json_object(obj, stage)
        err = obj.get("error")
        if err:
            message = err.get("message") if isinstance(err, Mapping) else err
            raise NodeFailure(self._address, stage, FailureKind.INTERNAL, str(message)[:300])
        return obj

    async def embeddings(
        self, body: Mapping[str, Any], request_id: str, timeout: float
    ) -> tuple[int, Mapping[str, Any]]:
        """``POST /v1/embeddings`` with ``body`` as is: the status and the JSON answer (an error
        body of the worker's included). A transport failure is this worker's NodeFailure."""
        stage = Stage.GENERATE
        try:
            r = await self._post_json("/v1/embeddings", body, request_id, timeout)
            try:
                limit = MAX_JSON_BYTES if r.status == 200 else MAX_ERROR_BYTES
                obj = orjson.loads(await _read_bounded(r, limit))
                status = r.status
            finally:
                _finish(r)
        except CALL_ERRORS as e:
            raise self._call_failure(stage, e) from e
        return status, self._json_object(obj, stage)

    def _call_failure(self, stage: Stage, e: Exception) -> NodeFailure:
        """A call's failure as this worker's: the transport's, or an answer that is not JSON."""
        if isinstance(e, TRANSPORT_ERRORS):
            return _transport_failure(self._address, stage, e)
        return NodeFailure(self._address, stage, FailureKind.INTERNAL, f"bad answer: {e}"[:300])

    def _json_object(self, obj: Any, stage: Stage) -> Mapping[str, Any]:
        if not isinstance(obj, Mapping):
            raise NodeFailure(self._address, stage, FailureKind.INTERNAL, "the answer is not a JSON object")
        return obj

    async def kv_events(self, since_seq: int) -> AsyncGenerator[KVEvent, None]:
        """None: an HTTP worker publishes no KV events over this wire."""
        none: tuple[KVEvent, ...] = ()
        for ev in none:
            yield ev

    def _cannot(self, what: str) -> NodeFailure:
        return NodeFailure(self._address, Stage.CACHE, FailureKind.INVALID, f"an HTTP worker cannot {what}")

    async def warm(self, prompt: Prompt, *, pin_seconds: float, timeout: float) -> PrefillReport:
        raise self._cannot("warm a prompt")

    async def evict(self, hashes: Sequence[int], *, everything: bool, timeout: float) -> list[int]:
        raise self._cannot("evict blocks")

    async def pin(self, hashes: Sequence[int], *, seconds: float, timeout: float) -> tuple[int, int]:
        raise self._cannot("pin blocks")

    async def close(self) -> None:
        """Close the pool and its connections (a call after this raises RuntimeError)."""
        self._closed = True
        session, self._http = self._http, None
        if session is not None:
            await session.close()


class SSEStream:
    """One generation on an HTTP worker: its SSE chunks as token deltas.

    The finishing delta is held back until the engine's usage chunk (or the end of the stream)
    has arrived, so it carries the engine's counts and ``cached_tokens`` is set by then. Asked
    not to stream (``whole_answer``: the client takes the answer whole), the engine answers one
    JSON object, whose delta is the first and the last.
    """

    def __init__(self, client: HttpOpenAIClient, prompt: Prompt, timeout: float) -> None:
        self.cached_tokens = 0
        self.timings = StageTimings()
        self.prefill: PrefillReport | None = None
        self._client = client
        self._prompt = prompt
        self._timeout = timeout
        self._chat = (prompt.openai.kind if prompt.openai else "completion") == "chat"
        self.whole_answer = not prompt.sampling.stream  # one JSON answer (``base.TokenStream``)
        self._response: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[str] | None = None
        self._whole: TokenDelta | None = None  # a server that answered JSON, not a stream
        self._counted = False
        self._done = False
        self._clean_end = False  # the server said [DONE]
        self._completion = 0
        self._prompt_tokens = 0
        self._usage_completion = 0

    def __aiter__(self) -> SSEStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        address = self._client.address
        try:
            if self._events is None and self._whole is None:
                await self._open()
            if self._whole is not None:
                d, self._whole = self._whole, None
                await self.aclose()
                return d
            return await self._next()
        except (NodeFailure, StopAsyncIteration):
            await self.aclose()
            raise
        except TRANSPORT_ERRORS as e:  # TimeoutError (an OSError) included
            await self.aclose()
            raise _transport_failure(address, Stage.GENERATE, e) from e
        except (ValueError, _TooLarge, EventTooLarge) as e:
            await self.aclose()
            raise NodeFailure(address, Stage.GENERATE, FailureKind.INTERNAL, f"bad stream: {e}"[:300]) from e

    async def _open(self) -> None:
        self._client.inflight += 1
        self._counted = True
        self._response = await self._client.open(self._prompt, self._timeout)
        ctype = self._response.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            self._whole = self._whole_answer(
                orjson.loads(await _read_bounded(self._response, MAX_JSON_BYTES))
            )
        elif "text/event-stream" in ctype:
            # Lines are split here, not by aiohttp's reader (whose lines stop at twice its read
            # buffer, ``READ_BUFFER_BYTES``): each chunk as it comes, a line held up to its bound.
            self._events = event_data(
                self._response.content.iter_any(), max_line=MAX_SSE_LINE_BYTES, max_event=MAX_SSE_EVENT_BYTES
            )
        else:
            raise ValueError(f"the answer is neither JSON nor an event stream ({ctype[:80]!r})")

    def _whole_answer(self, obj: Any) -> TokenDelta:
        if not isinstance(obj, dict):
            raise ValueError("the answer is not a JSON object")
        self._check_error(obj)
        self._usage(obj.get("usage"))
        choices = obj.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") if self._chat else None
        message = message if isinstance(message, dict) else {}
        text = message.get("content") if self._chat else choice.get("text")
        finish = self._finish_reason(choice.get("finish_reason")) or "stop"
        lps = parse_logprobs(choice.get("logprobs"), self._chat)
        calls = message.get("tool_calls")
        calls = [{"index": i, **c} for i, c in enumerate(calls) if isinstance(c, dict)] if calls else []
        return self._final(str(text or ""), finish, lps, tuple(calls))

    def _check_error(self, obj: Mapping[str, Any]) -> None:
        err = obj.get("error")
        if err:
            message = err.get("message") if isinstance(err, dict) else err
            raise NodeFailure(self._client.address, Stage.GENERATE, FailureKind.INTERNAL, str(message)[:300])

    def _usage(self, usage: Any) -> None:
        """The engine's counts, where sane (``reported``): one that is not is left unreported."""
        if not isinstance(usage, dict):
            return
        u = reported.openai_usage(usage, sent_prompt=self._prompt.token_count)
        if u.prompt is not None:
            self._prompt_tokens = u.prompt
        if u.completion is not None:
            self._usage_completion = u.completion
        if u.cached is not None:
            self.cached_tokens = u.cached
        bound = self._prompt_tokens or self._prompt.token_count
        if bound and self.cached_tokens > bound:  # an earlier chunk's count, past this prompt count
            self.cached_tokens = bound

    def _final(
        self,
        text: str,
        finish: str,
        lps: tuple[TokenLogprob, ...] = (),
        calls: tuple[Mapping[str, Any], ...] = (),
    ) -> TokenDelta:
        if text:
            self._completion += 1
        return TokenDelta(
            text,
            finish,
            self._usage_completion or self._completion,
            lps,
            self._prompt_tokens,
            calls,
        )

    async def _event(self) -> Mapping[str, Any] | None:
        """The next chunk (None at the end of the stream). A JSON object from orjson is a dict:
        this stream's checks ask ``dict``, a C check, not ``Mapping``, whose ``ABCMeta`` check
        is a Python call (five a streamed token)."""
        assert self._events is not None
        data = await anext(self._events, None)
        if data is None:
            return None
        if data.strip() == "[DONE]":
            self._clean_end = True
            return None
        if not data.strip():
            return {}
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("a stream chunk is not a JSON object")
        self._check_error(obj)
        self._usage(obj.get("usage"))
        return obj

    def _choice(
        self, obj: Mapping[str, Any]
    ) -> tuple[str, str, tuple[TokenLogprob, ...], tuple[Mapping[str, Any], ...]]:
        """A chunk's text, finish reason, log probabilities and tool-call deltas."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return "", "", (), ()
        c = choices[0]
        calls: tuple[Mapping[str, Any], ...] = ()
        if self._chat:
            delta = c.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            text = delta.get("content")
            raw = delta.get("tool_calls")
            if isinstance(raw, list):
                calls = tuple(t for t in raw if isinstance(t, dict))
        else:
            text = c.get("text")
        lps = parse_logprobs(c.get("logprobs"), self._chat)
        return str(text or ""), self._finish_reason(c.get("finish_reason")), lps, calls

    def _finish_reason(self, raw: Any) -> str:
        """OpenAI's finish reason for the engine's (``reported``); an engine that gave up on the
        request (``abort``, ``error``) failed it."""
        finish = reported.finish_reason(raw, self._client.address)
        if finish in reported.FAILED:
            detail = f"the engine ended the request with finish_reason {finish!r}"
            raise NodeFailure(self._client.address, Stage.GENERATE, FailureKind.INTERNAL, detail)
        return finish

    async def _next(self) -> TokenDelta:
        while True:
            obj = await self._event()
            if obj is None:
                if self._clean_end:  # [DONE] without a finish reason: a complete answer all the same
                    await self._drain()
                    d = self._final("", "stop")
                    await self.aclose()
                    return d
                raise StopAsyncIteration  # cut off without a finish: the caller says what that means
            text, finish, lps, calls = self._choice(obj)
            if finish:
                await self._drain()
                d = self._final(text, finish, lps, calls)
                await self.aclose()
                return d
            if text or lps or calls:
                self._completion += max(1, len(lps)) if text or lps else 0
                return TokenDelta(text, "", self._completion, lps, tool_calls=calls)

    async def _drain(self) -> None:
        """After the finish: read on to the usage chunk and the end of the stream (bounded by
        ``USAGE_WAIT_S``; the call's own read timeout still fails the attempt)."""
        wait = asyncio.timeout(USAGE_WAIT_S)
        try:
            async with wait:
                while await self._event() is not None:
                    pass
                await self._to_the_end()
        except TimeoutError:
            if not wait.expired():
                raise

    async def _to_the_end(self) -> None:
        """Read the body to its end, so its keep-alive connection goes back to the pool (a
        response closed early takes its connection with it)."""
        assert self._events is not None
        while await anext(self._events, None) is not None:
            pass

    async def aclose(self) -> None:
        """Close the connection unless the stream was read to its end (the engine aborts a
        request whose connection is gone)."""
        self._done = True
        if self._counted:
            self._counted = False
            self._client.inflight -= 1
        response, self._response = self._response, None
        if response is not None:
            _finish(response)
