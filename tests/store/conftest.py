from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.store.memory import MemoryStore
from gateway.store.redis import RedisStore
from tests.redis_support import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[object]:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_server.url)
    try:
        await client.flushall()
        yield client
    finally:
        await client.aclose()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[MemoryStore | RedisStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    from redis.asyncio import Redis

    client = Redis.from_url(redis_server.url)
    try:
        await client.flushall()
        s = RedisStore(client, prefix="t", deadline_s=1.0)  # generous: CI machines are busy
        await s.connect(5.0)
        yield s
    finally:
        await client.aclose()
