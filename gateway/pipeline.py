"""The request path: prepare (normalize, tokenize, hash) -> look up -> route -> prefill -> decode.

``Pipeline.decide`` routes through ``gateway.routing.planner`` over the nodes' views, and
``Pipeline.preview`` shows the same plan without changing anything (the admin explain endpoint
uses it). ``Pipeline.execute`` runs the request, retrying on other nodes before the first token
and falling back to monolithic serving when the split pipeline cannot serve. The result is an
``Execution`` whose chunks the HTTP and gRPC front ends stream to the client.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from cachetier.hashing import Namespace, block_hashes
from cachetier.index import BlockIndex, StoreOp
from cachetier.tokenizer import Tokenizer, pack_ids
from cachetier.writer import IndexWriter
from gateway.config import Settings
from gateway.documents import DocumentStore
from gateway.errors import APIError
from gateway.exceptions import InvalidRequest, Overloaded
from gateway.metrics import Metrics
from gateway.nodes import Node, NodePool
from gateway.normalize import Layout, NormalizationError, Segment, render_chat, render_completion
from gateway.routing import Decision, Policy, RouteInput, parse_policy, planner
from gateway.routing.planner import Plan, RequestView, Rules
from gateway.schema import ParsedRequest, Sampling
from gateway.vocab import Mode
from prefixgate.v1 import node_pb2

log = structlog.get_logger("prefixgate.pipeline")

MAX_ATTEMPTS = 3
MISPREDICTIONS_BEFORE_RESYNC = 3
TURN_WRAP = 1 << 30  # the tie-break turn counts decisions, modulo this
REQUEST_ID_KEY = "x-prefixgate-request-id"
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,  # kv handle gone on the decode node
    grpc.StatusCode.FAILED_PRECONDITION,  # KV format refused by the decode node
}


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

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) // 4


@dataclass(slots=True)
class Delta:
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0


@dataclass(slots=True)
class Timings:
    start: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_token_at: float = 0.0


class _stop_at(stop_base):
    """Stop retrying once the request's deadline has passed."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return time.monotonic() >= self.deadline


class StreamBroken(Exception):
    """The node failed after tokens reached the client: the stream must end with an error."""


class NodeFailure(Exception):
    def __init__(self, node: Node, stage: str, code: grpc.StatusCode | None, detail: str) -> None:
        super().__init__(f"{stage} on {node.id}: {code.name if code else 'error'}: {detail}")
        self.node = node
        self.stage = stage
        self.code = code
        self.detail = detail


def _rpc_failure(node: Node, stage: str, err: BaseException) -> NodeFailure:
    if isinstance(err, grpc.aio.AioRpcError):
        return NodeFailure(node, stage, err.code(), err.details() or "")
    if isinstance(err, asyncio.TimeoutError):
        return NodeFailure(node, stage, grpc.StatusCode.DEADLINE_EXCEEDED, "timed out")
    return NodeFailure(node, stage, None, repr(err))


STAGE_KEY = "x-prefixgate-stage"


def _transfer_failed(err: grpc.aio.AioRpcError) -> bool:
    """Did the prefill node fail to push KV to the decode node (rather than fail itself)?"""
    for key, value in err.trailing_metadata() or ():
        if key == STAGE_KEY:
            return bool(value == "transfer")
    details = (err.details() or "").lower()
    return "transfer" in details and "decode" in details


