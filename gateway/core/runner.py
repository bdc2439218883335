"""One request runner for every front end: drain check, auth, request id, prepare, admission, run.

The HTTP API, the gRPC API and the admin/prefill endpoints all serve a request with these three
calls, in this order; ``run`` is the only way to an in-flight slot, and it releases the slot
however its block is left::

    context = runner.enter(caller)                       # drain check, auth, request id
    parsed, prepared = await runner.prepare(parse, context.with_body(size))
    async with runner.run(prepared, Generate(pipeline, n)) as choices:
        ...  # stream or collect; the slot is held until this block is left, however it is left

The front end reads its transport and prepares; it passes values down (the request's context,
which the prepared request carries on, the job) and the runner calls nothing of the front end.
The job says what the admitted request does on the nodes: generate its choices
(``gateway.core.choices.Generate``) or warm a prefix (``gateway.core.cache_ops.Warm``). Errors
are domain errors (``gateway.core.errors``); each front end maps them once.

Preparing a large request is CPU work proportional to its size. A body of many JSON values
is parsed in a worker process (``gateway.core.bodyparse``: the parser holds the interpreter lock,
so a thread would not spare the event loop); above ``OFFLOAD_BYTES`` the rest (validate,
render, tokenize, hash: bounded by the message, part and value limits) runs on a worker
thread; at most ``HEAVY_CONCURRENCY`` requests at a time do either. Clients sending huge bodies
queue behind each other instead of stalling the event loop that serves every other request and
the health checks. A model's own chat template (``gateway.tokens``) is code that came with the
model: a request that may render one is prepared on one of ``RENDER_THREADS`` threads, where the
template's bounds (time, output) stop it if it runs away, unless its body is under
``INLINE_BYTES``: a chat that small renders and tokenizes in a fraction of a millisecond, less
than the hand-off to a thread and back costs, so it is prepared on the event loop within a
budget (``inline_render_budget_ms``, 5 ms): a render stops there (``tokens.template.budget``)
and is done again on a render thread. ``INLINE_STRIKES`` preparations in a row over the budget
say the template itself is slow, and from then on every chat is rendered off the loop (said
once). One alone does not: the first chat after a start, a collection of the interpreter's
garbage or the process preempted on a busy machine can each take one past it, and a single
outlier once sent every later chat through a thread, at some 0.2 M instructions a request more
(``bench instructions`` over ``grpc://``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import structlog

from prefixgate.gateway.config import KEYLESS_TENANT
from prefixgate.gateway.core.auth import KeyRing, check_admin
from prefixgate.gateway.core.bodyparse import BodyParser
from prefixgate.gateway.core.errors import Draining, Overloaded
from prefixgate.gateway.core.request import Credentials, RequestContext
from prefixgate.gateway.records import record
from prefixgate.gateway.scheduling.classes import slo_ms
from prefixgate.gateway.tokens import template

if TYPE_CHECKING:
    from prefixgate.gateway.core.pipeline import Pipeline, Prepared
    from prefixgate.gateway.core.rate_limits import RateLimiter
    from prefixgate.openai.schema import ParsedRequest

log = structlog.get_logger("prefixgate.runner")

T = TypeVar("T")
Started = TypeVar("Started")
OFFLOAD_BYTES = 1024 * 1024  # more than the text of a prompt of max_prompt_tokens (bytes4)
HEAVY_CONCURRENCY = 2
RENDER_THREADS = 4  # CPU work under one interpreter lock: more threads would not render faster
# A body under this is prepared on the event loop even when a chat template renders it: some
# 4,000 tokens at most, rendered, tokenized and hashed in about a millisecond.
INLINE_BYTES = 16 * 1024
INLINE_LIMIT_S = 0.005  # ``inline_render_budget_ms``'s default
INLINE_STRIKES = 3  # preparations over the budget in a row that send every later one to a thread


@record
class Caller:
    """What a front end read off its transport about the request, before any parsing."""

    authorization: str = ""
    request_id: str | None = None  # validated by ``auth.valid_request_id``; None: a new one
    client_host: str = ""
    # The scheduler's headers, as sent: ``x-prefixgate-priority-class`` and
    # ``x-prefixgate-ttft-slo-ms`` (``gateway.core.queueing``).
    priority_class: str = ""
    ttft_slo_ms: str = ""


class Job(Protocol[Started]):
    """What an admitted request does on the nodes: started once admitted, closed on leaving."""

    async def start(self, prepared: Prepared) -> Started: ...

    async def close(self, started: Started) -> None: ...


def generated_at_most(job: object, prepared: Prepared) -> int:
    """A job's ``max_output_tokens(prepared)`` (what the rate limits reserve) if it generates, else
    0. Attribute checks, here and in ``completion_tokens``: ``isinstance`` against a runtime
    Protocol walks its members on every call."""
    most = getattr(job, "max_output_tokens", None)
    return int(most(prepared)) if callable(most) else 0


def completion_tokens(started: object) -> int:
    """A started job's ``completion_tokens`` (what the rate limits settle with), else 0."""
    n = getattr(started, "completion_tokens", 0)
    return n if isinstance(n, int) else 0


