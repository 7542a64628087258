"""Heartbeats in a real (private) Redis: the key layout, expiry, the gateway's poller following
members without a restart, and Redis going down (last known members keep serving)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.policy.model import Backend
from gateway.registry.heartbeats import (
    Heartbeat,
    index_key,
    member_key,
    parse,
    publish,
    read,
    withdraw,
)
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.registry.view import BackendView
from gateway.services import Services
from gateway.store.redis_client import REDIS
from tests.redis_support import RedisServer
from tests.support import until

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    c = Redis.from_url(redis_server.url, socket_timeout=1, socket_connect_timeout=1)
    try:
        yield c
    finally:
        await c.aclose()


def beat(sid: str, port: int, load: float = 0.0, ver: str = "v1") -> Heartbeat:
    return Heartbeat(sid, f"127.0.0.1:{port}", load, ver, time.time_ns())


async def test_publish_read_expire(client: Redis) -> None:
    hb = beat("a", 9000, 42.5)
    await publish(client, "svc", hb, ttl_s=0.3)
    await publish(client, "svc", beat("b", 9001), ttl_s=5)
    _, beats = await read(client, "svc", 10)
    assert {b.sid for b in beats} == {"a", "b"} and hb in beats
    assert await client.ttl(member_key("svc", "a")) <= 1
    await asyncio.sleep(0.5)
    _, beats = await read(client, "svc", 10)
    assert [b.sid for b in beats] == ["b"]
    assert await client.zrange(index_key("svc"), 0, -1) == [b"b"]  # expired entry removed
    await withdraw(client, "svc", "b")
    assert (await read(client, "svc", 10))[1] == []


@pytest.mark.parametrize(
    "fields",
    [
        ["a", "127.0.0.1:1", "101", "v", "1"],  # load above 100
        ["a", "127.0.0.1:1", "x", "v", "1"],
        ["a", "no-port", "1", "v", "1"],
        ["a", "127.0.0.1:99999", "1", "v", "1"],
        ["a b", "127.0.0.1:1", "1", "v", "1"],
        ["a", "127.0.0.1:1", "1", "v", None],
        ["a", "127.0.0.1:1", "1", "v", "-5"],
    ],
)
def test_bad_heartbeats_are_refused(fields: list[Any]) -> None:
    assert parse(fields) is None


async def test_a_bad_heartbeat_in_redis_is_skipped(client: Redis) -> None:
    await client.hset(member_key("svc", "x"), mapping={"sid": "x", "addr": "h:1", "load": "nan?",
                                                       "ver": "", "ts": "1"})  # fmt: skip
    await client.zadd(index_key("svc"), {"x": 1})
    await publish(client, "svc", beat("ok", 9002), ttl_s=5)
    assert [b.sid for b in (await read(client, "svc", 10))[1]] == ["ok"]


def backend(url: str, **registry: Any) -> Backend:
    reg = {"redis": url, "service": "svc", "poll_s": 0.05, "stale_after_s": 0.6,
           "timeout_s": 0.3, **registry}  # fmt: skip
    return Backend.model_validate({"name": "llm", "discovery": {"registry": reg}})


def rotation(st: BackendView) -> set[str]:
    plan = st.plan(st.pool.clock.now())
    return {m.address for lv in plan.levels for m in lv.members}


def view_of(services: Services, cfg: Backend) -> BackendView:
    """The backend's view, live (its poller not started: the test polls by hand)."""
    pool = services.get(BACKENDS, lambda: BackendPool(services))
    st = pool.view(cfg)
    pool.latest = {cfg.name: st}
    return st


async def test_watcher_follows_members_and_survives_redis_going_down(
    client: Redis, redis_server: RedisServer, services: Services
) -> None:
    st = view_of(services, backend(redis_server.url))
    w = st.watcher
    assert w is not None
    await publish(client, "svc", beat("a", 9100, 30.0), ttl_s=5)
    await publish(client, "svc", beat("b", 9101), ttl_s=5)
    await w.poll_once()
    assert rotation(st) == {"127.0.0.1:9100", "127.0.0.1:9101"}
    assert st.members["127.0.0.1:9100"].core.load == 30.0 and w.up is True
    # only `a` keeps beating: `b` leaves rotation within stale_after_s (its hash still lives)
    t0 = time.monotonic()
    while "127.0.0.1:9101" in rotation(st):
        assert time.monotonic() - t0 < 0.6 + 0.5, "stale member still in rotation"
        await publish(client, "svc", beat("a", 9100), ttl_s=5)
        await w.poll_once()
        await asyncio.sleep(0.05)
    assert rotation(st) == {"127.0.0.1:9100"}
    # Redis goes away: the last live members keep serving, the state says so
    redis_server.stop()
    for _ in range(3):
        await w.poll_once()
        await asyncio.sleep(0.3)
    assert w.up is False and w.error
    assert rotation(st) == {"127.0.0.1:9100"}
    state = st.state(time.monotonic())
    assert state["registry"]["up"] is False  # type: ignore[index]
    # back: a new member joins without a restart
    redis_server.start()
    c2 = Redis.from_url(redis_server.url)
    try:
        await publish(c2, "svc", beat("a", 9100), ttl_s=5)
        await publish(c2, "svc", beat("c", 9102), ttl_s=5)
    finally:
        await c2.aclose()
    for _ in range(20):
        await w.poll_once()
        if w.up:
            break
        await asyncio.sleep(0.1)
    assert w.up is True
    assert rotation(st) == {"127.0.0.1:9100", "127.0.0.1:9102"}
    assert "127.0.0.1:9101" not in st.members  # gone from the registry: gone from the pool


async def test_version_filter_and_first_sight_of_a_stale_heartbeat(
    client: Redis, redis_server: RedisServer, services: Services
) -> None:
    st = view_of(services, backend(redis_server.url, version="v2"))
    w = st.watcher
    assert w is not None
    await publish(client, "svc", beat("old", 9200, ver="v1"), ttl_s=5)
    await publish(client, "svc", beat("new", 9201, ver="v2"), ttl_s=5)
    stale = Heartbeat("late", "127.0.0.1:9202", 0, "v2", time.time_ns() - 2_000_000_000)
    await publish(client, "svc", stale, ttl_s=5)
    await w.poll_once()
    assert rotation(st) == {"127.0.0.1:9201"}  # `late` is known but its heartbeat is old
    assert set(st.members) == {"127.0.0.1:9201", "127.0.0.1:9202"}
    assert rotation(st) == {"127.0.0.1:9201"}  # `late` is known but its heartbeat is old


async def test_a_stopped_watcher_lets_its_redis_client_go(
    redis_server: RedisServer, services: Services
) -> None:
    """A registry no policy names any more (its watcher stopped): its Redis client is closed
    once its grace ends, unless another feature still holds it."""
    w = view_of(services, backend(redis_server.url)).watcher
    assert w is not None
    await w.poll_once()
    assert w.up is True
    clients = services.peek(REDIS)
    assert clients is not None
    assert clients.readiness()["clients"] == [redis_server.url]
    w.stop()
    assert clients.readiness()["clients"] == [f"{redis_server.url} (unused)"]
    clients.retire_after_s = 0.05
    await w.poll_once()  # held again (a poll that raced the stop) ...
    assert clients.readiness()["clients"] == [redis_server.url]
    w.stop()  # ... and let go again: closed after the (shortened) grace
    await until(clients.readiness, 3, ok=lambda r: r == {"clients": [], "retired": 1})
