"""Backend slots leased from a real redis-server by two replicas (two services, each with its own
fleet store and admission queue): the bound, uneven load, rebalancing, a replica that dies,
Redis that goes away."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission.owner import PoolQueue, PoolSpec
from gateway.core.fairqueue import DISPATCHED, QueueParams, Waiter
from gateway.fleet.slots import SlotBook, slots_for
from gateway.fleet.store import REBIRTH_S, fleet_for
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.services import Services
from tests.redis_support import RedisServer
from tests.support import until

pytestmark = pytest.mark.redis

TOTAL = 8


class Replica:
    def __init__(self, server: RedisServer, name: str) -> None:
        self.services = Services()
        self.fleet = fleet_for(self.services)
        self.fleet.configure(
            RedisStoreOptions(url=server.url, connect_timeout_ms=2000, deadline_ms=500)
        )
        self.slots: SlotBook = slots_for(self.services)
        spec = PoolSpec("m", TOTAL, (), 1, TOTAL)
        self.pq = PoolQueue(spec, QueueParams(max_queued=1000, max_wait_s=60), time.monotonic)
        self.running: list[Waiter] = []
        self.waiting: list[Waiter] = []
        self.name = name

    def attach(self) -> None:
        self.slots.attach(self.pq, TOTAL)

    def arrive(self, n: int) -> None:
        q = self.pq.q
        for _ in range(n):
            w, _ = q.arrive(q.tenant(self.name, 0), 0, time.monotonic())
            assert not isinstance(w, str)
            w.handle = asyncio.get_running_loop().create_future()  # as a waiting request's
            self.waiting.append(w)
        if q.waiting:
            self.slots.poke()

    def tick(self) -> None:
        """Move dispatched waiters to running."""
        self.running += [w for w in self.waiting if w.state == DISPATCHED]
        self.waiting = [w for w in self.waiting if w.state != DISPATCHED]

    def finish(self, n: int) -> None:
        self.tick()
        for w in self.running[:n]:
            self.pq.wake(self.pq.q.finish(w, time.monotonic(), 10.0), time.monotonic())
        self.running = self.running[n:]
        self.tick()

    @property
    def busy(self) -> int:
        return self.pq.q.busy

    async def kill(self) -> None:
        """As SIGKILL would: nothing is given back, nothing is renewed."""
        for t in (self.slots.task, self.fleet.task):
            if t is not None:
                t.cancel()
        self.services.closed = True


async def two(server: RedisServer) -> tuple[Replica, Replica]:
    a, b = Replica(server, "a"), Replica(server, "b")
    await until(lambda: a.fleet.shared and b.fleet.shared, 10)
    a.attach()
    b.attach()
    await until(lambda: a.fleet.replicas == 2 and b.fleet.replicas == 2, 10)
    # A store that starts empty caps grants at the fallback share for REBIRTH_S (replicas that
    # have not reconnected yet may still use it): these tests start past it.
    await until(lambda: a.fleet.store_time() > a.fleet.born + REBIRTH_S, 10)
    return a, b


async def test_a_busy_replica_gets_the_slots_the_idle_one_does_not_use(
    redis_server: RedisServer,
) -> None:
    a, b = await two(redis_server)
    assert a.busy == 0 and a.pq.q.capacity == 0  # nothing granted before any demand
    t0 = time.monotonic()
    a.arrive(30)
    await until(lambda: a.busy == TOTAL, 5)
    assert time.monotonic() - t0 < 2.0
    assert b.pq.q.capacity == 0
    # B's clients arrive: A gives slots back as its requests end, B takes them; never more than
    # TOTAL in flight together, and both at their fair share (4) soon.
    b.arrive(30)
    peak = 0
    deadline = time.monotonic() + 10
    while not (a.pq.q.capacity == 4 and b.busy == 4) and time.monotonic() < deadline:
        a.finish(1)
        b.finish(1)
        a.arrive(1)
        b.arrive(1)
        peak = max(peak, a.busy + b.busy)
        await asyncio.sleep(0.01)
        peak = max(peak, a.busy + b.busy)
    assert a.pq.q.capacity == 4 and b.busy == 4
    assert peak <= TOTAL
    st = a.fleet.state()["pools"][0]
    assert st["capacity"] == TOTAL and st["live_replicas"] == 2 and st["mode"] == "shared"
    await a.services.aclose()
    await b.services.aclose()


async def test_a_dead_replicas_slots_come_back_within_two_lease_lifetimes(
    redis_server: RedisServer,
) -> None:
    a, b = await two(redis_server)
    a.arrive(30)
    await until(lambda: a.busy == TOTAL, 5)
    b.arrive(30)
    await asyncio.sleep(0.2)
    assert b.busy == 0  # A holds every slot, all in use
    await a.kill()
    t0 = time.monotonic()
    await until(lambda: b.busy == TOTAL, 5)
    ttl = 1.0
    assert time.monotonic() - t0 <= 2 * ttl
    await b.services.aclose()
    a.services.closed = False
    await a.services.aclose()


async def test_redis_away_each_replica_takes_its_share_then_leases_again(
    redis_server: RedisServer,
) -> None:
    a, b = await two(redis_server)
    a.arrive(30)
    b.arrive(30)
    await until(lambda: a.busy + b.busy == TOTAL, 5)
    redis_server.stop()
    t0 = time.monotonic()
    # The next sync fails: both fall back to 8 / 2 within a second.
    await until(lambda: a.fleet.mode == "fallback" and b.fleet.mode == "fallback", 3)
    assert time.monotonic() - t0 < 1.0
    assert a.pq.q.capacity == 4 and b.pq.q.capacity == 4
    a.finish(8)
    b.finish(8)
    assert a.busy <= 4 and b.busy <= 4
    redis_server.start()
    t1 = time.monotonic()
    await until(lambda: a.fleet.shared and b.fleet.shared, 10)
    assert time.monotonic() - t1 < 5.0
    # Leased again: both still serve, and together never more than TOTAL.
    for _ in range(20):
        a.finish(1)
        b.finish(1)
        a.arrive(1)
        b.arrive(1)
        assert a.busy + b.busy <= TOTAL
        await asyncio.sleep(0.02)
    await until(lambda: a.slots.leases["m"].syncs > 0 and a.busy > 0 and b.busy > 0, 5)
    await a.services.aclose()
    await b.services.aclose()


async def test_a_tenant_served_on_one_replica_is_charged_on_the_other(
    redis_server: RedisServer,
) -> None:
    """Fair admission across the fleet: tokens tenant T was served through A count against T's
    counter on B (merged through the store), so T spreading over replicas is charged once."""
    a, b = await two(redis_server)
    a.slots.task.cancel() if a.slots.task else None  # merges run by hand below
    b.slots.task.cancel() if b.slots.task else None
    now = time.monotonic()
    ta, tb = a.pq.q.tenant("T", 0), b.pq.q.tenant("T", 0)
    other = b.pq.q.tenant("U", 0)
    wa, _ = a.pq.q.arrive(ta, 0, now)
    wb, _ = b.pq.q.arrive(tb, 0, now)
    assert not isinstance(wa, str) and not isinstance(wb, str)
    wa.handle = asyncio.get_running_loop().create_future()  # as waiting requests'
    wb.handle = asyncio.get_running_loop().create_future()
    for sb in (a.slots, b.slots):
        await sb.sync_once()
        await sb.sync_served()  # first sight: nothing charged
    wb2, _ = b.pq.q.arrive(tb, 0, time.monotonic())  # T still active on B
    before = tb.vt
    assert wa.state == DISPATCHED
    a.pq.q.finish(wa, time.monotonic(), 1000.0)  # A served T 1000 tokens
    assert await a.slots.sync_served() == 1
    assert await b.slots.sync_served() == 1
    assert tb.vt - before == pytest.approx(1000.0)
    assert other.vt == 0.0  # nobody else is charged
    assert b.fleet.state()["pools"][0]["tokens_charged_elsewhere"] == 1000
    # Served here is reported once: a second merge charges nothing more.
    assert await b.slots.sync_served() == 1 and tb.vt - before == pytest.approx(1000.0)
    assert not isinstance(wb2, str)
    await a.services.aclose()
    await b.services.aclose()


async def test_a_reload_without_the_store_gives_each_replica_its_own_slots_again(
    redis_server: RedisServer,
) -> None:
    from gateway.admission.owner import admission_for

    r = Replica(redis_server, "a")
    await until(lambda: r.fleet.shared, 10)
    book = admission_for(r.services)
    spec = PoolSpec("m", TOTAL, (), 1, TOTAL)
    params = QueueParams(max_queued=100, max_wait_s=5)
    book.activate([spec], params, r.slots)
    pq = book.pools["m"]
    assert pq.lease is r.slots.leases["m"] and pq.q.capacity == 0  # leased: nothing until asked
    book.activate([spec], params, None)  # the next policy names no store
    assert pq.lease is None and pq.q.capacity == TOTAL
    book.activate([spec], params, r.slots)  # and back
    assert pq.lease is r.slots.leases["m"]
    book.activate([], params, r.slots)  # the pool is gone: its lease goes back at the next sync
    assert "m" not in r.slots.leases
    await r.services.aclose()
