"""What only the Redis store has: TTL at creation, epochs carried over, deadlines, NOSCRIPT."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.errors import StoreUnavailable
from gateway.store.base import EPOCH_S, KeyParams, SyncOp, key_name
from gateway.store.redis import BUCKET, RedisStore

pytestmark = pytest.mark.redis
P = KeyParams(limit=100, window_s=1.0, rate=100, burst=1000)


def args(want_req: float = 0, want_tok: float = 0) -> list[Any]:
    """One op of lua/bucket.lua: one parameter set, then the op."""
    return [1, 100, 1.0, 100, 1000, 7200, 0.6, 0.4, 0.95, f"0,0,0,0,{want_req},{want_tok},0,0"]


async def test_ttl_is_set_at_creation_only(redis_client: Any) -> None:
    store = RedisStore(redis_client, prefix="t", deadline_s=1.0)
    await store.connect(5)
    k = key_name("t", "r", P, "ttl")
    await store.sync([SyncOp(k, P, want_req=1)])
    (name,) = [n async for n in redis_client.scan_iter(match="t:rl:*")]
    ttl1 = await redis_client.ttl(name)
    assert 2 * EPOCH_S - 5 <= ttl1 <= 2 * EPOCH_S
    await redis_client.expire(name, 100)  # pretend time passed
    for _ in range(5):
        await store.sync([SyncOp(k, P, want_req=1)])
    assert 90 <= await redis_client.ttl(name) <= 100  # not re-armed by later calls


async def test_a_new_epoch_starts_from_the_previous_one(redis_client: Any) -> None:
    await redis_client.script_load(BUCKET.source)
    old, new = "t:rl:{x}:1", "t:rl:{x}:2"
    r = await redis_client.evalsha(BUCKET.sha, 2, old, "t:rl:{x}:0", *args(60, 900))
    assert r[0].split(b",")[:2] == [b"60", b"900"]
    r = await redis_client.evalsha(BUCKET.sha, 2, new, old, *args(want_req=60))
    granted, _, _, _, tokens = (float(x) for x in r[0].split(b","))
    assert granted == 40  # the 60 leased in the old epoch still count
    assert tokens < 150  # and so do the tokens
    assert await redis_client.ttl(new) > 0


async def test_noscript_after_a_flush_is_recovered(redis_client: Any) -> None:
    store = RedisStore(redis_client, prefix="t", deadline_s=1.0)
    await store.connect(5)
    await redis_client.script_flush()
    (r,) = await store.sync([SyncOp(key_name("t", "r", P, "n"), P, want_req=3)])
    assert r.granted_req == 3


async def test_unreachable_redis_fails_within_the_deadline() -> None:
    from redis.asyncio import Redis

    from tests.support import free_port

    client = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=2)
    try:
        store = RedisStore(client, prefix="t", deadline_s=0.02)
        t0 = time.perf_counter()
        with pytest.raises(StoreUnavailable):
            await store.sync([SyncOp(key_name("t", "r", P, "z"), P, want_req=1)])
        assert time.perf_counter() - t0 < 0.5
    finally:
        await client.aclose()


async def test_blackholed_redis_hits_the_deadline() -> None:
    """A server that accepts and never answers (the worst case): the deadline, not a timeout
    of seconds, bounds the call."""
    import asyncio

    writers: list[asyncio.StreamWriter] = []
    gone = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(1 << 16)
        await gone.wait()  # never answers
        writer.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    from redis.asyncio import Redis

    client = Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        store = RedisStore(client, prefix="t", deadline_s=0.05)
        t0 = time.perf_counter()
        with pytest.raises(StoreUnavailable):
            await store.sync([SyncOp(key_name("t", "r", P, "z"), P, want_req=1)])
        assert time.perf_counter() - t0 < 1.0
    finally:
        await client.aclose()
        gone.set()
        srv.close()
        for w in writers:
            w.close()
            await w.wait_closed()
        await srv.wait_closed()
