"""The fair queue's dispatch order, bounds, leaving and deadline guard, driven by hand (`now`
passed in: a manual clock)."""

from __future__ import annotations

import pytest

from gateway.core.fairqueue import (
    DEADLINE_UNREACHABLE,
    DISPATCHED,
    GONE,
    QUEUE_FULL,
    WAITING,
    FairQueue,
    QueueParams,
    Waiter,
)

P = QueueParams(max_queued=100, max_wait_s=5.0, initial_cost=10.0)
# Arrivals per queue, by the queue's id (a compiled FairQueue takes no attributes of the test's).
ARRIVED: dict[int, tuple[FairQueue, int]] = {}


def waiter(q: FairQueue, tenant: str, cls: int = 0, now: float = 0.0, weight: float = 1.0,
           deadline: float | None = None) -> Waiter:  # fmt: skip
    w, evicted = q.arrive(q.tenant(tenant, cls, weight), cls, now, deadline)
    assert isinstance(w, Waiter) and evicted is None
    n = ARRIVED.get(id(q), (q, 0))[1] + 1
    ARRIVED[id(q)] = (q, n)  # the queue held: its id is not reused by a later one
    w.handle = f"{tenant}{n}"
    return w


def order(q: FairQueue, now: float = 1.0) -> list[str]:
    """Dispatch everything through one free slot, each request finishing at the cost it was
    charged (the next one takes the slot it frees)."""
    q.capacity = q.busy + 1
    out = []
    pending = q.dispatchable(now)
    while pending:
        w = pending.pop(0)
        out.append(str(w.handle))
        pending += q.finish(w, now, w.charged)
    return out


def full(capacity: int = 1, p: QueueParams = P) -> FairQueue:
    q = FairQueue(p, capacity)
    ARRIVED[id(q)] = (q, 0)
    for i in range(capacity):
        w, _ = q.arrive(q.tenant(f"busy{i}", 9), 9, 0.0)
        assert isinstance(w, Waiter) and w.state == DISPATCHED
    return q


def test_a_free_slot_dispatches_at_once_and_charges_the_tenant() -> None:
    q = FairQueue(P, 2)
    w, evicted = q.arrive(q.tenant("a", 0), 0, 0.0)
    assert isinstance(w, Waiter) and w.state == DISPATCHED and evicted is None
    assert q.busy == 1 and q.waiting == 0
    assert w.tenant.vt == 10.0  # the initial cost, before any is reported


# Each row: arrivals (tenant, class, deadline) while every slot is busy; the dispatch order.
ORDER = [
    pytest.param([("a", 2, None), ("b", 1, None), ("c", 0, None)], ["c3", "b2", "a1"],
                 id="strict-priority-between-classes"),
    pytest.param([("a", 0, None), ("a", 0, None), ("a", 0, None), ("b", 0, None),
                  ("b", 0, None)], ["a1", "b4", "a2", "b5", "a3"],
                 id="fair-between-tenants-of-a-class"),
    pytest.param([("a", 0, None), ("a", 0, 3.0), ("a", 0, 2.0), ("a", 0, None)],
                 ["a3", "a2", "a1", "a4"], id="edf-then-fifo-inside-a-tenant"),
    pytest.param([("a", 1, None), ("a", 1, None), ("b", 1, None), ("c", 0, None)],
                 ["c4", "a1", "b3", "a2"], id="a-higher-class-jumps-the-fair-order"),
]  # fmt: skip


@pytest.mark.parametrize(("arrivals", "expected"), ORDER)
def test_dispatch_order(arrivals: list[tuple[str, int, float | None]], expected: list[str]) -> None:
    q = full()
    for tenant, cls, deadline in arrivals:
        waiter(q, tenant, cls, deadline=deadline)
    assert order(q) == expected


def test_counters_are_divided_by_weight() -> None:
    q = full()
    for _ in range(6):
        waiter(q, "heavy", weight=2.0)
        waiter(q, "light", weight=1.0)
    got = order(q)[:6]
    assert sum(g.startswith("heavy") for g in got) == 4  # twice the share of the light one


def test_served_tokens_reconcile_the_counter() -> None:
    q = FairQueue(P, 2)
    wa, _ = q.arrive(q.tenant("a", 0), 0, 0.0)
    wb, _ = q.arrive(q.tenant("b", 0), 0, 0.0)
    assert isinstance(wa, Waiter) and isinstance(wb, Waiter)
    q.finish(wa, 1.0, cost=1000.0)  # a long generation
    q.finish(wb, 1.0, cost=20.0)
    assert q.classes[0].tenants["a"].vt == 1000.0 and q.classes[0].tenants["b"].vt == 20.0
    q.capacity = 0
    for _ in range(3):
        waiter(q, "a", now=2.0)
        waiter(q, "b", now=2.0)
    q.capacity = 1
    first = q.next(2.0)
    assert first is not None and first.tenant.key == "b"
    assert first.charged == 20.0  # charged its own average at dispatch