class Documents(Protocol):
    """Where a request's registered documents are fetched from (``DocumentRegistry``)."""

    async def resolve(self, tenant: str, req: ParsedRequest) -> None: ...


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    """The settings the runner applies: credentials, the body parser's value bound, the budget
    of a chat prepared on the event loop (0: none is)."""

    api_keys: Sequence[str] = ()
    admin_token: str = ""
    max_json_values: int = 0
    inline_budget_s: float = INLINE_LIMIT_S


class RequestRunner:
    """The one path from an incoming request to an admitted, running one."""

    def __init__(self, pipeline: Pipeline, documents: Documents, limits: RunnerLimits) -> None:
        self.pipeline = pipeline
        self.documents = documents
        self.admin_token = limits.admin_token
        self.keys = KeyRing(limits.api_keys)
        self.draining = False  # set on shutdown: new requests are refused (``Draining``)
        self._heavy = asyncio.Semaphore(HEAVY_CONCURRENCY)
        self.bodies = BodyParser(limits.max_json_values, workers=HEAVY_CONCURRENCY)
        self._render = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="prefixgate-render")
        self.inline_budget_s = limits.inline_budget_s
        # small bodies rendered on the loop (``compute``) until INLINE_STRIKES in a row are slow
        self.inline_renders = limits.inline_budget_s > 0
        self._strikes = 0
        self.limits: RateLimiter | None = None  # tenants' and keys' tokens/requests per minute

    def close(self) -> None:
        self.bodies.close()
        self._render.shutdown(wait=False, cancel_futures=True)

    def authenticate(self, caller: Caller, credentials: Credentials = Credentials.CLIENT) -> str | None:
        """The API key's tenant (None in keyless mode or for the admin); raises when refused."""
        if credentials is Credentials.ADMIN:
            check_admin(self.admin_token, caller.authorization, caller.client_host)
            return None
        return self.keys.authenticate(caller.authorization)

    def enter(self, caller: Caller, credentials: Credentials = Credentials.CLIENT) -> RequestContext:
        """The first step of every request, before its body is read: drain check, auth, request id.

        The request runs as the key's tenant; without keys (or for the admin, until it names
        one) as the one shared tenant: a ``user`` field anyone can type is OpenAI's end-user
        label, never an identity."""
        if self.draining:
            raise Draining("the gateway is shutting down", retry_after=1)
        found: tuple[str, str] | None = None
        if credentials is Credentials.ADMIN:
            self.authenticate(caller, credentials)
        else:
            found = self.keys.identify(caller.authorization)
        tenant, key = found if found is not None else (KEYLESS_TENANT, "")
        return RequestContext(
            tenant,
            caller.request_id or os.urandom(16).hex(),  # 32 hex digits, as ``bind_request``'s
            credentials,
            key_id=key,
            priority_class=caller.priority_class,
            ttft_slo_ms=slo_ms(caller.ttft_slo_ms),
        )

    async def parse_body(self, raw: bytes) -> dict[str, Any]:
        """A JSON object body within the value bound; parsed off this process when it may
        hold many values."""
        if self.bodies.inline(raw):
            return await self.bodies.parse(raw)
        async with self._heavy:
            return await self.bodies.parse(raw)

    async def compute(self, work: Callable[[], T], size: int, *, sized: bool = True) -> T:
        """Run request-sized CPU work: inline when small, else on a worker thread, bounded; on
        a render thread when it may run a model's chat template, unless the body is small
        (``INLINE_BYTES``; ``sized``: ``size`` bounds the work, which it does not when registered
        documents join the prompt)."""
        if size >= OFFLOAD_BYTES:
            async with self._heavy:
                return await asyncio.to_thread(work)
        if not self.pipeline.renders_templates:
            return work()
        if sized and size < INLINE_BYTES and self.inline_renders:
            budget, started = self.inline_budget_s, time.perf_counter()
            try:
                with template.budget(budget):  # a template that runs longer stops here
                    return work()
            except template.RenderOverBudget:
                pass  # rendered again below, off the loop, with the template's whole time
            finally:
                took = time.perf_counter() - started
                self._strikes = self._strikes + 1 if took > budget else 0
                if self._strikes >= INLINE_STRIKES:
                    self.inline_renders = False
                    log.warning(
                        "inline_render_slow",
                        body_bytes=size,
                        ms=round(took * 1000, 2),
                        in_a_row=self._strikes,
                    )
        call = functools.partial(contextvars.copy_context().run, work)
        return await asyncio.get_running_loop().run_in_executor(self._render, call)

    async def prepare(
        self,
        parse: Callable[[], ParsedRequest],
        context: RequestContext,
        body: dict[str, Any] | None = None,
    ) -> tuple[ParsedRequest, Prepared]:
        """Parse, fetch the registered documents it names (shared store, one round trip), prepare.

        CPU work runs as ``compute`` runs it, sized by the context's body; a request naming no
        registered document is parsed and prepared in one go.
        """
        pipeline, size = self.pipeline, context.body_bytes

        def first() -> tuple[ParsedRequest, Prepared | None]:
            req = parse()
            if req.document_ids:
                return req, None
            return req, pipeline.prepare(req, context, body=body)

        req, prep = await self.compute(first, size)
        if prep is None:
            await self.documents.resolve(context.tenant, req)
            prep = await self.compute(lambda: pipeline.prepare(req, context, body=body), size, sized=False)
        return req, prep

    def run(self, prepared: Prepared, job: Job[Started]) -> Running[Started]:
        """Admission and the rate limits' reservation, then the job started; on exit, however
        it is left, it is closed, the slot released and the reservation settled with the tokens
        used (``gateway.core.rate_limits``). ``async with runner.run(prepared, job) as started``."""
        return Running(self, prepared, job)


