"""The request runner's order and its release guarantee, on a real service with no nodes."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from prefixgate.backends.hftok import TOKENIZER_DIR
from prefixgate.gateway.config import KEYLESS_TENANT, Settings
from prefixgate.gateway.core import choices
from prefixgate.gateway.core.auth import key_id
from prefixgate.gateway.core.errors import Draining, GatewayError, Overloaded, Unauthenticated
from prefixgate.gateway.core.pipeline import Prepared
from prefixgate.gateway.core.request import Credentials, RequestContext
from prefixgate.gateway.core.runner import INLINE_BYTES, INLINE_LIMIT_S, INLINE_STRIKES, OFFLOAD_BYTES, Caller
from prefixgate.gateway.core.service import GatewayService
from prefixgate.openai.errors import APIError
from prefixgate.openai.schema import ParsedRequest, parse_request

MODEL = "prefixgate-sim"


def _service(**kw: object) -> GatewayService:
    return GatewayService(Settings(api_keys=["sk-a=alice"], max_inflight=2, **kw))  # type: ignore[arg-type]


def _parsed(svc: GatewayService) -> ParsedRequest:
    return parse_request(
        {"model": MODEL, "prompt": "hello there, general"},
        "completion",
        models=svc.models,
        default_max_tokens=4,
        max_tokens_limit=16,
        max_documents=1,
    )


def _prepare(svc: GatewayService, context: RequestContext) -> Prepared:
    return svc.pipeline.prepare(_parsed(svc), context)


@dataclass
class Hold:
    """A job that does nothing on the nodes: what it started and closed, in order."""

    log: list[str] = field(default_factory=list)

    async def start(self, prepared: Prepared) -> Prepared:
        self.log.append(f"start {prepared.request_id}")
        return prepared

    async def close(self, started: Prepared) -> None:
        self.log.append(f"close {started.request_id}")


KEYED = Caller(authorization="Bearer sk-a", request_id="rid-1")


async def test_drain_check_comes_before_auth() -> None:
    svc = _service()
    svc.draining = True
    with pytest.raises(Draining):
        svc.runner.enter(Caller(authorization="Bearer wrong"))
    svc.draining = False
    with pytest.raises(Unauthenticated):
        svc.runner.enter(Caller(authorization="Bearer wrong"))


async def test_entry_gives_the_key_tenant_and_the_request_id() -> None:
    svc = _service()
    assert svc.runner.enter(KEYED) == RequestContext(
        "alice", "rid-1", Credentials.CLIENT, body_bytes=0, key_id=key_id("sk-a")
    )
    fresh = svc.runner.enter(Caller(authorization="Bearer sk-a"))
    assert fresh.tenant == "alice" and len(fresh.request_id) == 32  # a new one


async def test_the_prepared_request_carries_the_context_the_request_entered_with() -> None:
    svc = _service()
    context = svc.runner.enter(KEYED).with_body(OFFLOAD_BYTES)  # prepared on a worker thread
    _parsed_req, prep = await svc.runner.prepare(lambda: _parsed(svc), context)
    assert prep.context is context and prep.context.body_bytes == OFFLOAD_BYTES
    assert (prep.tenant, prep.request_id) == ("alice", "rid-1")


async def test_a_failed_execute_releases_the_slot() -> None:
    svc = _service()
    prep = _prepare(svc, svc.runner.enter(KEYED))
    for _ in range(5):  # more than max_inflight: a leak would turn these into Overloaded
        with pytest.raises((GatewayError, APIError)) as e:
            async with svc.runner.run(prep, choices.Generate(svc.pipeline)):
                pass
        assert not isinstance(e.value, Overloaded)
    assert svc.pipeline.inflight == 0


async def test_the_slot_is_held_inside_and_released_however_the_block_ends() -> None:
    svc = _service()
    prep = _prepare(svc, svc.runner.enter(KEYED))
    job = Hold()
    async with svc.runner.run(prep, job) as started:
        assert started is prep and prep.tenant == "alice" and prep.request_id == "rid-1"
        assert svc.pipeline.inflight == 1
        async with svc.runner.run(prep, job):
            assert svc.pipeline.inflight == 2
            with pytest.raises(Overloaded):
                async with svc.runner.run(prep, job):
                    pass
    assert svc.pipeline.inflight == 0
    assert job.log == ["start rid-1", "start rid-1", "close rid-1", "close rid-1"]  # refused: not started

    async def hold() -> None:
        async with svc.runner.run(prep, job):
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    assert svc.pipeline.inflight == 1
    task.cancel()  # a client that leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    assert svc.pipeline.inflight == 0
    assert job.log[-1] == "close rid-1"


async def test_admin_credentials_use_the_admin_check() -> None:
    svc = _service(admin_token="root")
    with pytest.raises(Unauthenticated) as e:
        svc.runner.enter(KEYED, Credentials.ADMIN)
    assert e.value.code == "invalid_admin_token"
    admin = svc.runner.enter(Caller("Bearer root"), Credentials.ADMIN)
    assert admin.credentials is Credentials.ADMIN
    assert admin.tenant == KEYLESS_TENANT  # the admin names tenants itself; no key tenant


async def test_large_work_runs_off_the_event_loop() -> None:
    svc = _service()
    loop_thread = threading.get_ident()
    assert await svc.runner.compute(threading.get_ident, 10) == loop_thread
    assert await svc.runner.compute(threading.get_ident, OFFLOAD_BYTES) != loop_thread


async def test_a_chat_template_renders_small_bodies_on_the_loop_until_it_is_slow_in_a_row() -> None:
    # the engine's own tokenizer (and chat template), as over grpc:// workers
    svc = _service(tokenizer_path=str(TOKENIZER_DIR))
    assert svc.pipeline.renders_templates
    runner, loop_thread = svc.runner, threading.get_ident()
    assert await runner.compute(threading.get_ident, INLINE_BYTES - 1) == loop_thread
    assert await runner.compute(threading.get_ident, INLINE_BYTES) != loop_thread
    # registered documents join the prompt: the body's size does not bound the work
    assert await runner.compute(threading.get_ident, 10, sized=False) != loop_thread

    def slow() -> int:
        time.sleep(2 * INLINE_LIMIT_S)
        return threading.get_ident()

    # one slow preparation (a cold start, a collection, a preemption) is not a slow template:
    # the ones after it, fast again, stay on the loop
    for _ in range(INLINE_STRIKES - 1):
        assert await runner.compute(slow, 10) == loop_thread
    assert await runner.compute(threading.get_ident, 10) == loop_thread
    assert runner.inline_renders
    # INLINE_STRIKES in a row are
    for _ in range(INLINE_STRIKES - 1):
        assert await runner.compute(slow, 10) == loop_thread
    assert runner.inline_renders
    assert await runner.compute(slow, 10) == loop_thread  # it ran on the loop, and was slow there
    assert not runner.inline_renders
    assert await runner.compute(threading.get_ident, 10) != loop_thread  # from now on, off the loop
    runner.close()


async def test_a_zero_inline_budget_renders_every_chat_off_the_loop() -> None:
    # the setting under test, and the engine's own tokenizer (a chat template renders, as over
    # grpc:// workers)
    svc = _service(tokenizer_path=str(TOKENIZER_DIR), inline_render_budget_ms=0.0)
    assert svc.pipeline.renders_templates and not svc.runner.inline_renders
    assert await svc.runner.compute(threading.get_ident, 10) != threading.get_ident()
    svc.runner.close()