def test_a_new_tenant_starts_at_the_minimum_of_the_active_ones() -> None:
    q = full()
    t = q.tenant("old", 0)
    t.vt = 500.0
    waiter(q, "old")
    newcomer = waiter(q, "new")
    assert newcomer.tenant.vt == 500.0  # no credit banked while it was idle
    ahead = q.tenant("ahead", 0)
    ahead.vt = 900.0
    waiter(q, "ahead")
    assert ahead.vt == 900.0  # never lowered


def test_a_tenant_served_alone_sets_the_floor_a_newcomer_starts_from() -> None:
    """B runs alone (every request dispatched at once, never queued), then A arrives into a
    full pool: A starts at B's counter, not at zero, so it does not get the slots until it has
    been served all that B was served alone."""
    q = FairQueue(P, 2)
    for i in range(50):
        w, _ = q.arrive(q.tenant("b", 0), 0, float(i))
        assert isinstance(w, Waiter) and w.state == DISPATCHED
        q.finish(w, i + 0.5, 40.0)
    b_vt = q.tenant("b", 0).vt
    assert b_vt == 2000.0
    first, _ = q.arrive(q.tenant("a", 0), 0, 60.0)
    assert isinstance(first, Waiter) and first.tenant.vt >= 1960.0  # started at B's floor
    q.arrive(q.tenant("a", 0), 0, 60.0)
    a2, b2 = waiter(q, "a", now=60.1), waiter(q, "b", now=60.2)
    assert q.finish(first, 61.0, 40.0) == [b2]  # B is behind A now: it goes first
    assert a2.state == WAITING


def test_the_lowest_class_is_refused_first_when_full() -> None:
    q = full(p=QueueParams(max_queued=3))
    low = [waiter(q, "free", 2) for _ in range(2)]
    waiter(q, "gold", 0)
    w, evicted = q.arrive(q.tenant("free2", 2), 2, 0.0)
    assert w == QUEUE_FULL and evicted is None  # the same lowest class: refused itself
    w, evicted = q.arrive(q.tenant("silver", 1), 1, 0.0)
    assert isinstance(w, Waiter) and evicted is low[1]  # the tail of the lowest class goes
    assert evicted.state == GONE and q.waiting == 3
    w, evicted = q.arrive(q.tenant("silver", 1), 1, 0.0)
    assert evicted is low[0]
    w, evicted = q.arrive(q.tenant("silver", 1), 1, 0.0)
    assert w == QUEUE_FULL  # nothing below silver left to refuse


def test_a_waiter_that_left_is_skipped_and_frees_its_place() -> None:
    q = full()
    a1, a2 = waiter(q, "a"), waiter(q, "a")
    b = waiter(q, "b")
    q.leave(a1)
    q.leave(b)
    q.leave(b)  # twice is harmless
    assert q.waiting == 1 and a1.state == GONE
    q.capacity = 2
    assert q.next(1.0) is a2 and q.next(1.0) is None


def test_expiry_is_the_max_wait_or_the_deadline_whichever_first() -> None:
    q = full()
    assert waiter(q, "a", now=1.0).expires == 6.0
    assert waiter(q, "a", now=1.0, deadline=2.5).expires == 2.5


@pytest.mark.parametrize(
    ("higher", "queued", "hold_s", "ttft_s", "deadline", "reachable"),
    [
        (0, 0, 1.0, 0.1, 0.5, False),  # one slot busy for ~1 s: no first token in 0.5 s
        (0, 0, 1.0, 0.1, 1.2, True),
        (0, 4, 1.0, 0.1, 2.0, False),  # another tenant waits: its turn comes first
        (0, 4, 1.0, 0.1, 2.2, True),  # ... but only one of its four (turns alternate)
        (3, 4, 1.0, 0.1, 4.0, False),  # a higher class is served first, all of it
        (3, 4, 1.0, 0.1, 5.2, True),
        (0, 0, 0.0, 0.0, 0.01, True),  # nothing measured yet: not refused on a guess
    ],
)
def test_hopeless_deadlines_are_refused_at_once(
    higher: int, queued: int, hold_s: float, ttft_s: float, deadline: float, reachable: bool
) -> None:
    q = full()
    q.hold_s, q.ttft_s = hold_s, ttft_s
    for _ in range(higher):
        waiter(q, "gold", 0)
    for _ in range(queued):
        waiter(q, "other", 1)
    w, _ = q.arrive(q.tenant("me", 1), 1, 0.0, deadline)
    assert isinstance(w, Waiter) is reachable
    if not reachable:
        assert w == DEADLINE_UNREACHABLE


