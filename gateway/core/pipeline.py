"""The request path: prepare (normalize, tokenize, hash) -> look up -> route -> prefill -> decode.

``Pipeline.decide`` routes through ``gateway.routing.planner`` over the nodes' views, and
``Pipeline.preview`` shows the same plan without changing anything (the admin explain endpoint
uses it). ``Pipeline.execute`` runs the request, retrying on other nodes before the first token
and falling back to monolithic serving when the split pipeline cannot serve. The result is an
``Execution`` whose chunks the HTTP and gRPC front ends stream to the client.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog

from prefixgate.cachetier.hashing import Namespace, block_hashes
from prefixgate.cachetier.index import BlockIndex, StoreOp
from prefixgate.cachetier.tokenizer import Tokenizer, pack_ids
from prefixgate.cachetier.writer import IndexWriter
from prefixgate.gateway.cluster.nodes import Node, NodePool
from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.features import unable
from prefixgate.gateway.core.refusals import refusal
from prefixgate.gateway.core.tenancy import engine_salt, namespace_salt
from prefixgate.gateway.metrics import Metrics
from prefixgate.gateway.nodeclient import NodeFailure, OpenAIBody, Prompt, TokenDelta, TokenStream
from prefixgate.gateway.nodeclient.openai_body import engine_body, for_choice
from prefixgate.gateway.routing import Decision, Policy, RouteInput, parse_policy, planner
from prefixgate.gateway.routing.inflight import InflightPrefixes, extension, follows_inflight, merge_hits
from prefixgate.gateway.routing.planner import Plan, RequestView, Rules
from prefixgate.gateway.state.documents import DocumentStore
from prefixgate.gateway.tokens import ChatEncoder, TemplateLimitError
from prefixgate.gateway.toolcalls.support import ToolPlan, passing_through, plan_tools
from prefixgate.gateway.vocab import FailureKind, Mode, Stage
from prefixgate.openai.exceptions import GatewayError, InvalidRequest, Overloaded, StreamBroken, Unavailable
from prefixgate.openai.features import Feature
from prefixgate.openai.normalize import Layout, NormalizationError, Segment, render_chat, render_completion
from prefixgate.openai.schema import ParsedRequest, Sampling

log = structlog.get_logger("prefixgate.pipeline")

MISPREDICTIONS_BEFORE_RESYNC = 3
TURN_WRAP = 1 << 30  # the tie-break turn counts decisions, modulo this
REQUEST_ID_KEY = "x-prefixgate-request-id"

Delta = TokenDelta  # what an execution streams to the front ends

__all__ = ["Delta", "Execution", "Pipeline", "Plan", "Prepared", "StreamBroken", "Switches"]


@dataclass(slots=True)
class Switches:
    disaggregation: bool = True
    prefix_routing: bool = True
    normalization: bool = True


@dataclass(slots=True)
class Prepared:
    request_id: str
    tenant: str
    namespace: Namespace
    layout: Layout
    tokens: bytes
    hashes: list[int]
    sampling: Sampling
    model: str
    needs: dict[Feature, str] = field(default_factory=dict)  # engine features asked for, by field
    # The request as an OpenAI-compatible HTTP worker takes it; built only for such a node.
    openai_body: Callable[[], OpenAIBody] | None = None
    # What routing knew (request log): the index's longest hit, and how much further prefixes
    # routed but not yet in the index reached (tokens).
    route_notes: dict[str, int] = field(default_factory=dict)
    index_hits: dict[str, int] = field(default_factory=dict)  # node -> leading blocks, per the index
    # The tool-call format the gateway parses the answer with ("": none; ``gateway.toolcalls``).
    tool_parser: str = ""
    # What engines salt their prefix cache with for ``namespace`` (``gateway.core.tenancy.engine_salt``).
    engine_salt: str = ""

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) // 4


@dataclass(slots=True)
class Timings:
    start: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_token_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Failure:
    """One attempt's failure, charged to the node at fault."""

    node: Node
    error: NodeFailure

    def __str__(self) -> str:
        e = self.error
        return f"{e.stage} on {self.node.id}: {e.kind}: {e.detail}"


def backoff_s(attempt: int, s: Settings) -> float:
    """The pause before attempt number ``attempt`` (0-based): none before the first, then
    ``retry_backoff_initial_s`` times ``retry_backoff_multiplier`` per attempt, at most
    ``retry_backoff_max_s``, scaled by a random factor within ``retry_jitter_factor`` of 1 and
    plus up to ``retry_jitter_s``."""
    if attempt == 0:
        return 0.0
    delay = s.retry_backoff_initial_s * s.retry_backoff_multiplier ** (attempt - 1)
    delay = min(s.retry_backoff_max_s, delay)
    if s.retry_jitter_factor:
        delay *= 1.0 + random.uniform(-s.retry_jitter_factor, s.retry_jitter_factor)
    return delay + (random.uniform(0, s.retry_jitter_s) if s.retry_jitter_s else 0.0)