class Execution:
    """A routed, started request: the first token is ready, the rest streams."""

    def __init__(
        self,
        pipeline: Pipeline,
        prep: Prepared,
        *,
        route: str,
        reason: str,
        prefill_node: Node | None,
        decode_node: Node,
        call: grpc.aio.UnaryStreamCall,  # type: ignore[type-arg]
        first: list[Delta],
        cached_tokens: int,
        predicted_tokens: int,
        timings: Timings,
        attempts: int,
    ) -> None:
        self.pipeline = pipeline
        self.prep = prep
        self.route = route
        self.reason = reason
        self.prefill_node = prefill_node
        self.decode_node = decode_node
        self._call = call
        self._first = first
        self.cached_tokens = cached_tokens
        self.predicted_tokens = predicted_tokens
        self.timings = timings
        self.attempts = attempts
        self.prompt_tokens = prep.prompt_tokens
        self.completion_tokens = 0
        self.finish_reason = ""
        self._done = False
        self.outcome = "incomplete"
        decode_node.active_streams += 1

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def headers(self) -> dict[str, str]:
        return {
            "x-prefixgate-request-id": self.request_id,
            "x-prefixgate-prefill-node": self.prefill_node.id if self.prefill_node else "",
            "x-prefixgate-decode-node": self.decode_node.id,
            "x-prefixgate-route": self.route,
            "x-prefixgate-cached-tokens": str(self.cached_tokens),
        }

    async def stream(self) -> AsyncIterator[Delta]:
        """Every delta until the finish; raises StreamBroken if the node fails mid-stream."""
        try:
            for d in self._first:
                self._account(d)
                yield d
            self._first = []
            if self.finish_reason:
                return
            # The first chunk came from read(): gRPC forbids mixing read() and iteration on one call.
            while (chunk := await self._call.read()) is not grpc.aio.EOF:
                d = Delta(chunk.text, chunk.finish_reason, chunk.completion_tokens)
                if chunk.finish_reason and chunk.cached_tokens:
                    self.cached_tokens = chunk.cached_tokens  # usage rides on the last chunk
                self._account(d)
                yield d
                if chunk.finish_reason:
                    return
            if not self.finish_reason:
                raise StreamBroken(f"decode node {self.decode_node.id} ended the stream without finishing")
        except grpc.aio.AioRpcError as e:
            self.outcome = "broken"
            raise StreamBroken(f"decode node {self.decode_node.id} failed mid-stream: {e.code().name}") from e
        finally:
            await self.close()

    def _account(self, d: Delta) -> None:
        if d.completion_tokens:
            self.completion_tokens = d.completion_tokens
        if d.finish_reason:
            self.finish_reason = d.finish_reason
            self.outcome = "ok"

    async def close(self) -> None:
        if self._done:
            return
        self._done = True
        if not self._call.done():  # a finished call has nothing to cancel (and cancel() is not free)
            self._call.cancel()
        self.decode_node.active_streams -= 1
        self.pipeline.finished(self)


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        pool: NodePool,
        index: BlockIndex,
        tokenizer: Tokenizer,
        metrics: Metrics,
        documents: DocumentStore,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.documents = documents
        self.switches = Switches(settings.disaggregation, settings.prefix_routing, settings.normalization)
        self.policy: Policy = parse_policy(settings.policy, {"load_factor": settings.load_factor})
        self.turn = 0  # decisions made: the policies' tie-break turn
        self.writer = IndexWriter(index)
        self.on_mispredict: Callable[[Node], None] | None = None
        self.inflight = 0

    # -- admission ---------------------------------------------------------------------------

    def admit(self) -> Callable[[], None]:
        """Take an in-flight slot or refuse (``Overloaded``); returns the (idempotent) release.

        Front ends do not call this directly: ``gateway.runner`` pairs it with its release.
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

    def namespace(self, model: str, tenant: str) -> Namespace:
        salt = "" if tenant in self.settings.shared_namespaces else tenant
        return Namespace(model, salt, self.settings.block_size, self.tokenizer.name)

    def prepare(self, req: ParsedRequest, tenant: str, request_id: str | None = None) -> Prepared:
        docs = list(req.documents)
        for doc_id in req.document_ids:
            docs.append(self.documents.get(tenant, doc_id))
        normalize = self.switches.normalization
        try:
            if req.kind == "chat":
                layout = render_chat(req.messages, documents=docs, tools=req.tools, normalize=normalize)
                tokens = self.tokenizer.encode(layout.text)
            elif req.prompt_token_ids is not None:
                tokens = pack_ids(req.prompt_token_ids)
                layout = Layout("", [Segment("prompt", "token ids", 0, len(tokens))])
            else:
                layout = render_completion(req.prompt or "", documents=docs, normalize=normalize)
                tokens = self.tokenizer.encode(layout.text)
        except NormalizationError as e:
            raise InvalidRequest(str(e), param=e.param) from None
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
        room = s.context_window - n
        if sampling.max_tokens > room:
            if req.max_tokens_given or room < 1:
                raise InvalidRequest(
                    f"prompt ({n} tokens) plus max_tokens ({sampling.max_tokens}) exceeds the context window "
                    f"of {s.context_window} tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            sampling.max_tokens = room
        ns = self.namespace(req.model, tenant)
        hashes = block_hashes(tokens, s.block_size, ns.root())
        return Prepared(
            request_id or uuid.uuid4().hex, tenant, ns, layout, tokens, hashes, sampling, req.model
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
            return {}
        self.metrics.index_lookup.labels(self.index.backend).observe(time.perf_counter() - t0)
        return hits

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
            turn=self.turn,
        )

    def _choose(self, nodes: list[Node], inp: RouteInput) -> Decision:
        policy = self.policy if self.switches.prefix_routing else planner.WITHOUT_PREFIX_ROUTING
        return policy.choose(inp, [n.view() for n in nodes])

    def _monolithic_candidates(self, exclude: set[str]) -> list[Node]:
        """Nodes that may serve the whole request (``planner.monolithic_candidates``)."""
        by_id = {n.id: n for n in self.pool.nodes.values()}
        views = [n.view() for n in by_id.values()]
        return [by_id[v.node_id] for v in planner.monolithic_candidates(views, exclude)]

    def _plan(self, prep: Prepared, hits: dict[str, int], exclude: set[str], turn: int) -> Plan:
        views = [n.view() for n in self.pool.nodes.values()]
        request = self._request(prep, hits)
        return planner.plan(request, views, self.policy, self._rules(), exclude=exclude, turn=turn)

    def decide(self, prep: Prepared, hits: dict[str, int], exclude: set[str] | None = None) -> Plan:
        """Which mode, which nodes, and why: the nodes' views through ``planner.plan``.

        A real decision: the policies' tie-break turn moves on.
        """
        plan = self._plan(prep, hits, exclude or set(), self.turn)
        self.turn = (self.turn + 1) % TURN_WRAP
        return plan

    def preview(self, prep: Prepared, hits: dict[str, int]) -> Plan:
        """The plan the next ``execute`` of this request would follow, changing nothing.

        The admin explain endpoint and prefill-as-a-service use this.
        """
        return self._plan(prep, hits, set(), self.turn)

    # -- execute -------------------------------------------------------------------------------

    def _metadata(self, prep: Prepared) -> tuple[tuple[str, str], ...]:
        return ((REQUEST_ID_KEY, prep.request_id),)

    def _sampling(self, s: Sampling) -> node_pb2.SamplingParams:
        return node_pb2.SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=(s.seed or 0) & 0xFFFFFFFFFFFFFFFF,
            has_seed=s.seed is not None,
            stop=s.stop,
        )

    def _retrying(self, deadline: float) -> AsyncRetrying:
        """Bounded attempts, exponential backoff with jitter, within the request's deadline."""
        return AsyncRetrying(
            stop=stop_after_attempt(MAX_ATTEMPTS) | _stop_at(deadline),
            wait=wait_exponential_jitter(multiplier=0.02, max=0.5, jitter=0.05),
            retry=retry_if_exception_type(NodeFailure),
            reraise=True,
        )

    async def execute(self, prep: Prepared) -> Execution:
        """Route and start the request; raises APIError when no node can serve it.

        The split path is tried on the best prefill/decode pair, then on the next best after
        each failure (failed nodes excluded); when it cannot serve, the request falls back to
        monolithic serving, itself retried on other nodes.
        """
        deadline = time.monotonic() + self.settings.request_timeout_s
        hits = await self.lookup(prep)
        plan = self.decide(prep, hits)
        failures: list[NodeFailure] = []
        excluded: set[str] = set()
        attempts = 0

        def failed(f: NodeFailure, pool: set[str]) -> None:
            failures.append(f)
            pool.add(f.node.id)
            self._note_failure(f)
            self.metrics.retries.labels(f.stage).inc()

        if plan.mode.mode == Mode.DISAGGREGATED:
            try:
                async for attempt in self._retrying(deadline):
                    with attempt:
                        pnode = self.pool.by_id(plan.prefill.node_id or "") if plan.prefill else None
                        dnode = self.pool.by_id(plan.decode_node or "")
                        if plan.mode.mode != Mode.DISAGGREGATED or pnode is None or dnode is None:
                            break
                        attempts += 1
                        try:
                            return await self._disaggregated(prep, plan, pnode, dnode, deadline, attempts)
                        except NodeFailure as f:
                            failed(f, excluded)
                            plan = self.decide(prep, hits, excluded)
                            raise
            except NodeFailure:
                pass
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
        # A prefill node that failed may still generate; a decode node that failed may not.
        mono_excluded = {f.node.id for f in failures if f.stage in ("decode", "transfer", "generate")}
        try:
            async for attempt in self._retrying(deadline):
                with attempt:
                    candidates = self._monolithic_candidates(mono_excluded)
                    if not candidates:
                        break
                    decision = self._choose(candidates, self._route_input(prep, hits, transfer=False))
                    node = self.pool.by_id(decision.node_id or "")
                    if node is None:
                        break
                    attempts += 1
                    try:
                        return await self._monolithic(prep, node, decision, route, reason, deadline, attempts)
                    except NodeFailure as f:
                        failed(f, mono_excluded)
                        raise
        except NodeFailure:
            pass
        self.metrics.requests.labels(route, "failed").inc()
        if failures and all(f.code == grpc.StatusCode.RESOURCE_EXHAUSTED for f in failures):
            raise APIError(429, "every node is at capacity; retry shortly", code="overloaded", retry_after=1)
        detail = "; ".join(str(f) for f in failures[-3:]) or f"no node can serve it: {plan.mode.reason}"
        raise APIError(503, f"no node could serve the request ({detail})", code="unavailable", retry_after=2)

    def _note_failure(self, f: NodeFailure) -> None:
        if f.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full queue is load, not a fault
            f.node.breaker.on_failure(time.monotonic())
        f.node.consecutive_failures += 1
        f.node.last_error = str(f)[:500]
        log.warning(
            "node_attempt_failed",
            node=f.node.id,
            stage=f.stage,
            code=f.code.name if f.code else None,
            detail=f.detail[:200],
        )

    async def _disaggregated(
        self, prep: Prepared, plan: Plan, pnode: Node, dnode: Node, deadline: float, attempts: int
    ) -> Execution:
        assert plan.prefill is not None
        predicted = plan.prefill.cached_blocks * self.settings.block_size
        uncached = max(0, prep.prompt_tokens - predicted)
        md = self._metadata(prep)
        timings = Timings()
        pnode.local_requests += 1
        pnode.local_tokens += uncached
        pnode.breaker.on_dispatch()
        dnode.breaker.on_dispatch()
        try:
            resp = await pnode.stub.Prefill(
                node_pb2.PrefillRequest(
                    request_id=prep.request_id,
                    tokens=prep.tokens,
                    block_hashes=prep.hashes,
                    sampling=self._sampling(prep.sampling),
                    decode_address=dnode.address,
                ),
                timeout=max(0.01, deadline - time.monotonic()),
                metadata=md,
            )
        except grpc.aio.AioRpcError as e:
            if _transfer_failed(e):
                raise _rpc_failure(dnode, "transfer", e) from e
            raise _rpc_failure(pnode, "prefill", e) from e
        except TimeoutError as e:
            raise _rpc_failure(pnode, "prefill", e) from e
        finally:
            pnode.local_requests -= 1
            pnode.local_tokens -= uncached
        pnode.consecutive_failures = 0
        pnode.breaker.on_success()
        pnode.observe_prefill(
            pnode.profile_prefill_s(prep.prompt_tokens - resp.cached_tokens, resp.cached_tokens),
            resp.prefill_seconds,
        )
        timings.queue_s, timings.prefill_s, timings.transfer_s = (
            resp.queue_seconds,
            resp.prefill_seconds,
            resp.transfer_seconds,
        )
        self._record(prep, pnode.id, dnode.id)
        call = dnode.stub.Decode(
            node_pb2.DecodeRequest(
                request_id=prep.request_id, kv_handle=resp.kv_handle, sampling=self._sampling(prep.sampling)
            ),
            timeout=max(0.01, deadline - time.monotonic()),
            metadata=md,
        )
        first = [Delta(resp.first_text, resp.finish_reason if resp.finished else "", 1)]
        try:
            chunk = await call.read()
        except grpc.aio.AioRpcError as e:
            call.cancel()
            raise _rpc_failure(dnode, "decode", e) from e
        if chunk is grpc.aio.EOF:
            call.cancel()
            raise NodeFailure(
                dnode, "decode", grpc.StatusCode.UNKNOWN, "decode stream ended before any token"
            )
        dnode.consecutive_failures = 0
        dnode.breaker.on_success()
        if not resp.finished:
            first.append(Delta(chunk.text, chunk.finish_reason, chunk.completion_tokens))
        else:
            first[0].completion_tokens = max(1, chunk.completion_tokens)
        timings.first_token_at = time.perf_counter()
        self.metrics.transfer_bytes.inc(resp.transfer_bytes)
        return Execution(
            self,
            prep,
            route=Mode.DISAGGREGATED,
            reason=plan.mode.reason,
            prefill_node=pnode,
            decode_node=dnode,
            call=call,
            first=first,
            cached_tokens=resp.cached_tokens,
            predicted_tokens=predicted,
            timings=timings,
            attempts=attempts,
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
    ) -> Execution:
        predicted = decision.cached_blocks * self.settings.block_size
        uncached = max(0, prep.prompt_tokens - predicted)
        timings = Timings()
        node.breaker.on_dispatch()
        # Counted as ours until its prefill is done, as on the split path: between two stats polls
        # the policy otherwise sees none of the requests it just sent and piles them on one node.
        node.local_requests += 1
        node.local_tokens += uncached
        call = node.stub.Generate(
            node_pb2.GenerateRequest(
                request_id=prep.request_id,
                tokens=prep.tokens,
                block_hashes=prep.hashes,
                sampling=self._sampling(prep.sampling),
            ),
            timeout=max(0.01, deadline - time.monotonic()),
            metadata=self._metadata(prep),
        )
        try:
            chunk = await call.read()
        except grpc.aio.AioRpcError as e:
            call.cancel()
            raise _rpc_failure(node, "generate", e) from e
        finally:
            node.local_requests -= 1
            node.local_tokens -= uncached
        if chunk is grpc.aio.EOF:
            call.cancel()
            raise NodeFailure(node, "generate", grpc.StatusCode.UNKNOWN, "stream ended before any token")
        node.consecutive_failures = 0
        node.breaker.on_success()
        timings.queue_s, timings.prefill_s = chunk.queue_seconds, chunk.prefill_seconds
        timings.first_token_at = time.perf_counter()
        self._record(prep, node.id)
        return Execution(
            self,
            prep,
            route=route,
            reason=reason,
            prefill_node=None,
            decode_node=node,
            call=call,
            first=[Delta(chunk.text, chunk.finish_reason, chunk.completion_tokens)],
            cached_tokens=chunk.cached_tokens,
            predicted_tokens=predicted,
            timings=timings,
            attempts=attempts,
        )

    # -- bookkeeping ---------------------------------------------------------------------------

    def _record(self, prep: Prepared, *nodes: str) -> None:
        """Record the blocks now on these nodes: queued for the batching writer, off the hot path."""
        if prep.hashes:
            chain = tuple(prep.hashes)
            self.writer.submit_many(StoreOp(n, chain) for n in nodes)

    def _check_prediction(self, node: Node, predicted: int, reported: int) -> None:
        """A node whose reported hits keep falling short of the index's prediction gets resynced:
        this is how a silently emptied cache (a node restart the events missed) is caught."""
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
        t = ex.timings
        ttft = (t.first_token_at - t.start) if t.first_token_at else 0.0
        m = self.metrics
        m.requests.labels(ex.route, ex.outcome).inc()
        m.ttft.labels(ex.route).observe(ttft)
        m.ttft_segment.labels("queue").observe(t.queue_s)
        m.ttft_segment.labels("prefill").observe(t.prefill_s)
        m.ttft_segment.labels("transfer").observe(t.transfer_s)
        m.ttft_segment.labels("first_token").observe(max(0.0, ttft - t.queue_s - t.prefill_s - t.transfer_s))
        node = (ex.prefill_node or ex.decode_node).id
        m.prefill.labels(node).observe(t.prefill_s)
        if ex.prefill_node is not None:
            m.transfer.labels(ex.prefill_node.id).observe(t.transfer_s)
        m.observe_hit(node, ex.prompt_tokens, ex.cached_tokens, ex.predicted_tokens)
        self._check_prediction(ex.prefill_node or ex.decode_node, ex.predicted_tokens, ex.cached_tokens)
        log.info(
            "request",
            request_id=ex.request_id,
            route=ex.route,
            prefill_node=ex.prefill_node.id if ex.prefill_node else None,
            decode_node=ex.decode_node.id,
            prompt_tokens=ex.prompt_tokens,
            cached_tokens=ex.cached_tokens,
            predicted_cached_tokens=ex.predicted_tokens,
            computed_tokens=ex.prompt_tokens - ex.cached_tokens,
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

    async def close(self) -> None:
        await self.writer.close(timeout=2.0)