def test_shed_refuses_lower_classes_newest_first() -> None:
    q = full()
    g = waiter(q, "g", 0)
    s1, s2 = waiter(q, "s", 1), waiter(q, "s", 1)
    f = waiter(q, "f", 2)
    assert q.shed(keep=0) == [f, s2, s1]
    assert g.state == WAITING and q.waiting == 1


def test_finish_dispatches_the_next_and_learns_hold_and_ttft() -> None:
    q = FairQueue(P, 1)
    first, _ = q.arrive(q.tenant("a", 0), 0, 0.0)
    assert isinstance(first, Waiter)
    second = waiter(q, "b", now=0.1)
    assert q.finish(first, 2.0, cost=50.0, ttft=0.3) == [second]
    assert second.state == DISPATCHED and q.hold_s == 2.0 and q.ttft_s == 0.3
    assert q.finish(first, 2.0, 50.0) == []  # finishing twice does nothing


def test_a_larger_capacity_dispatches_as_many_as_it_frees() -> None:
    q = full()
    ws = [waiter(q, t) for t in "abc"]
    assert q.set_capacity(3, 1.0) == ws[:2]


def test_tenant_records_are_bounded_idle_ones_first() -> None:
    q = FairQueue(QueueParams(max_tenants=10), 1000)
    for i in range(50):
        w, _ = q.arrive(q.tenant(f"t{i}", 0), 0, 0.0)
        assert isinstance(w, Waiter)
        q.finish(w, 0.1, 1.0)
    assert len(q.classes[0].tenants) <= 10


def test_a_forgotten_tenant_comes_back_at_the_current_counter() -> None:
    # Not at 0: a tenant whose record was dropped would otherwise go before every other for as
    # long as they took to be served that much.
    q = FairQueue(QueueParams(max_tenants=10, initial_cost=100.0), 1)

    def serve(key: str, at: float) -> None:
        w, _ = q.arrive(q.tenant(key, 0), 0, at)
        assert isinstance(w, Waiter)
        q.finish(w, at, 100.0)

    serve("gone", 0.0)
    for i in range(20):
        serve("heavy", float(i))
    for i in range(20):  # tenants seen once: the idle records go, the oldest first
        serve(f"once{i}", 30.0 + i)
    cq = q.classes[0]
    assert "gone" not in cq.tenants and len(cq.tenants) <= 10
    assert q.tenant("gone", 0).vt == cq.last_vt >= 1900.0


def test_heaps_stay_bounded_by_the_live_waiters() -> None:
    q = full()
    for _ in range(1000):
        w = waiter(q, "a")
        q.leave(w)
        x = waiter(q, "b")
        q.leave(x)
    keep = waiter(q, "a")
    assert len(q.classes[0].heap) < 100 and len(q.classes[0].arrivals) < 200
    q.capacity = 2
    assert q.next(1.0) is keep


def test_a_request_that_never_reached_the_backend_is_refunded_and_teaches_nothing() -> None:
    q = FairQueue(P, 1)
    w, _ = q.arrive(q.tenant("a", 0), 0, 0.0)
    assert isinstance(w, Waiter) and w.tenant.vt == 10.0
    nxt = waiter(q, "b")
    assert q.finish(w, 3.0, 999.0, 0.5, served=False) == [nxt]
    assert w.tenant.vt == 0.0 and w.tenant.served == 0.0
    assert q.hold_s == 0.0 and q.ttft_s == 0.0 and w.tenant.avg_cost == 0.0


# -- anticipation: a slot freed by a tenant with nobody waiting, held for its next request ----

A = QueueParams(max_queued=100, max_wait_s=5.0, initial_cost=10.0, anticipate_s=0.02)


def ending(p: QueueParams = A) -> tuple[FairQueue, Waiter]:
    """One slot, held by tenant b (class 1, counter 10 once it ends at its charge)."""
    q = FairQueue(p, 1)
    w, _ = q.arrive(q.tenant("b", 1), 1, 0.0)
    assert isinstance(w, Waiter) and w.state == DISPATCHED
    return q, w


def queued(q: FairQueue, tenant: str, cls: int, vt: float) -> Waiter:
    q.tenant(tenant, cls).vt = vt
    return waiter(q, tenant, cls)


# Each row: the waiters when b's request ends (tenant, class, counter); whether b's slot is held.
HOLDS = [
    pytest.param([("f", 2, 0.0)], True, id="a lower class waits: held for b"),
    pytest.param([("g", 0, 500.0)], False, id="a higher class waits: it takes the slot"),
    pytest.param([("a", 1, 100.0)], True, id="a larger counter waits: b would win, held"),
    pytest.param([("a", 1, 10.0)], True, id="an equal counter: b lifted to it wins the tie, held"),
    pytest.param([("a", 1, 5.0)], False, id="a smaller counter waits: it takes the slot"),
    pytest.param([("b", 1, 10.0)], False, id="b waits itself: its waiter takes the slot"),
    pytest.param([], False, id="nobody waits: the slot is simply free"),
]


