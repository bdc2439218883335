"""The request runner's order and its release guarantee, on a real service with no nodes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixgate.gateway.config import Settings
from prefixgate.gateway.core.pipeline import Prepared
from prefixgate.gateway.core.runner import OFFLOAD_BYTES, Caller, Credentials, Identity, Prepare
from prefixgate.gateway.core.service import GatewayService
from prefixgate.openai.errors import APIError
from prefixgate.openai.exceptions import Draining, GatewayError, Overloaded, Unauthenticated
from prefixgate.openai.schema import parse_request

MODEL = "prefixgate-sim"


def _service(**kw: object) -> GatewayService:
    return GatewayService(Settings(api_keys=["sk-a=alice"], max_inflight=2, **kw))  # type: ignore[arg-type]


def _preparer(svc: GatewayService, seen: list[Identity]) -> Prepare:
    async def prepare(identity: Identity) -> Prepared:
        seen.append(identity)
        parsed = parse_request(
            {"model": MODEL, "prompt": "hello there, general"},
            "completion",
            models=svc.models,
            default_max_tokens=4,
            max_tokens_limit=16,
            max_documents=1,
        )
        return svc.pipeline.prepare(parsed, identity.tenant(), identity.request_id)

    return prepare


KEYED = Caller(authorization="Bearer sk-a", request_id="rid-1")


async def test_drain_check_comes_before_auth_and_prepare() -> None:
    svc = _service()
    svc.draining = True
    seen: list[Identity] = []
    with pytest.raises(Draining):
        async with svc.runner.run(Caller(authorization="Bearer wrong"), _preparer(svc, seen)):
            pass
    assert seen == [] and svc.pipeline.inflight == 0


async def test_auth_comes_before_prepare_and_admission() -> None:
    svc = _service()
    seen: list[Identity] = []
    with pytest.raises(Unauthenticated):
        async with svc.runner.run(Caller(authorization="Bearer wrong"), _preparer(svc, seen)):
            pass
    assert seen == [] and svc.pipeline.inflight == 0


async def test_a_failed_execute_releases_the_slot() -> None:
    svc = _service()
    seen: list[Identity] = []
    for _ in range(5):  # more than max_inflight: a leak would turn these into Overloaded
        with pytest.raises((GatewayError, APIError)) as e:
            async with svc.runner.run(KEYED, _preparer(svc, seen)):
                pass
        assert not isinstance(e.value, Overloaded)
    assert svc.pipeline.inflight == 0
    assert seen[0] == Identity("alice", "rid-1")


async def test_the_slot_is_held_inside_and_released_however_the_block_ends() -> None:
    svc = _service()
    seen: list[Identity] = []
    async with svc.runner.admitted(KEYED, _preparer(svc, seen)) as prep:
        assert prep.tenant == "alice" and prep.request_id == "rid-1"
        assert svc.pipeline.inflight == 1
        async with svc.runner.admitted(KEYED, _preparer(svc, seen)):
            assert svc.pipeline.inflight == 2
            with pytest.raises(Overloaded):
                async with svc.runner.admitted(KEYED, _preparer(svc, seen)):
                    pass
    assert svc.pipeline.inflight == 0

    async def hold() -> None:
        async with svc.runner.admitted(KEYED, _preparer(svc, seen)):
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    assert svc.pipeline.inflight == 1
    task.cancel()  # a client that leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    assert svc.pipeline.inflight == 0


async def test_admin_credentials_use_the_admin_check() -> None:
    svc = _service(admin_token="root")
    seen: list[Identity] = []
    with pytest.raises(Unauthenticated) as e:
        async with svc.runner.admitted(KEYED, _preparer(svc, seen), Credentials.ADMIN):
            pass
    assert e.value.code == "invalid_admin_token"
    async with svc.runner.admitted(Caller("Bearer root"), _preparer(svc, seen), Credentials.ADMIN) as prep:
        assert prep.tenant == ""  # the admin names tenants itself; no key tenant
    assert svc.pipeline.inflight == 0


async def test_large_work_runs_off_the_event_loop() -> None:
    svc = _service()
    loop_thread = threading.get_ident()
    assert await svc.runner.compute(threading.get_ident, 10) == loop_thread
    assert await svc.runner.compute(threading.get_ident, OFFLOAD_BYTES) != loop_thread