def _not_for_monolithic(e: NodeFailure) -> bool:
    """A prefill node that failed may still serve whole requests; a node that failed to decode may
    not, unless all it refused was pages in another format."""
    decoding = e.stage in (Stage.DECODE, Stage.TRANSFER, Stage.GENERATE)
    return decoding and e.kind != FailureKind.FORMAT_REFUSED


async def _first_delta(stream: TokenStream) -> TokenDelta:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise NodeFailure("", Stage.GENERATE, FailureKind.INTERNAL, "stream ended before any token") from None


class Execution:
    """A routed, started request: the first token is ready, the rest streams.

    It owns the node's token stream and nothing of the pipeline: when it is closed it reports
    itself once through ``on_close`` (the pipeline's accounting).
    """

    def __init__(
        self,
        prep: Prepared,
        *,
        route: str,
        reason: str,
        prefill_node: Node | None,
        decode_node: Node,
        stream: TokenStream,
        first: TokenDelta,
        predicted_tokens: int,
        timings: Timings,
        attempts: int,
        on_close: Callable[[Execution], None],
        stall_timeout_s: float = 0.0,
        cache_shared: bool = False,
    ) -> None:
        self.prep = prep
        self.route = route
        self.reason = reason
        self.prefill_node = prefill_node
        self.decode_node = decode_node
        self._stream = stream
        self._first: TokenDelta | None = first
        self.predicted_tokens = predicted_tokens
        self.timings = timings
        self.attempts = attempts
        self.prompt_tokens = prep.prompt_tokens
        self.completion_tokens = 0
        self.finish_reason = ""
        self.outcome = "incomplete"
        self.failure: NodeFailure | None = None  # what broke the stream after the first token
        self._on_close = on_close
        self._stall_timeout_s = stall_timeout_s
        # The node's engine cache holds other tenants' prefixes too (``gateway.core.tenancy``).
        self._cache_shared = cache_shared
        self._waiting_since = 0.0  # loop time at which ``_next`` began waiting; 0 when not waiting
        self._waiter: asyncio.Task[object] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        self._done = False

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    @property
    def engine_cached_tokens(self) -> int:
        """What the node says it served from its cache (operators' figures)."""
        return self._stream.cached_tokens

    @property
    def cached_tokens(self) -> int:
        """The cached tokens the tenant is told of (body, headers, usage): on an engine whose
        cache is shared between tenants, no more than the tenant's own prefixes account for."""
        engine = max(0, self._stream.cached_tokens)
        if self._cache_shared:
            return min(engine, self.predicted_tokens)
        return engine

    def headers(self) -> dict[str, str]:
        return {
            "x-prefixgate-request-id": self.request_id,
            "x-prefixgate-prefill-node": self.prefill_node.id if self.prefill_node else "",
            "x-prefixgate-decode-node": self.decode_node.id,
            "x-prefixgate-route": self.route,
            "x-prefixgate-cached-tokens": str(self.cached_tokens),
        }

    async def stream(self) -> AsyncIterator[TokenDelta]:
        """Every delta until the finish; raises StreamBroken if the node fails mid-stream."""
        try:
            if self._first is not None:
                d, self._first = self._first, None
                self._account(d)
                yield d
            while not self.finish_reason:
                try:
                    d = await self._next()
                except StopAsyncIteration:
                    break
                if self._past_max_tokens(d):  # an engine that goes on past max_tokens is cut
                    yield self._cut_at_max_tokens()
                    break
                self._account(d)
                yield d
            if not self.finish_reason:
                self.outcome = "broken"
                raise StreamBroken(f"decode node {self.decode_node.id} ended the stream without finishing")
        except NodeFailure as e:
            self.outcome = "broken"
            self.failure = e
            raise StreamBroken(f"decode node {self.decode_node.id} failed mid-stream: {e.kind}") from e
        finally:
            await self.close()

    async def _next(self) -> TokenDelta:
        """The next delta, or a TIMEOUT failure of the decode node when it stalls.

        One timer watches the waits (``_watch``), re-armed once a stall period, instead of one
        timer armed and cancelled for every token: that cost more than relaying the token.
        """
        if self._stall_timeout_s <= 0:
            return await self._stream.__anext__()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        self._waiter = task
        self._waiting_since = loop.time()
        if self._watchdog is None:
            self._watchdog = loop.call_at(self._waiting_since + self._stall_timeout_s, self._watch)
        cancelling = task.cancelling() if task is not None else 0
        try:
            return await self._stream.__anext__()
        except asyncio.CancelledError:
            if self._stalled and task is not None and task.uncancel() <= cancelling:
                raise NodeFailure(
                    self.decode_node.id,
                    Stage.DECODE,
                    FailureKind.TIMEOUT,
                    f"no token for {self._stall_timeout_s:g}s",
                ) from None
            raise  # cancelled from outside (client gone, shutdown)
        finally:
            self._waiting_since = 0.0
            self._waiter = None

    def _watch(self) -> None:
        """Cancel the wait in progress if it has lasted the stall timeout, else watch it on."""
        self._watchdog = None
        if not self._waiting_since or self._done:
            return  # not waiting: the next wait re-arms
        loop = asyncio.get_running_loop()
        due = self._waiting_since + self._stall_timeout_s
        if loop.time() >= due:
            self._stalled = True
            if self._waiter is not None:
                self._waiter.cancel()
        else:
            self._watchdog = loop.call_at(due, self._watch)

    def _past_max_tokens(self, d: TokenDelta) -> bool:
        """``max_tokens`` were relayed and the engine sends more without finishing (its own finish
        right at the limit, ``stop`` or ``length``, passes as it is)."""
        limit = self.prep.sampling.max_tokens
        more = d.completion_tokens > self.completion_tokens  # text held back and flushed is not more
        return 0 < limit <= self.completion_tokens and more and not d.finish_reason

    def _cut_at_max_tokens(self) -> TokenDelta:
        """The finish the engine did not send: ``length`` at ``max_tokens`` (the node's work is
        cancelled when the stream closes; usage counts no more than was asked for)."""
        limit = self.prep.sampling.max_tokens
        log.warning(
            "engine_past_max_tokens",
            request_id=self.request_id,
            node=self.decode_node.id,
            max_tokens=limit,
            completion_tokens=self.completion_tokens,
        )
        self.completion_tokens = limit
        self.finish_reason = "length"
        self.outcome = "ok"
        return TokenDelta(finish_reason="length", completion_tokens=limit)

    def _account(self, d: TokenDelta) -> None:
        if d.completion_tokens:
            self.completion_tokens = d.completion_tokens
        if d.prompt_tokens:  # the engine's own count (an HTTP worker tokenizes itself)
            self.prompt_tokens = d.prompt_tokens
        if d.finish_reason:
            self.finish_reason = d.finish_reason
            self.outcome = "ok"

    async def close(self) -> None:
        """End the request: cancels the node's work if it is still running. Idempotent."""
        if self._done:
            return
        self._done = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        try:
            await self._stream.aclose()
        finally:
            self._on_close(self)


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        index: BlockIndex,
        tokenizer: Tokenizer,
        metrics: Metrics,
        documents: DocumentStore,
        model_tokenizers: Mapping[str, Tokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self.tenancy = settings.tenancy()
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer  # every model's, but those in ``model_tokenizers``
        self.model_tokenizers: Mapping[str, Tokenizer] = model_tokenizers or {}
        self.metrics = metrics
        self.documents = documents
        self.switches = Switches(settings.disaggregation, settings.prefix_routing, settings.normalization)
        self.policy: Policy = parse_policy(settings.policy, {"load_factor": settings.load_factor})
        self.turn = 0  # decisions made
        # The policies' tie-break turn, per model: each model's pools take their own turns.
        self.turns: dict[str, int] = {}
        self.writer = IndexWriter(index)
        self.inflight_prefixes = InflightPrefixes()
        self.on_mispredict: Callable[[Node], None] | None = None
        self.on_finished: Callable[[Execution], None] | None = None  # tenant accounting
        self.inflight = 0

    # -- admission ---------------------------------------------------------------------------

    def admit(self) -> Callable[[], None]:
        """Take an in-flight slot or refuse (``Overloaded``); returns the (idempotent) release.

        Front ends do not call this directly: ``gateway.core.runner`` pairs it with its release.
        """
        limit = self.settings.max_inflight
        if self.inflight >= limit:
            self.metrics.requests.labels("none", "rejected").inc()
            raise Overloaded(
                f"too many requests in flight ({limit}); retry shortly",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1
                self.metrics.inflight.set(self.inflight)

        return release

    # -- prepare ---------------------------------------------------------------------------

    def _passing_through(self, model: str) -> bool:
        """Every node serving ``model`` takes the OpenAI request whole (an HTTP worker): their
        engines render the tools and parse the calls, which are relayed as they send them."""
        nodes = self._serving(model)
        return bool(nodes) and all(n.client.capabilities.openai_body for n in nodes)

    @property
    def renders_templates(self) -> bool:
        """Whether preparing a request may run a model's chat template (CPU work of the
        template's making: it runs off the event loop, ``RequestRunner.compute``)."""
        tokenizers = (self.tokenizer, *self.model_tokenizers.values())
        return any(hasattr(t, "encode_chat") for t in tokenizers)

    def tokenizer_for(self, model: str) -> Tokenizer:
        """The tokenizer of ``model``'s workers (the name the nodes know it by)."""
        return self.model_tokenizers.get(model, self.tokenizer)

    def namespace(self, model: str, tenant: str, cache_salt: str = "") -> Namespace:
        """The tenant's namespace (``gateway.core.tenancy.namespace_salt``); ``cache_salt``: the
        client's own division of it."""
        salt = namespace_salt(tenant, self.settings.shared_namespaces, cache_salt)
        return Namespace(model, salt, self.settings.block_size, self.tokenizer_for(model).name)

    def _check_cache_salt(self, req: ParsedRequest, model: str) -> None:
        """A client's ``cache_salt`` is honoured only where every worker of the model can carry
        it into its engine's cache key; elsewhere it would be ignored, so it is refused."""
        if req.cache_salt and not all(n.client.capabilities.tenant_salt for n in self._serving(model)):
            raise InvalidRequest(
                "'cache_salt' is not supported by the engines serving this model (their protocol "
                "carries no cache salt)",
                param="cache_salt",
            )

    def prepare(
        self,
        req: ParsedRequest,
        tenant: str,
        request_id: str | None = None,
        *,
        body: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """``body``: the client's JSON body, passed on (normalized) to OpenAI-compatible workers."""
        docs = list(req.documents)
        for doc_id in req.document_ids:
            docs.append(self.documents.get(tenant, doc_id))
        normalize = self.switches.normalization
        model = self.pool.canonical(req.model, self.settings.model)  # ``model`` may be an alias
        tokenizer = self.tokenizer_for(model)
        chat_tools = req.tools if req.kind == "chat" else None
        if chat_tools and self._passing_through(model):  # the workers parse their own calls
            tools = ToolPlan("", chat_tools, req.needs)
        else:
            tools = plan_tools(
                chat_tools, req.tool_choice, req.needs, tokenizer, self.settings.tool_call_parser
            )
        try:
            if req.kind == "chat" and isinstance(tokenizer, ChatEncoder):
                # the model's own chat template over the canonical messages (gateway.tokens)
                layout, tokens = tokenizer.encode_chat(
                    req.messages, documents=docs, tools=tools.tools, normalize=normalize
                )
            elif req.kind == "chat":
                layout = render_chat(req.messages, documents=docs, tools=req.tools, normalize=normalize)
                tokens = tokenizer.encode(layout.text)
            elif req.prompt_token_ids is not None:
                tokens = pack_ids(req.prompt_token_ids)
                layout = Layout("", [Segment("prompt", "token ids", 0, len(tokens))])
            else:
                layout = render_completion(req.prompt or "", documents=docs, normalize=normalize)
                tokens = tokenizer.encode(layout.text)
        except NormalizationError as e:
            raise InvalidRequest(str(e), param=e.param) from None
        except TemplateLimitError as e:  # no chat renders like that: the template is at fault (a 500)
            detail = f"{e}; the chat template of model {model!r} is at fault, not the request"
            raise GatewayError(detail, code="chat_template_limit") from None
        n = len(tokens) // 4
        if n == 0:
            raise InvalidRequest("the prompt is empty", param="messages" if req.kind == "chat" else "prompt")
        s = self.settings
        if n > s.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {n} tokens; this model accepts at most {s.max_prompt_tokens}",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        sampling = req.sampling
        self._check_logit_bias(sampling, tokenizer)
        sampling.keep_special_tokens = bool(tools.parser)  # tool-call markers may be special tokens
        if tools.constraint is not None:
            sampling.constraint = tools.constraint  # tool_choice forces calls
        room = s.context_window - n
        if sampling.max_tokens > room:
            if req.max_tokens_given or room < 1:
                raise InvalidRequest(
                    f"prompt ({n} tokens) plus max_tokens ({sampling.max_tokens}) exceeds the context window "
                    f"of {s.context_window} tokens",
                    param=req.max_tokens_param,
                    code="context_length_exceeded",
                )
            sampling.max_tokens = room
        self._check_cache_salt(req, model)
        ns = self.namespace(model, tenant, req.cache_salt)
        hashes = block_hashes(tokens, s.block_size, ns.root())
        salt = engine_salt(ns.tenant)
        return Prepared(
            request_id or uuid.uuid4().hex,
            tenant,
            ns,
            layout,
            tokens,
            hashes,
            sampling,
            model,
            tools.needs,
            partial(engine_body, req, docs, normalize=normalize, raw=body, cache_salt=salt),
            tool_parser=tools.parser,
            engine_salt=salt,
        )

    def _check_logit_bias(self, sampling: Sampling, tokenizer: Tokenizer) -> None:
        """``logit_bias`` names tokens of the model's vocabulary (known when the gateway holds
        the engine's tokenizer)."""
        vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
        if vocab <= 0 or not sampling.logit_bias:
            return
        outside = sorted(t for t in sampling.logit_bias if t >= vocab)
        if outside:
            raise InvalidRequest(
                f"'logit_bias' token ids must be below the vocabulary size of {vocab}, got {outside[0]}",
                param="logit_bias",
            )

    # -- plan --------------------------------------------------------------------------------

    async def lookup(self, prep: Prepared) -> dict[str, int]:
        if not self.switches.prefix_routing or not prep.hashes:
            return {}
        t0 = time.perf_counter()
        try:
            hits = await self.index.lookup(prep.hashes)
        except Exception as e:  # an index failure degrades routing, never the request
            log.warning("index_lookup_failed", error=repr(e)[:200], request_id=prep.request_id)
            hits = {}
        else:
            m = self.metrics
            m.child(m.index_lookup, self.index.backend).observe(time.perf_counter() - t0)
        return self._with_inflight(prep, hits)

    def _with_inflight(self, prep: Prepared, hits: dict[str, int]) -> dict[str, int]:
        """The index's hits, extended by prefixes routed and still computing (``inflight_prefixes``)."""
        tracker = self.inflight_prefixes
        pending = tracker.hits(prep.hashes, time.monotonic())
        gain = extension(hits, pending)
        tracker.stats.lookups += 1
        tracker.stats.extended += gain > 0
        bs = self.settings.block_size
        prep.index_hits = hits
        prep.route_notes = {
            "index_best_tokens": max(hits.values(), default=0) * bs,
            "inflight_gain_tokens": gain * bs,
        }
        if self.settings.inflight_prefixes and follows_inflight(self.policy):
            return merge_hits(hits, pending)
        return hits

    @staticmethod
    def _note_decision(prep: Prepared, decision: Decision) -> None:
        """For the request log: when the longest hit was left on another node, whether that node
        was over the policy's load bound and how loaded it looked."""
        best = max(decision.estimates, key=lambda e: e.hit_blocks, default=None)
        if best is None or best.node_id == decision.node_id or best.hit_blocks <= decision.cached_blocks:
            return
        prep.route_notes["longest_hit_over_bound"] = int(not best.within_bound)
        prep.route_notes["longest_hit_load"] = best.load
        prep.route_notes["longest_hit_queue_ms"] = round(best.queue_s * 1000)

    def _hold_prefix(self, prep: Prepared, node: Node) -> int:
        """Hold the request's chain for ``node`` until its prefill is over (a ticket; 0: none)."""
        if not self.switches.prefix_routing:
            return 0
        return self.inflight_prefixes.add(node.id, prep.hashes, time.monotonic())

    def _request(self, prep: Prepared, hits: dict[str, int]) -> RequestView:
        return RequestView(
            prompt_tokens=prep.prompt_tokens,
            block_size=self.settings.block_size,
            hits=hits,
            first_block=prep.hashes[0] if prep.hashes else 0,
        )

    def _rules(self) -> Rules:
        s, sw = self.settings, self.switches
        return Rules(sw.disaggregation, sw.prefix_routing, s.min_disagg_tokens, s.ttft_budget_s)

    def _route_input(self, prep: Prepared, hits: dict[str, int], transfer: bool) -> RouteInput:
        return RouteInput(
            prompt_tokens=prep.prompt_tokens,
            block_size=self.settings.block_size,
            hits=hits,
            first_block=prep.hashes[0] if prep.hashes else 0,
            transfer=transfer,
            turn=self.turns.get(prep.model, 0),
        )

    def _choose(self, nodes: list[Node], inp: RouteInput) -> Decision:
        policy = self.policy if self.switches.prefix_routing else planner.WITHOUT_PREFIX_ROUTING
        return policy.choose(inp, [n.view() for n in nodes])

    def _serving(self, model: str) -> list[Node]:
        """The nodes serving ``model``: a request is only ever routed within its model's pools."""
        return self.pool.serving(model, self.settings.model)

    def _monolithic_candidates(self, exclude: set[str], model: str) -> list[Node]:
        """Nodes that may serve the whole request (``planner.monolithic_candidates``)."""
        by_id = {n.id: n for n in self._serving(model)}
        views = [n.view() for n in by_id.values()]
        return [by_id[v.node_id] for v in planner.monolithic_candidates(views, exclude)]

    def _plan(self, prep: Prepared, hits: dict[str, int], exclude: set[str], turn: int) -> Plan:
        views = [n.view() for n in self._serving(prep.model)]
        request = self._request(prep, hits)
        return planner.plan(request, views, self.policy, self._rules(), exclude=exclude, turn=turn)

    def decide(self, prep: Prepared, hits: dict[str, int], exclude: set[str] | None = None) -> Plan:
        """Which mode, which nodes, and why: the nodes' views through ``planner.plan``.

        A real decision: the policies' tie-break turn moves on.
        """
        turn = self.turns.get(prep.model, 0)
        plan = self._plan(prep, hits, exclude or set(), turn)
        self.turns[prep.model] = (turn + 1) % TURN_WRAP
        self.turn = (self.turn + 1) % TURN_WRAP
        return plan

    def preview(self, prep: Prepared, hits: dict[str, int]) -> Plan:
        """The plan the next ``execute`` of this request would follow, changing nothing.

        The admin explain endpoint and prefill-as-a-service use this.
        """
        return self._plan(prep, hits, set(), self.turns.get(prep.model, 0))

    # -- execute -------------------------------------------------------------------------------

    async def execute(self, prep: Prepared) -> Execution:
        """Route and start the request; raises Overloaded or Unavailable when no node can serve it.

        The split path is tried on the best prefill/decode pair, then on the next best after each
        failure (the node at fault excluded); when it cannot serve, the request falls back to
        monolithic serving, itself tried on other nodes. At most ``retry_max_attempts`` a path, with
        backoff between attempts, all within the request's deadline. Nothing is retried once the
        first token is out (``Execution.stream`` raises StreamBroken then).
        """
        deadline = time.monotonic() + self.settings.request_timeout_s
        unserved = unable(self.pool.nodes.values(), prep.needs)  # 400 when no node can serve it
        if prep.tool_parser:  # the gateway parses the tool calls: not for pass-through workers
            unserved |= passing_through(self.pool.nodes.values())
        hits = await self.lookup(prep)
        plan = self.decide(prep, hits, set(unserved))
        failures: list[Failure] = []
        attempts = 0

        if plan.mode.mode == Mode.DISAGGREGATED:
            excluded: set[str] = set(unserved)
            for attempt in range(self.settings.retry_max_attempts):
                pnode = self.pool.by_id(plan.prefill.node_id or "") if plan.prefill else None
                dnode = self.pool.by_id(plan.decode_node or "")
                if plan.mode.mode != Mode.DISAGGREGATED or pnode is None or dnode is None:
                    break
                if not await self._pause(attempt, deadline):
                    break
                attempts += 1
                if plan.prefill is not None:
                    self._note_decision(prep, plan.prefill)
                outcome = await self._disaggregated(prep, plan, pnode, dnode, deadline, attempts)
                if isinstance(outcome, Execution):
                    return outcome
                self._failed(outcome, failures)
                if not outcome.error.kind.retryable:
                    break
                excluded.add(outcome.node.id)
                plan = self.decide(prep, hits, excluded)

        if failures:
            route, reason = (
                Mode.FALLBACK,
                "split pipeline failed: " + "; ".join(str(f) for f in failures[-3:]),
            )
            self.metrics.fallbacks.labels("split_failed").inc()
        elif plan.mode.mode == Mode.FALLBACK:
            route, reason = Mode.FALLBACK, plan.mode.reason
            self.metrics.fallbacks.labels("unavailable").inc()
        else:
            route, reason = Mode.MONOLITHIC, plan.mode.reason

        if all(f.error.kind.retryable for f in failures):
            excluded = {f.node.id for f in failures if _not_for_monolithic(f.error)} | unserved
            for attempt in range(self.settings.retry_max_attempts):
                candidates = self._monolithic_candidates(excluded, prep.model)
                if not candidates or not await self._pause(attempt, deadline):
                    break
                decision = self._choose(candidates, self._route_input(prep, hits, transfer=False))
                node = self.pool.by_id(decision.node_id or "")
                if node is None:
                    break
                attempts += 1
                self._note_decision(prep, decision)
                outcome = await self._monolithic(prep, node, decision, route, reason, deadline, attempts)
                if isinstance(outcome, Execution):
                    return outcome
                self._failed(outcome, failures)
                if not outcome.error.kind.retryable:
                    break
                excluded.add(outcome.node.id)

        self.metrics.requests.labels(route, "failed").inc()
        refused = refusal(failures[-1].error, prep.needs.get(Feature.RESPONSE_FORMAT)) if failures else None
        if refused is not None:  # the engine judged the client's own request: its answer is a 400 (422)
            raise refused
        if failures and all(f.error.kind == FailureKind.OVERLOADED for f in failures):
            raise Overloaded("every node is at capacity; retry shortly", retry_after=1)
        detail = "; ".join(str(f) for f in failures[-3:]) or f"no node can serve it: {plan.mode.reason}"
        raise Unavailable(f"no node could serve the request ({detail})", retry_after=2)

    async def _pause(self, attempt: int, deadline: float) -> bool:
        """Back off before a retry; False when the deadline leaves no time for another attempt."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pause = backoff_s(attempt, self.settings)
        if pause:
            await asyncio.sleep(min(pause, left))
        return time.monotonic() < deadline

    def _failed(self, f: Failure, failures: list[Failure]) -> None:
        failures.append(f)
        self._note_failure(f)
        self.metrics.retries.labels(f.error.stage.value).inc()

    def _note_failure(self, f: Failure) -> None:
        if f.error.kind not in (FailureKind.OVERLOADED, FailureKind.INVALID, FailureKind.CONSTRAINT):
            f.node.breaker.on_failure(time.monotonic())
        else:
            f.node.breaker.on_release()
        f.node.last_error = str(f)[:500]
        log.warning(
            "node_attempt_failed",
            node=f.node.id,
            stage=f.error.stage.value,
            kind=f.error.kind.value,
            detail=f.error.detail[:200],
        )

    async def _first(
        self, stream: TokenStream, deadline: float, prefill_node: Node | None, node: Node
    ) -> TokenDelta:
        """The attempt's first delta, within ``first_token_timeout_s`` and the request deadline.

        A silent attempt is charged to the node still computing: the prefill node while its leg
        has not reported (a hung prefill is not the decode node's fault) unless the decode node
        fails its health probes meanwhile, or has missed probe rounds the prefill node answered
        (then the prefill is most likely waiting to push pages to it), else the node that should
        be streaming. The caller closes the stream, which cancels the nodes' work.
        """
        limit = deadline - time.monotonic()
        if self.settings.first_token_timeout_s > 0:
            limit = min(limit, self.settings.first_token_timeout_s)
        try:
            async with asyncio.timeout(max(0.001, limit)):
                return await _first_delta(stream)
        except TimeoutError:
            if (
                prefill_node is not None
                and stream.prefill is None
                and node.reachable
                and not self._quieter(node, prefill_node)
            ):
                at, stage = prefill_node, Stage.PREFILL
            elif prefill_node is not None and stream.prefill is None:
                at, stage = node, Stage.TRANSFER
            else:
                at, stage = node, (Stage.DECODE if prefill_node is not None else Stage.GENERATE)
            raise NodeFailure(at.id, stage, FailureKind.TIMEOUT, f"no first token in {limit:.3g}s") from None

    def _quieter(self, a: Node, b: Node) -> bool:
        """``a`` last answered its probe more than two probe intervals before ``b`` did (two nodes
        polled out of phase differ by less than one): it went silent first. A node whose probe
        already failed is caught by ``reachable``."""
        gap = 2 * self.pool.stats_interval_s
        return bool(a.status_at and b.status_at) and a.status_at < b.status_at - gap

    @staticmethod
    def _prompt(prep: Prepared, node: Node | None = None) -> Prompt:
        """The prompt for ``node``; with the OpenAI request when the node generates from it."""
        openai = None
        if node is not None and node.client.capabilities.openai_body and prep.openai_body is not None:
            openai = for_choice(prep.openai_body(), prep.sampling.seed, prep.sampling.choice)
        return Prompt(prep.request_id, prep.tokens, prep.hashes, prep.sampling, openai, prep.engine_salt)

    @staticmethod
    def _blamed(e: NodeFailure, *nodes: Node) -> Node:
        """The node a failure names (the last one given when it names none of them)."""
        for n in nodes:
            if e.node_id in (n.client.address, n.address, n.id):
                return n
        return nodes[-1]

    async def _disaggregated(
        self, prep: Prepared, plan: Plan, pnode: Node, dnode: Node, deadline: float, attempts: int
    ) -> Execution | Failure:
        assert plan.prefill is not None
        handoff = pnode.client.handoff
        if handoff is None:
            return Failure(pnode, NodeFailure(pnode.id, Stage.PREFILL, FailureKind.INVALID, "cannot split"))
        predicted = plan.prefill.cached_blocks * self.settings.block_size
        uncached = max(0, prep.prompt_tokens - predicted)
        timings = Timings()
        pnode.local_requests += 1
        pnode.local_tokens += uncached
        ticket, served = self._hold_prefix(prep, pnode), False
        pnode.breaker.on_dispatch()
        dnode.breaker.on_dispatch()
        stream = handoff.start(
            self._prompt(prep, pnode),
            pnode.client,
            dnode.client,
            timeout=max(0.01, deadline - time.monotonic()),
        )
        try:
            first = await self._first(stream, deadline, pnode, dnode)
            served = True
        except NodeFailure as e:
            await stream.aclose()
            blamed = self._blamed(e, pnode, dnode)
            if blamed is pnode:
                dnode.breaker.on_release()  # no verdict on a decode node the request never reached
            elif stream.prefill is not None:
                pnode.breaker.on_success()  # the prefill node did its part; its partner failed
            else:
                pnode.breaker.on_release()
            return Failure(blamed, e)
        except BaseException:
            await stream.aclose()  # cancelled (client gone): nothing left running on the nodes
            pnode.breaker.on_release()
            dnode.breaker.on_release()
            raise
        finally:
            pnode.local_requests -= 1
            pnode.local_tokens -= uncached
            self.inflight_prefixes.done(ticket, time.monotonic(), served=served)
        pnode.breaker.on_success()
        dnode.breaker.on_success()
        report = stream.prefill
        if report is not None:
            pnode.observe_prefill(
                pnode.profile_prefill_s(prep.prompt_tokens - report.cached_tokens, report.cached_tokens),
                report.prefill_s,
            )
            self.metrics.transfer_bytes.inc(report.transfer_bytes)
        t = stream.timings
        timings.queue_s, timings.prefill_s, timings.transfer_s = t.queue_s, t.prefill_s, t.transfer_s
        timings.first_token_at = time.perf_counter()
        self._record(prep, pnode.id, dnode.id)
        return self._started(
            prep,
            Mode.DISAGGREGATED,
            plan.mode.reason,
            pnode,
            dnode,
            stream,
            first,
            predicted,
            timings,
            attempts,
        )

    async def _monolithic(
        self,
        prep: Prepared,
        node: Node,
        decision: Decision,
        route: str,
        reason: str,
        deadline: float,
        attempts: int,
    ) -> Execution | Failure:
        predicted = decision.cached_blocks * self.settings.block_size
        uncached = max(0, prep.prompt_tokens - predicted)
        timings = Timings()
        node.breaker.on_dispatch()
        # Counted as ours until its prefill is done, as on the split path: between two stats polls
        # the policy otherwise sees none of the requests it just sent and piles them on one node.
        node.local_requests += 1
        node.local_tokens += uncached
        ticket, served = self._hold_prefix(prep, node), False
        stream = node.client.generate(
            self._prompt(prep, node), timeout=max(0.01, deadline - time.monotonic())
        )
        try:
            first = await self._first(stream, deadline, None, node)
            served = True
        except NodeFailure as e:
            await stream.aclose()
            return Failure(node, e)
        except BaseException:
            await stream.aclose()
            node.breaker.on_release()
            raise
        finally:
            node.local_requests -= 1
            node.local_tokens -= uncached
            self.inflight_prefixes.done(ticket, time.monotonic(), served=served)
        node.breaker.on_success()
        timings.queue_s, timings.prefill_s = stream.timings.queue_s, stream.timings.prefill_s
        timings.first_token_at = time.perf_counter()
        self._record(prep, node.id)
        return self._started(prep, route, reason, None, node, stream, first, predicted, timings, attempts)

    def _started(
        self,
        prep: Prepared,
        route: str,
        reason: str,
        prefill_node: Node | None,
        decode_node: Node,
        stream: TokenStream,
        first: TokenDelta,
        predicted: int,
        timings: Timings,
        attempts: int,
    ) -> Execution:
        decode_node.active_streams += 1
        return Execution(
            prep,
            route=route,
            reason=reason,
            prefill_node=prefill_node,
            decode_node=decode_node,
            stream=stream,
            first=first,
            predicted_tokens=predicted,
            timings=timings,
            attempts=attempts,
            on_close=self.finished,
            stall_timeout_s=self.settings.stall_timeout_s,
            cache_shared=self.tenancy.shares_cache(
                (prefill_node or decode_node).client.capabilities.tenant_salt
            ),
        )

    # -- bookkeeping ---------------------------------------------------------------------------

    def _record(self, prep: Prepared, *nodes: str) -> None:
        """Record the blocks now on these nodes: queued for the batching writer, off the hot path."""
        if prep.hashes:
            chain = tuple(prep.hashes)
            self.writer.submit_many(StoreOp(n, chain) for n in nodes)

    def _check_prediction(self, node: Node, predicted: int, reported: int) -> None:
        """A node whose reported hits keep falling short of the index's prediction gets resynced:
        this is how a silently emptied cache (a node restart the events missed) is caught. A node
        without KV events has nothing to resync from (and may not report cached tokens at all)."""
        if not node.client.capabilities.kv_events:
            return
        if predicted >= 2 * self.settings.block_size and reported < predicted // 2:
            node.mispredictions += 1
            if node.mispredictions >= MISPREDICTIONS_BEFORE_RESYNC and self.on_mispredict is not None:
                node.mispredictions = 0
                self.metrics.resyncs.labels("mispredicted").inc()
                log.warning("index_mispredicts_node", node=node.id, predicted=predicted, reported=reported)
                self.on_mispredict(node)
        else:
            node.mispredictions = 0

    def finished(self, ex: Execution) -> None:
        """A closed execution's accounting: node load, breaker, metrics, the request's log line."""
        ex.decode_node.active_streams -= 1
        if ex.failure is not None:  # broke after the first token: the node's fault all the same
            ex.decode_node.breaker.on_failure(time.monotonic())
            ex.decode_node.last_error = str(ex.failure)[:500]
        t = ex.timings
        ttft = (t.first_token_at - t.start) if t.first_token_at else 0.0
        m = self.metrics
        node = (ex.prefill_node or ex.decode_node).id
        m.observe_request(
            ex.route,
            ex.outcome,
            ttft=ttft,
            queue_s=t.queue_s,
            prefill_s=t.prefill_s,
            transfer_s=t.transfer_s,
            node=node,
            transfer_node=ex.prefill_node.id if ex.prefill_node is not None else None,
        )
        m.observe_hit(node, ex.prompt_tokens, ex.engine_cached_tokens, ex.predicted_tokens)
        self._check_prediction(
            ex.prefill_node or ex.decode_node, ex.predicted_tokens, ex.engine_cached_tokens
        )
        log.info(
            "request",
            request_id=ex.request_id,
            route=ex.route,
            prefill_node=ex.prefill_node.id if ex.prefill_node else None,
            decode_node=ex.decode_node.id,
            prompt_tokens=ex.prompt_tokens,
            cached_tokens=ex.engine_cached_tokens,
            predicted_cached_tokens=ex.predicted_tokens,
            **ex.prep.route_notes,
            index_chosen_tokens=ex.prep.index_hits.get(node, 0) * self.settings.block_size,
            computed_tokens=ex.prompt_tokens - ex.engine_cached_tokens,
            completion_tokens=ex.completion_tokens,
            outcome=ex.outcome,
            attempts=ex.attempts,
            ttft_ms=round(ttft * 1000, 2),
            queue_ms=round(t.queue_s * 1000, 2),
            prefill_ms=round(t.prefill_s * 1000, 2),
            transfer_ms=round(t.transfer_s * 1000, 2),
            first_token_ms=round(max(0.0, ttft - t.queue_s - t.prefill_s - t.transfer_s) * 1000, 2),
            total_ms=round((time.perf_counter() - t.start) * 1000, 2),
            reason=ex.reason,
        )
        if self.on_finished is not None:
            self.on_finished(ex)

    async def close(self) -> None:
        await self.writer.close(timeout=2.0)