class Running(Generic[Started]):
    """``RequestRunner.run``'s context: a class rather than an async generator under
    contextlib's wrapper, which every request entered and left at more cost than its own work."""

    __slots__ = ("_hold", "_job", "_prepared", "_release", "_runner", "_started", "_used")

    def __init__(self, runner: RequestRunner, prepared: Prepared, job: Job[Started]) -> None:
        self._runner, self._prepared, self._job = runner, prepared, job
        self._hold: Any = None
        self._used = prepared.prompt_tokens
        self._release: Callable[[], None]  # set on entering, with the slot
        self._started: Started  # set once entered: ``__aexit__`` is only called then

    async def __aenter__(self) -> Started:
        prepared, job, limits = self._prepared, self._job, self._runner.limits
        self._release = self._runner.pipeline.admit()
        try:
            if limits is not None:
                self._hold = await limits.reserve(prepared, generated_at_most(job, prepared))
            try:
                self._started = await job.start(prepared)
            except Overloaded:  # refused before any node computed it (the scheduler, full nodes)
                self._used = 0
                raise
        except BaseException:
            self._settle(0)
            raise
        return self._started

    async def __aexit__(self, *exc: object) -> None:
        output = 0
        try:
            output = completion_tokens(self._started)
            await self._job.close(self._started)
        finally:
            self._settle(output)

    def _settle(self, output: int) -> None:
        """The slot released and the reservation settled with the tokens used (once: on a
        failed entry or on leaving)."""
        self._release()
        limits = self._runner.limits
        if limits is not None and self._hold is not None:
            limits.settle(self._hold, self._used + output)
