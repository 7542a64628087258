"""The admission queues of every backend pool, one owner in the services (`ADMISSION`), so that
they outlive reloads: a reload that changes the `admission:` section gives the queues their new
bounds (`max_wait_ms` applies to requests that arrive from then on, `max_queued` at once) and
keeps every waiting request, its place and every tenant's counter; a pool whose capacity changed
(`max_in_flight`, its members) dispatches into the new room at once. A pool no policy names any
more is dropped once nothing waits in it or runs through it.

The decisions are `gateway.core.fairqueue`'s; this module holds what waits (one future per
waiting request, in `Waiter.handle`: None when dispatched, the refusal reason when refused) and
what the status page and metrics read (`state()`, `LIVE_BOOKS`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gateway.core.fairqueue import DISPATCHED, FairQueue, QueueParams, Waiter
from gateway.services import ServiceKey, Services

MAX_SAMPLES = 512  # recent waits kept per pool (for the state's percentiles)
MAX_TENANTS_SHOWN = 20  # per pool in /admin/state, most served first

LIVE_BOOKS: weakref.WeakSet[AdmissionBook] = weakref.WeakSet()  # read by the metrics collector


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a policy says of one pool: its fixed capacity (Σ static members × `max_in_flight`,
    the worker's share), or 0 when the adaptive concurrency limit of `rate_limits.concurrency`
    sets it; `per_member`: (backend, max_in_flight) to follow the members in rotation with."""

    name: str
    fixed: int
    per_member: tuple[tuple[str, int], ...] = ()
    workers: int = 1
    total: int = 0  # the fixed capacity before the worker's share (the fleet's, with a store)


