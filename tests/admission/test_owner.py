"""The admission owner: futures of waiting requests woken or refused, a slot handed over by a
request that is gone, reloads that keep who waits."""

from __future__ import annotations

import asyncio

from gateway.admission.owner import AdmissionBook, PoolSpec
from gateway.core.clock import ManualClock
from gateway.core.fairqueue import DISPATCHED, GONE, QueueParams, Waiter
from gateway.services import Services

P = QueueParams(max_queued=10, max_wait_s=5.0)


def waiting(
    book: AdmissionBook, name: str, tenant: str
) -> tuple[Waiter, asyncio.Future[str | None]]:
    pq = book.pools[name]
    w, _ = pq.q.arrive(pq.q.tenant(tenant, 0), 0, 0.0)
    assert isinstance(w, Waiter)
    fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
    w.handle = fut
    return w, fut


async def test_a_slot_given_to_a_request_that_left_passes_to_the_next() -> None:
    book = AdmissionBook(Services(ManualClock()))
    book.activate([PoolSpec("p", 1)], P)
    pq = book.pools["p"]
    first, _ = pq.q.arrive(pq.q.tenant("a", 0), 0, 0.0)
    assert isinstance(first, Waiter) and first.state == DISPATCHED
    gone, gone_fut = waiting(book, "p", "b")
    nxt, nxt_fut = waiting(book, "p", "c")
    gone_fut.cancel()  # its client left, and the task has not run its cleanup yet
    pq.wake(pq.q.finish(first, 1.0, 10.0), 1.0)
    assert gone.state == GONE and nxt.state == DISPATCHED
    assert nxt_fut.done() and nxt_fut.result() is None and pq.q.busy == 1


async def test_refused_waiters_learn_why() -> None:
    book = AdmissionBook(Services(ManualClock()))
    book.activate([PoolSpec("p", 1)], P)
    pq = book.pools["p"]
    pq.q.arrive(pq.q.tenant("a", 0), 0, 0.0)
    w, fut = waiting(book, "p", "b")
    pq.q.leave(w)
    pq.refuse(w, "shed")
    assert fut.result() == "shed"


async def test_a_reload_keeps_the_waiters_and_gives_new_room_at_once() -> None:
    book = AdmissionBook(Services(ManualClock()))
    book.activate([PoolSpec("p", 1), PoolSpec("old", 1)], P)
    pq = book.pools["p"]
    pq.q.arrive(pq.q.tenant("a", 0), 0, 0.0)
    w1, f1 = waiting(book, "p", "b")
    w2, f2 = waiting(book, "p", "c")
    wider = QueueParams(max_queued=100, max_wait_s=9.0)
    book.activate([PoolSpec("p", 2)], wider)  # one more slot; "old" is no longer named
    assert book.pools["p"] is pq and pq.q.p is wider
    assert f1.done() and not f2.done() and pq.q.waiting == 1  # the new slot went to the first
    assert "old" not in book.pools
    assert book.state()["pools"][0]["queued"] == 1


async def test_a_held_slot_is_released_to_the_queue_when_its_hold_expires() -> None:
    clock = ManualClock(1.0)
    book = AdmissionBook(Services(clock))
    book.activate([PoolSpec("p", 1)], QueueParams(anticipate_s=0.01, initial_cost=10.0))
    pq = book.pools["p"]
    b, _ = pq.q.arrive(pq.q.tenant("b", 1), 1, 1.0)
    assert isinstance(b, Waiter)
    w, _ = pq.q.arrive(pq.q.tenant("f", 2), 2, 1.0)
    assert isinstance(w, Waiter)
    fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
    w.handle = fut
    pq.wake(pq.q.finish(b, 1.0, 10.0), 1.0)
    pq.arm(1.0)
    assert pq.state()["held"] == 1 and not fut.done()
    clock.t = 1.011
    await asyncio.wait_for(fut, 1.0)  # the timer fired and gave f the slot
    assert fut.result() is None and w.state == DISPATCHED and pq.state()["held"] == 0
    assert pq.timer is None