@pytest.mark.parametrize(("waiting", "held"), HOLDS)
def test_when_a_freed_slot_is_held(waiting: list[tuple[str, int, float]], held: bool) -> None:
    q, w = ending()
    ws = [queued(q, t, c, vt) for t, c, vt in waiting]
    got = q.finish(w, 1.0, w.charged)
    assert got == ([] if held else ws[:1])
    assert bool(q.holds) is held and q.busy == (1 if ws else 0)
    assert q.next_expiry() == (1.02 if held else None)


def test_without_anticipation_nothing_is_held() -> None:
    q, w = ending(P)
    f = queued(q, "f", 2, 0.0)
    assert q.finish(w, 1.0, w.charged) == [f] and not q.holds


def test_the_held_slot_goes_to_the_tenant_that_comes_back() -> None:
    q, w = ending()
    f = queued(q, "f", 2, 0.0)
    assert q.finish(w, 1.0, w.charged) == []
    back, _ = q.arrive(q.tenant("b", 1), 1, 1.005)
    assert isinstance(back, Waiter) and back.state == DISPATCHED  # at once, ahead of f
    assert q.busy == 1 and not q.holds and back.tenant.held == 0
    assert q.expire(1.05) == [] and f.state == WAITING  # nothing left to expire
    assert q.finish(back, 1.2, back.charged) == []  # held again: it came back


def test_an_unused_hold_expires_to_the_queue_and_stops_the_holds() -> None:
    q, w = ending()
    f1, f2 = queued(q, "f", 2, 0.0), queued(q, "f", 2, 0.0)
    assert q.finish(w, 1.0, w.charged) == []
    assert q.expire(1.01) == []  # not yet
    assert q.expire(1.02) == [f1] and q.busy == 1 and not q.holds
    late, _ = q.arrive(q.tenant("b", 1), 1, 1.3)  # b came back late: it waits for its turn
    assert isinstance(late, Waiter) and late.state == WAITING
    assert q.finish(f1, 1.4, f1.charged) == [late]
    assert q.finish(late, 1.5, late.charged) == [f2]  # not held: b did not come back in time


def test_a_return_within_the_window_makes_the_tenant_held_for_again() -> None:
    q, w = ending()
    queued(q, "f", 2, 0.0)
    queued(q, "f", 2, 0.0)
    q.finish(w, 1.0, w.charged)
    (f1,) = q.expire(1.02)
    b2 = waiter(q, "b", 1, now=1.01)  # came back a hair late, yet within 20 ms of its end
    assert q.finish(f1, 1.5, f1.charged) == [b2]
    assert q.finish(b2, 1.6, b2.charged) == [] and q.holds  # held for again


# -- reserved slots ---------------------------------------------------------------------------

# Each row: capacity, share, rank; the slots each class 0..2 may fill.
ROOMS = [
    (4, 0.25, 0, [4, 3, 3]),
    (8, 0.2, 0, [8, 6, 6]),  # rounded up: 1.6 -> 2
    (8, 0.25, 1, [8, 8, 6]),
    (8, 1.0, 0, [8, 0, 0]),
    (3, 0.0, 0, [3, 3, 3]),  # none
]


@pytest.mark.parametrize(("capacity", "share", "rank", "rooms"), ROOMS)
def test_reserved_slots_per_class(capacity: int, share: float, rank: int, rooms: list[int]) -> None:
    q = FairQueue(QueueParams(reserve_share=share, reserve_rank=rank), capacity)
    assert [q.room(c) for c in range(3)] == rooms


def test_a_lower_class_waits_while_only_reserved_slots_are_free() -> None:
    q = FairQueue(QueueParams(reserve_share=0.25, reserve_rank=0, initial_cost=10.0), 4)
    running = [q.arrive(q.tenant("s", 1), 1, 0.0)[0] for _ in range(3)]
    assert all(isinstance(w, Waiter) and w.state == DISPATCHED for w in running)
    s4 = waiter(q, "s", 1)
    assert s4.state == WAITING and q.busy == 3  # the 4th slot is gold's
    g, _ = q.arrive(q.tenant("g", 0), 0, 0.1)
    assert isinstance(g, Waiter) and g.state == DISPATCHED  # at once, past the silver waiter
    assert q.finish(g, 0.5, g.charged) == []  # a reserved slot freed: silver still waits
    first = running[0]
    assert isinstance(first, Waiter) and q.finish(first, 0.6, first.charged) == [s4]