class PoolQueue:
    """One backend pool's queue, its refusals and recent waits."""

    __slots__ = ("name", "q", "spec", "refused", "waits", "dispatched", "plans", "now", "timer",
                 "timer_at", "lease", "__weakref__")  # fmt: skip

    def __init__(self, spec: PoolSpec, params: QueueParams, now: Callable[[], float]) -> None:
        self.name = spec.name
        self.now = now
        self.timer: asyncio.TimerHandle | None = None  # releases the earliest held slot
        self.timer_at = 0.0
        self.spec = spec
        self.q = FairQueue(params, spec.fixed or 1)
        self.refused: Counter[str] = Counter()
        self.waits: deque[tuple[int, float]] = deque(maxlen=MAX_SAMPLES)  # (class, seconds)
        self.dispatched = 0
        self.plans: list[Any] = []  # the members' plans its slots were last counted from
        # With a fleet store: the slots this replica leased (`gateway.fleet.slots.SlotLease`).
        self.lease: Any = None

    def wake(self, ws: list[Waiter], now: float) -> None:
        """Hand the slots `ws` took to their waiting requests; a request that is gone already
        (its future cancelled) gives its slot straight to the next."""
        q = self.q
        while ws:
            w = ws.pop()
            fut = w.handle
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_result(None)
            elif w.state == DISPATCHED:
                ws += q.finish(w, now, 0.0, served=False)

    def arm(self, now: float) -> None:
        """Have the earliest slot held for a tenant (anticipation) released when its hold
        expires, unless a timer set for then or sooner runs already."""
        at = self.q.next_expiry()
        if at is None or (self.timer is not None and self.timer_at <= at):
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = at
        # A hair late, so that the clock has passed `at` when it fires.
        delay = max(at - now, 0.0) + 0.0005
        self.timer = asyncio.get_running_loop().call_later(delay, self.expire)

    def expire(self) -> None:
        self.timer = None
        now = self.now()
        self.wake(self.q.expire(now), now)
        self.arm(now)

    def refuse(self, w: Waiter, reason: str) -> None:
        """A waiting request is refused (made room for, shed): its future says why (its own
        task counts the refusal)."""
        fut = w.handle
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_result(reason)

    def resize(self, capacity: int, now: float) -> None:
        if capacity != self.q.capacity:
            self.wake(self.q.set_capacity(max(capacity, 1), now), now)

    def size(self, total: int, now: float) -> None:
        """The pool's fixed slots are `total` (max_in_flight × members): with a fleet lease the
        fleet's, of which this replica runs what it holds; else this worker's share of them
        (1/N, rounded up)."""
        lease = self.lease
        if lease is not None:
            lease.set_total(total, now)
        else:
            self.resize(max(1, -(-total // self.spec.workers)), now)

    def set_slots(self, capacity: int, now: float) -> None:
        """The slots a fleet lease grants (0 allowed: the requests wait for a grant)."""
        if capacity != self.q.capacity:
            self.wake(self.q.set_capacity(max(capacity, 0), now), now)

    def state(self) -> dict[str, Any]:
        q = self.q
        classes = {str(c): cq.waiting for c, cq in q.classes.items() if cq.waiting}
        waits = sorted(s for _, s in self.waits)
        tenants: list[dict[str, Any]] = []
        total = sum(t.served for cq in q.classes.values() for t in cq.tenants.values()) or 1.0
        for c, cq in q.classes.items():
            for t in cq.tenants.values():
                tenants.append({
                    "tenant": t.key, "class": c, "weight": t.weight,
                    "counter": round(t.vt, 1), "served_tokens": round(t.served),
                    "share": round(t.served / total, 4), "waiting": t.live,
                    "in_flight": t.in_flight,
                })  # fmt: skip
        tenants.sort(key=lambda r: -float(r["served_tokens"]))
        out: dict[str, Any] = {
            "pool": self.name,
            "capacity": q.capacity,
            "in_flight": q.busy,
            "queued": q.waiting,
            "queued_by_class": classes,
            "held": len(q.holds),
            "dispatched": self.dispatched,
            "wait_p50_ms": round(_pct(waits, 0.5) * 1000, 1),
            "wait_p99_ms": round(_pct(waits, 0.99) * 1000, 1),
            "ttft_ms": round(q.ttft_s * 1000, 1),
            "refused": dict(self.refused),
        }
        if tenants:  # (an empty list would show as a column of the pools' table)
            out["tenants"] = tenants[:MAX_TENANTS_SHOWN]
        return out


class AdmissionBook:
    """Every pool's queue, by pool name."""

    def __init__(self, services: Services) -> None:
        self.clock = services.clock
        self.pools: dict[str, PoolQueue] = {}
        LIVE_BOOKS.add(self)

    def pool(self, spec: PoolSpec, params: QueueParams) -> PoolQueue:
        """The queue of `spec.name`, created empty on first use (its bounds and capacity are
        those of the policy that goes live: `activate`)."""
        p = self.pools.get(spec.name)
        if p is None:
            p = self.pools[spec.name] = PoolQueue(spec, params, self.clock.now)
        return p

    def activate(self, specs: list[PoolSpec], params: QueueParams, slots: Any = None) -> None:
        """The pools of the policy going live; `slots` (a `gateway.fleet.slots.SlotBook`, with
        a fleet store) leases the fixed pools' slots for the fleet."""
        now = self.clock.now()
        names = {s.name for s in specs}
        leased: set[str] = set()
        for s in specs:
            p = self.pool(s, params)
            p.spec = s
            p.q.p = params
            if s.fixed and slots is not None:
                leased.add(s.name)
                p.plans = []  # recount the members at the next request
                slots.attach(p, s.total or s.fixed)
            elif s.fixed:
                p.lease = None
                p.resize(s.fixed, now)
        if slots is not None:
            slots.keep(leased)
        else:
            for p in self.pools.values():
                p.lease = None
        for n in [n for n, p in self.pools.items() if n not in names]:
            if not self.pools[n].q.waiting and not self.pools[n].q.busy:
                del self.pools[n]

    def state(self) -> dict[str, Any]:
        return {"pools": [p.state() for p in self.pools.values()]}


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


ADMISSION: Final = ServiceKey[AdmissionBook]("admission")


def admission_for(services: Services) -> AdmissionBook:
    return services.get(ADMISSION, lambda: AdmissionBook(services))
