"""Fixtures for the Redis index tests: a private key prefix per test, purged afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prefixgate.cachetier.redis_index import RedisIndex
from tests.cachetier.support import redis_url, test_prefix


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
async def rindex(url: str) -> AsyncIterator[RedisIndex]:
    index = RedisIndex.from_url(url, prefix=test_prefix(), default_capacity=100_000)
    try:
        yield index
    finally:
        await index.purge()
        await index.close()
