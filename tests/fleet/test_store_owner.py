"""The fleet store's owner against a real redis-server: modes, the live replica count, scripts,
losing Redis and getting it back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.errors import StoreUnavailable
from gateway.fleet.store import FLEET, FleetStore, Script, fleet_for
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.services import Services
from gateway.telemetry import metrics
from tests.redis_support import RedisServer
from tests.support import until

pytestmark = pytest.mark.redis

INCR = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])", "incr")


def options(server: RedisServer, **kw: float) -> RedisStoreOptions:
    return RedisStoreOptions(url=server.url, connect_timeout_ms=2000, deadline_ms=500, **kw)


async def test_without_a_store_the_mode_is_none() -> None:
    services = Services()
    fleet = fleet_for(services)
    fleet.configure(None)
    assert fleet.mode == "none" and fleet.replicas == 1
    assert services.peek(FLEET) is fleet
    with pytest.raises(StoreUnavailable):
        await fleet.run(INCR, ["k"], [1])
    assert services.readiness()["fleet"] == {"mode": "none", "replicas": 1}
    await services.aclose()


async def test_two_replicas_share_and_count_each_other(redis_server: RedisServer) -> None:
    a, b = Services(), Services()
    fa, fb = fleet_for(a), fleet_for(b)
    seen: list[str] = []
    fa.on_mode(seen.append)
    fa.configure(options(redis_server, replica_ttl_s=2))
    assert fa.mode == "fallback"  # until the first connect
    fb.configure(options(redis_server, replica_ttl_s=2))
    await until(lambda: fa.shared and fb.shared, 10)
    assert seen[-1] == "shared"
    await until(lambda: fa.replicas == 2 and fb.replicas == 2, 10)
    assert fa.replica_id != fb.replica_id
    key = fa.key("test", "counter")
    assert key == "sluice:test:{counter}"
    assert await fa.run(INCR, [key], [2]) == 2
    assert await fb.pipeline(INCR, [([key], [1]), ([key], [1])]) == [3, 4]
    assert metrics.REGISTRY.get_sample_value("sluice_fleet_store_mode", {"mode": "shared"}) == 1
    st = fa.state()
    assert st["mode"] == "shared" and st["replicas"] == 2 and st["store"] == redis_server.url
    # A replica that stops leaves the set: the other counts one again at its next announce.
    await b.aclose()
    await until(lambda: fa.replicas == 1, 5)
    await a.aclose()


async def test_a_replica_that_moves_leaves_the_old_stores_set(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A reload that names another Redis, then another key prefix: the replica leaves the set
    it announced to, so the replicas still there count one less at their next announce, not
    after `replica_ttl_s` (a minute here). A credential rotated on the same store is no move:
    it never leaves."""
    from redis import Redis

    other = RedisServer(tmp_path / "other").start()
    a, b = Services(), Services()
    fa, fb = fleet_for(a), fleet_for(b)
    old = Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=5)
    key = "sluice:replicas:{sluice}"  # the set every replica announces to
    # Every removal from the set, seen as Redis publishes it (keyspace events).
    old.config_set("notify-keyspace-events", "Kz")
    events = old.pubsub(ignore_subscribe_messages=True)
    events.subscribe(f"__keyspace@0__:{key}")

    def removals() -> int:
        n = 0
        while (m := events.get_message(timeout=0)) is not None:
            n += m["data"] == "zrem"
        return n

    try:
        fa.configure(options(redis_server, replica_ttl_s=60))
        fb.configure(options(redis_server, replica_ttl_s=60))
        await until(lambda: fa.replicas == 2 and fb.replicas == 2, 10)
        both = {fa.replica_id, fb.replica_id}
        assert set(old.zrange(key, 0, -1)) == both and removals() == 0
        # A credential rotated on the same store (the default user takes any password): the
        # same set, which it never leaves, so the others never count one less.
        fb.configure(options(redis_server, replica_ttl_s=60).model_copy(
            update={"url": f"redis://default:rotated@127.0.0.1:{redis_server.port}/0"}
        ))  # fmt: skip
        seen: list[tuple[int, set[str]]] = []
        for _ in range(25):  # 2.5 s: two of a's announces and b's reconnect
            seen.append((fa.replicas, set(old.zrange(key, 0, -1))))
            await asyncio.sleep(0.1)
        assert all(n == 2 and ids == both for n, ids in seen), seen
        assert fb.shared and removals() == 0
        fb.configure(options(other, replica_ttl_s=60))  # another Redis
        await until(lambda: old.zrange(key, 0, -1), 5, ok=lambda ids: ids == [fa.replica_id])
        assert removals() == 1
        await until(lambda: fa.replicas, 5, ok=lambda n: n == 1)  # its next announce
        await until(lambda: fb.shared and fb.replicas == 1, 10)
        assert fb.state()["store"] == other.url
        # Back to the first Redis, then to another prefix on it: it leaves that set too.
        fb.configure(options(redis_server, replica_ttl_s=60))
        await until(lambda: fa.replicas, 5, ok=lambda n: n == 2)
        fb.configure(
            RedisStoreOptions(
                url=redis_server.url, connect_timeout_ms=2000, deadline_ms=500,
                replica_ttl_s=60, key_prefix="elsewhere",
            )
        )  # fmt: skip
        await until(lambda: old.zrange(key, 0, -1), 5, ok=lambda ids: ids == [fa.replica_id])
        await until(lambda: fb.shared, 10)
        assert old.zrange("elsewhere:replicas:{elsewhere}", 0, -1) == [fb.replica_id]
    finally:
        await b.aclose()
        await a.aclose()
        events.close()
        old.close()
        other.stop()


async def test_losing_redis_falls_back_and_recovers_by_itself(redis_server: RedisServer) -> None:
    services = Services()
    fleet = fleet_for(services)
    modes: list[str] = []
    fleet.on_mode(modes.append)
    fleet.configure(options(redis_server))
    await until(lambda: fleet.shared, 10)
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await fleet.run(INCR, [fleet.key("t", "x")], [1])
    assert fleet.mode == "fallback" and modes[-1] == "fallback"
    assert "store_error" in services.readiness()["fleet"]
    assert time.monotonic() - t0 < 1.0
    redis_server.start()
    t1 = time.monotonic()
    await until(lambda: fleet.shared, 10)
    assert time.monotonic() - t1 < 5.0
    assert modes[-1] == "shared"
    # The scripts came back with it (a restarted Redis forgets them: NOSCRIPT is handled).
    assert await fleet.run(INCR, [fleet.key("t", "x")], [5]) == 5
    await services.aclose()


async def test_a_store_that_is_not_there_stays_in_fallback(redis_server: RedisServer) -> None:
    services = Services()
    fleet = fleet_for(services)
    port = redis_server.port
    redis_server.stop()
    fleet.configure(RedisStoreOptions(url=f"redis://127.0.0.1:{port}/0", connect_timeout_ms=200))
    await asyncio.sleep(0)  # the loop's first attempt
    await until(lambda: fleet.errors == 0 and fleet.last_error.startswith("redis connect"), 5)
    assert fleet.mode == "fallback"
    fleet.configure(None)
    assert fleet.mode == "none"
    await services.aclose()


def test_the_key_is_typed() -> None:
    assert FLEET.owner is FleetStore
