"""One request runner for every front end: drain check, auth, request id, admission, execute, release.

The HTTP API, the gRPC API and the admin/prefill endpoints all serve a request through
``RequestRunner``, in that order, so none of them can skip a step or leak an in-flight slot::

    async with runner.run(caller, prepare) as execution:
        ...  # stream or collect; the slot is held until this block is left, however it is left

``admitted`` is the same without ``execute``, for operations that are not a generation
(warming and pinning a prefix). Errors are domain errors (``prefixgate.openai.exceptions``); each front
end maps them once.

Preparing a large request is CPU work proportional to its size. A body of many JSON values
is parsed in a worker process (``gateway.httpfront.bodyparse``: the parser holds the interpreter lock,
so a thread would not spare the event loop); above ``OFFLOAD_BYTES`` the rest (validate,
render, tokenize, hash: bounded by the message, part and value limits) runs on a worker
thread; at most ``HEAVY_CONCURRENCY`` requests at a time do either. Clients sending huge bodies
queue behind each other instead of stalling the event loop that serves every other request and
the health checks. A model's own chat template (``gateway.tokens``) is code that came with the
model: whatever the body's size, a request that may render one is prepared on one of
``RENDER_THREADS`` threads, where the template's bounds (time, output) stop it if it runs away.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from prefixgate.gateway.config import KEYLESS_TENANT
from prefixgate.gateway.core.auth import KeyRing, check_admin
from prefixgate.gateway.httpfront.bodyparse import BodyParser
from prefixgate.openai.exceptions import Draining, StreamBroken

if TYPE_CHECKING:
    from prefixgate.gateway.core.pipeline import Delta, Execution, Prepared
    from prefixgate.gateway.core.service import GatewayService
    from prefixgate.openai.schema import ParsedRequest

T = TypeVar("T")
OFFLOAD_BYTES = 1024 * 1024  # more than the text of a prompt of max_prompt_tokens (bytes4)
HEAVY_CONCURRENCY = 2
RENDER_THREADS = 4  # CPU work under one interpreter lock: more threads would not render faster


class Credentials(StrEnum):
    """What a request must present: a client API key, or the admin's token (or loopback)."""

    CLIENT = "client"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Caller:
    """What a front end read off its transport about the request, before any parsing."""

    authorization: str = ""
    request_id: str | None = None  # validated by ``auth.valid_request_id``; None: a new one
    client_host: str = ""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the runner let in: the API key's tenant (None without keys) and the request id."""

    key_tenant: str | None
    request_id: str

    def tenant(self) -> str:
        """The tenant the request runs as: the key's; without keys the one shared tenant (a
        ``user`` field anyone can type is OpenAI's end-user label, never an identity)."""
        return KEYLESS_TENANT if self.key_tenant is None else self.key_tenant


Prepare = Callable[[Identity], Awaitable["Prepared"]]


class RequestRunner:
    """The one path from an incoming request to an admitted, executing one."""

    def __init__(self, svc: GatewayService) -> None:
        self.svc = svc
        self.keys = KeyRing(svc.settings.api_keys)
        self._heavy = asyncio.Semaphore(HEAVY_CONCURRENCY)
        self.bodies = BodyParser(svc.settings.max_json_values, workers=HEAVY_CONCURRENCY)
        self._render = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="prefixgate-render")

    def close(self) -> None:
        self.bodies.close()
        self._render.shutdown(wait=False, cancel_futures=True)

    def authenticate(self, caller: Caller, credentials: Credentials = Credentials.CLIENT) -> str | None:
        """The API key's tenant (None in keyless mode or for the admin); raises when refused."""
        if credentials is Credentials.ADMIN:
            check_admin(self.svc.settings.admin_token, caller.authorization, caller.client_host)
            return None
        return self.keys.authenticate(caller.authorization)

    async def parse_body(self, raw: bytes) -> dict[str, Any]:
        """A JSON object body within the value bound; parsed off this process when it may
        hold many values."""
        if self.bodies.inline(raw):
            return await self.bodies.parse(raw)
        async with self._heavy:
            return await self.bodies.parse(raw)

    async def compute(self, work: Callable[[], T], size: int) -> T:
        """Run request-sized CPU work: inline when small, else on a worker thread, bounded; on
        a render thread when it may run a model's chat template."""
        if size >= OFFLOAD_BYTES:
            async with self._heavy:
                return await asyncio.to_thread(work)
        if self.svc.pipeline.renders_templates:
            call = functools.partial(contextvars.copy_context().run, work)
            return await asyncio.get_running_loop().run_in_executor(self._render, call)
        return work()

    async def prepare(
        self,
        parse: Callable[[], ParsedRequest],
        tenant: str,
        request_id: str,
        size: int,
        body: dict[str, Any] | None = None,
    ) -> tuple[ParsedRequest, Prepared]:
        """Parse, fetch the registered documents it names (shared store, one round trip), prepare.

        CPU work runs as ``compute`` runs it; a request naming no registered document is parsed
        and prepared in one go.
        """
        pipeline = self.svc.pipeline

        def first() -> tuple[ParsedRequest, Prepared | None]:
            req = parse()
            if req.document_ids:
                return req, None
            return req, pipeline.prepare(req, tenant, request_id, body=body)

        req, prep = await self.compute(first, size)
        if prep is None:
            await self.svc.documents.resolve(tenant, req)
            prep = await self.compute(lambda: pipeline.prepare(req, tenant, request_id, body=body), size)
        return req, prep

    @asynccontextmanager
    async def admitted(
        self, caller: Caller, prepare: Prepare, credentials: Credentials = Credentials.CLIENT
    ) -> AsyncIterator[Prepared]:
        """Drain check, auth, request id, prepare, admission; the slot is released on exit."""
        if self.svc.draining:
            raise Draining("the gateway is shutting down", retry_after=1)
        identity = Identity(self.authenticate(caller, credentials), caller.request_id or uuid.uuid4().hex)
        prep = await prepare(identity)
        release = self.svc.pipeline.admit()
        try:
            yield prep
        finally:
            release()

    @asynccontextmanager
    async def run(self, caller: Caller, prepare: Prepare) -> AsyncIterator[Execution]:
        """``admitted``, then execute; the execution is closed and the slot released on exit."""
        async with self.admitted(caller, prepare) as prep:
            execution = await self.svc.pipeline.execute(prep)
            try:
                yield execution
            finally:
                await execution.close()


async def deltas(execution: Execution) -> AsyncIterator[Delta]:
    """The execution's deltas. A node failure after the first token is ``StreamBroken``, with
    the one message both front ends send (HTTP: an SSE error event or a 502; gRPC: UNAVAILABLE)."""
    try:
        async for delta in execution.stream():
            yield delta
    except StreamBroken as e:
        raise StreamBroken(f"generation failed after it started: {e}") from e
