"""The budgets' owner: ledgers per period under a faked wall clock (without a store), and its
sync script against a real redis-server: exact settlement, replays applied once, leases that
never exceed the budget, a dead replica's holding counted as spent, operators' changes."""

from __future__ import annotations

import asyncio

import pytest

from gateway.budgets.compiled import compile_budgets
from gateway.budgets.owner import Book, book_for
from gateway.budgets.store import Msg, expire_at, redis_key
from gateway.core.budgets import Period, window
from gateway.fleet.store import fleet_for
from gateway.policy.budgets import Budgets
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.services import Services
from tests.redis_support import RedisServer
from tests.support import until


class Wall:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def section(period: dict[str, str], tokens: int = 1000, **kw: object) -> Budgets:
    rule = {"name": "r", "key": [], "tokens": tokens, "period": period}
    return Budgets.model_validate({"rules": [rule], **kw})


@pytest.mark.parametrize(
    ("period", "edge"),
    [
        ({"rolling": "10s"}, 1_800_000_000.0),
        ({"calendar": "day"}, 1_796_515_200.0),  # 2026-12-06T00:00:00Z
    ],
)
def test_a_period_resets_exactly_at_its_edge(period: dict[str, str], edge: float) -> None:
    wall = Wall(edge - 0.5)
    book = Book(Services(), wall)
    c = compile_budgets(section(period))
    book.activate(c)
    (rb,) = book.rules.values()
    e = book.entry(rb, "*", 1000, wall())
    assert e.ledger.reserve(900)
    e.ledger.settle(900, 900)
    assert not e.ledger.reserve(200)
    wall.t = edge - 1e-6
    assert book.entry(rb, "*", 1000, wall()) is e  # not a moment early
    wall.t = edge
    fresh = book.entry(rb, "*", 1000, wall())
    assert fresh is not e and fresh.ledger.avail == 1000 and fresh.ledger.reserve(1000)
    assert fresh.ledger.window.start == edge


def msg(key: str, seq: int, **kw: int) -> Msg:
    fields = {"limit": 1000, "used": 0, "back": 0, "want": 0, "held": 0}
    fields.update(kw)
    return Msg(key, seq, fields["limit"], fields["used"], fields["back"], fields["want"],
               fields["held"], 2_000_000_000)  # fmt: skip


async def shared(redis_server: RedisServer, ttl_s: float = 30.0) -> tuple[Services, Book]:
    services = Services()
    fleet = fleet_for(services)
    fleet.configure(RedisStoreOptions(url=redis_server.url, connect_timeout_ms=2000,
                                      deadline_ms=500))  # fmt: skip
    book = book_for(services)
    book.activate(compile_budgets(section({"calendar": "day"}, reservation_ttl_s=ttl_s)))
    await until(lambda: fleet.shared, 10)
    return services, book


@pytest.mark.redis
async def test_the_script_leases_settles_and_applies_a_replay_once(
    redis_server: RedisServer,
) -> None:
    services, book = await shared(redis_server)
    store = book.store
    assert store is not None
    key = redis_key("sluice", "x", "k", "d1")
    (r,) = await store.sync([msg(key, 1, want=600)])
    assert r.granted == 600 and r.used == 0 and r.left == 400
    (r,) = await store.sync([msg(key, 2, used=250, want=600, held=100)])
    assert r.granted == 400  # only what is left: leases never exceed the budget
    assert r.used == 250 and r.reserved == 100 and r.left == 0
    again = msg(key, 2, used=250, want=600, held=100)  # its answer was lost: sent again
    (r2,) = await store.sync([again])
    assert r2.granted == 400 and r2.used == 250  # the same answer, nothing applied twice
    (r,) = await store.sync([msg(key, 3, used=30, back=100)])
    assert r.used == 280 and r.left == 100
    f = await store.admin(key, "show", 0, 1000, 2_000_000_000)
    assert (f.limit, f.used, f.reserved, f.remaining) == (1000, 280, 0, 720)
    f = await store.admin(key, "grant", 500, 1000, 2_000_000_000)
    assert f.limit == 1500 and f.remaining == 1220
    f = await store.admin(key, "reset", 0, 1000, 2_000_000_000)
    assert f.used == 0 and f.limit == 1000
    await services.aclose()


@pytest.mark.redis
async def test_a_dead_replica_holding_counts_as_spent(redis_server: RedisServer) -> None:
    s1, dead = await shared(redis_server, ttl_s=1)
    s2, alive = await shared(redis_server, ttl_s=1)
    assert dead.store is not None and alive.store is not None
    key = redis_key("sluice", "x", "k", "d1")
    dead.store.ttl_ms = 1  # it is not heard from again after this sync: dead 1 ms later
    (r,) = await dead.store.sync([msg(key, 1, want=300, held=120)])
    assert r.granted == 300
    seq, used = 0, 0
    while True:  # the next sync of another replica after that counts what it held
        seq += 1
        used += 10
        (r,) = await alive.store.sync([msg(key, seq, used=10)])
        if r.expired or seq > 100:
            break
        await asyncio.sleep(0.005)
    assert r.expired == ((dead.fleet.replica_id, 300, 120),)
    assert r.used == used + 300 and r.reserved == 0
    # The dead replica comes back after all: it is told its lease was lost.
    (r,) = await dead.store.sync([msg(key, 2, used=50)])
    assert r.lost and r.used == used + 350
    await s1.aclose()
    await s2.aclose()


async def test_window_of_the_store_key_and_its_expiry() -> None:
    w = window(Period(rolling_s=10), 1_800_000_000.0)
    assert expire_at(w.end, w.end - w.start) == int(w.end) + 61
    assert redis_key("p", "id", "a|b", w.id).startswith("p:budget:{id:")


def test_a_reload_keeps_tallies_and_applies_a_new_amount() -> None:
    wall = Wall(1_800_000_000.0)
    book = Book(Services(), wall)
    book.activate(compile_budgets(section({"calendar": "day"}, tokens=1000)))
    (rb,) = book.rules.values()
    e = book.entry(rb, "*", 1000, wall())
    assert e.ledger.reserve(400)
    e.ledger.settle(400, 300)
    book.activate(compile_budgets(section({"calendar": "day"}, tokens=1500)))
    assert list(book.rules.values()) == [rb] and rb.entries["*"] is e
    assert e.ledger.limit == 1500 and e.ledger.avail == 1200 and e.ledger.used == 300
    book.activate(compile_budgets(section({"calendar": "week"}, tokens=1500)))
    (other,) = book.rules.values()
    assert other is not rb and not other.entries  # another period: new tallies


def test_activated_without_a_running_loop_starts_nothing() -> None:
    services = Services()
    fleet_for(services).configure(RedisStoreOptions(url="redis://127.0.0.1:1/0"))
    book = book_for(services)
    book.activate(compile_budgets(section({"calendar": "day"})))  # a chain built offline
    assert book.store is not None and book.task is None and services.tasks == 0
