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

PD (split serving) over HTTP, SGLang's way and vLLM's, is ``backends.http_pd`` over the node's
bootstrap handoff (``backends.pd``). The requests' parsing is ``backends.http_requests``, the
answers' shapes ``backends.http_wire``.

Runs on uvicorn in the node's own event loop, next to the gRPC server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixgate.backends.choices import Gen, Started, close_all, merged, start_all
from prefixgate.backends.engine import Sampling
from prefixgate.backends.errors import NodeError
from prefixgate.backends.generation import Chunk
from prefixgate.backends.http_pd import HTTPLegs, PDLink
from prefixgate.backends.http_requests import (
    HTTPOptions,
    Prompt,
    Renderer,
    choice_sampling,
    pd_request,
    sampling_of,
    sglang_sampling,
    shipped_tokenizer,
)
from prefixgate.backends.http_wire import DONE, JSON, Answer, Wire, api_error, sse
from prefixgate.backends.node import Node
from prefixgate.cachetier.tokenizer import pack_ids, unpack_ids
from prefixgate.gateway import tracing
from prefixgate.gateway.core.errors import GatewayError, invalid
from prefixgate.openai.embeddings import parse_embeddings, response_body
from prefixgate.openai.errors import APIError, from_domain
from prefixgate.openai.schema import ParsedRequest, parse_json, parse_request

__all__ = ["HTTPOptions", "NodeAPI", "NodeHTTP", "PDLink", "create_app", "shipped_tokenizer"]

Handler = Callable[[Request], Awaitable[Response]]


def _guard(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        tracing.received(request.headers.get(tracing.TRACEPARENT_KEY, ""), path=request.url.path)
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except GatewayError as e:
            return from_domain(e).response()
        except NodeError as e:
            return api_error(e).response()

    return wrapped


class NodeAPI:
    """The HTTP handlers over one ``Node``."""

    def __init__(self, node: Node, options: HTTPOptions | None = None, pd: PDLink | None = None) -> None:
        self.node = node
        self.options = options or HTTPOptions()
        self.renderer = Renderer(self.options.model, node.block_size, self.options.normalize)
        self.pd = pd
        self.legs = HTTPLegs(node, pd) if pd is not None else None

    async def close(self) -> None:
        if self.legs is not None:
            await self.legs.close()

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
            return await start_all(rest)
        except BaseException:
            await first[0].aclose()
            raise

    async def _run(
        self, body: Mapping[str, Any], prompt: Prompt, sampling: Sampling, n: int = 1
    ) -> tuple[list[Started], dict[str, Any]]:
        """Start a request's ``n`` choices: whole here, or this node's leg of a PD pair
        (``HTTPLegs.start``). Returns each choice's chunks and first chunk (choice order), and
        fields to add to the response (vLLM's ``kv_transfer_params``).

        Choice ``i`` samples with ``choice_sampling(sampling, i)``. Whole: choice 0 is prefilled
        first, the others then start at once and reuse its blocks, so the prompt is computed once."""
        pd = pd_request(body)
        role = self.node.config.role
        choices = [choice_sampling(sampling, i) for i in range(n)]
        if pd is None or (pd.leg == "sglang" and role not in ("prefill", "decode")):
            first = await self._start(prompt, choices[0])
            return [first, *await self._after(first, [self._start(prompt, s) for s in choices[1:]])], {}
        if self.legs is None:
            raise invalid("this node's HTTP endpoint takes no disaggregated requests", "kv_transfer_params")
        return await self.legs.start(pd, prompt, choices)

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
            await close_all(started)
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
            await close_all(started)

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

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's ``/v1/embeddings`` from the engine's ``embed`` (the tiny engine's pooled
        hidden states); an engine without one refuses."""
        req = parse_embeddings(await self._json(request), self.options.model)
        engine = self.node.engine
        embed = getattr(engine, "embed", None)
        if embed is None:
            raise invalid(
                f"the {engine.name} engine serves no embeddings", "model", code="embeddings_unsupported"
            )
        width = int(getattr(engine, "embedding_width", 0))
        if req.dimensions is not None and req.dimensions != width:
            raise invalid(f"'dimensions': this model's embeddings have {width}", "dimensions")
        vectors: list[list[float]] = []
        tokens = 0
        for i, item in enumerate(req.inputs):
            packed = self.renderer.text_tokens(item) if isinstance(item, str) else pack_ids(list(item))
            count = len(packed) // 4
            if count > self.node.context_tokens:
                raise invalid(
                    f"'input[{i}]' is {count} tokens; this model's context is {self.node.context_tokens}",
                    "input",
                    code="context_length_exceeded",
                )
            tokens += count
            vectors.append(await embed(packed))
        return JSON(response_body(req.model, vectors, req.encoding_format, tokens))

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
        length = self.node.context_tokens
        return JSON({"count": len(ids), "max_model_len": length, "tokens": ids, "token_strs": None})

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
                "max_model_len": self.node.context_tokens,
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
                "context_length": self.node.context_tokens,
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
            Route("/v1/embeddings", g(self.embeddings), methods=["POST"]),
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
