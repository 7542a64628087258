"""The fair admission queue of one backend pool: who gets the next free slot. Pure: callers pass
`now`; the waiting (futures, timers, disconnects) is the edge's (`gateway.filters.admission`).

Order of dispatch, when a slot frees:

1. **Strict priority between classes**: the highest class (0 = highest) with a waiting request.
2. **Fairness inside a class**: the tenant with the smallest virtual token counter ÷ weight (the
   virtual token counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024,
   as AIBrix's vtc-basic uses it). A dispatch charges the tenant its average cost so far (the
   tokens of a request are known only when it ends); `finish` reconciles the charge with the
   tokens actually served (prompt × input + generated × output, the policy's `cost`). A tenant
   that becomes active (its first waiting request) is lifted to the smallest counter of the
   active tenants of its class (to the last dispatched one's when none is active), so that it
   cannot bank credit while idle; being lifted, it wins the tie with them (it was served less).
3. **Inside a tenant**: earliest deadline first, then FIFO for requests without one.

Bounds: `max_queued` waiting requests; beyond it the lowest class is refused first (a request of
a higher class takes the place of the newest waiter of the lowest class, which is refused
`queue_full`); at most `max_tenants` tenant records per class (idle ones are dropped first).
A waiter that left (client gone, timed out, shed) is marked and skipped lazily, so `leave` is
O(1); the heaps are rebuilt when their dead entries outnumber the live ones.

Deadline reachability: a request whose deadline is before `now` + the expected wait for a slot
(the requests ahead of it × the mean slot hold time ÷ capacity) + the pool's recent time to first
token is refused at once (`deadline_unreachable`, the SCORPIO paper's TTFT guard). The requests
ahead of it are every waiter of a higher class and, in its own class, one turn of each active
tenant per waiter of its own tenant ahead of it and for itself (the fair order serves the
others' turns between its own), at most all of the class's waiters.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
DEADLINE_UNREACHABLE = "deadline_unreachable"
SHED = "shed"

WAITING, DISPATCHED, GONE = 0, 1, 2
INF = float("inf")
EWMA = 0.2  # weight of one sample in the smoothed hold time, time to first token and cost


@dataclass(frozen=True, slots=True)
class QueueParams:
    max_queued: int = 2000
    max_wait_s: float = 5.0
    max_tenants: int = 10_000  # tenant records kept per class
    initial_cost: float = 256.0  # charged at dispatch before a tenant's first reported cost


class Waiter:
    """One request, from its arrival to its finish (`state`: WAITING, DISPATCHED, GONE)."""

    __slots__ = ("tenant", "cls", "deadline", "expires", "arrived", "seq", "state", "charged",
                 "dispatched", "handle")  # fmt: skip

    def __init__(self, tenant: Tenant, cls: int, arrived: float, deadline: float | None) -> None:
        self.tenant = tenant
        self.cls = cls
        self.arrived = arrived
        self.deadline = deadline  # absolute (the clock's time), None: none
        self.expires = 0.0  # when it stops waiting (max wait or deadline, the earlier)
        self.seq = 0
        self.state = WAITING
        self.charged = 0.0  # tokens charged at dispatch, reconciled by `finish`
        self.dispatched = 0.0
        self.handle: object = None  # the edge's (a future); the core never looks at it


class Tenant:
    """One tenant in one class: its counter, its waiters (EDF, then FIFO)."""

    __slots__ = ("key", "weight", "vt", "ver", "heap", "live", "in_flight", "avg_cost", "served")

    def __init__(self, key: str, weight: float, vt: float) -> None:
        self.key = key
        self.weight = weight
        self.vt = vt  # virtual counter ÷ weight (tokens)
        self.ver = 0  # bumped when vt changes: older entries in the class heap are stale
        self.heap: list[tuple[float, int, Waiter]] = []
        self.live = 0  # waiters still waiting
        self.in_flight = 0
        self.avg_cost = 0.0  # smoothed tokens per request (0: none reported yet)
        self.served = 0.0  # tokens served (for shares)


class ClassQueue:
    __slots__ = ("tenants", "heap", "waiting", "active", "last_vt", "arrivals")

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.heap: list[tuple[float, int, int, Tenant]] = []  # (vt, seq, ver, tenant)
        self.waiting = 0
        self.active = 0  # tenants with a waiter
        self.last_vt = 0.0  # the counter of the tenant dispatched last
        self.arrivals: deque[Waiter] = deque()  # arrival order, for refusing from the tail


class FairQueue:
    """Slots (`capacity`, `busy`) and the waiters of one pool."""

    def __init__(self, p: QueueParams, capacity: int) -> None:
        self.p = p
        self.capacity = capacity
        self.busy = 0
        self.waiting = 0
        self.classes: dict[int, ClassQueue] = {}
        self.order: list[int] = []  # class numbers, highest first
        self.seq = 0
        self.hold_s = 0.0  # smoothed slot hold time (dispatch to finish); 0: none yet
        self.ttft_s = 0.0  # smoothed time to first token after dispatch; 0: none yet

    # -- arrival ------------------------------------------------------------------------------
    def tenant(self, key: str, cls: int, weight: float = 1.0) -> Tenant:
        cq = self.classes.get(cls)
        if cq is None:
            cq = self.classes[cls] = ClassQueue()
            self.order = sorted(self.classes)
        t = cq.tenants.get(key)
        if t is None:
            if len(cq.tenants) >= self.p.max_tenants:
                _prune(cq, self.p.max_tenants)
            t = cq.tenants[key] = Tenant(key, weight, cq.last_vt)
        else:
            t.weight = weight
        return t

    def arrive(
        self, t: Tenant, cls: int, now: float, deadline: float | None = None
    ) -> tuple[Waiter | str, Waiter | None]:
        """A request of tenant `t` (from `tenant(key, cls, weight)`) arrives. Returns
        (the waiter, DISPATCHED at once or WAITING; or the refusal reason) and a waiter of a
        lower class refused to make room for it (`queue_full`), if any."""
        if self.busy < self.capacity and self.waiting == 0:
            w = Waiter(t, cls, now, deadline)  # the uncontended path
            self._dispatch(w, self.classes[cls], now)
            return w, None
        if deadline is not None and not self.reachable(t, cls, now, deadline):
            return DEADLINE_UNREACHABLE, None
        evicted = None
        if self.waiting >= self.p.max_queued:
            lowest = next(c for c in reversed(self.order) if self.classes[c].waiting)
            if lowest <= cls:
                return QUEUE_FULL, None
            evicted = self._evict(self.classes[lowest])
        w = Waiter(t, cls, now, deadline)
        w.expires = now + self.p.max_wait_s
        if deadline is not None and deadline < w.expires:
            w.expires = deadline
        self.seq += 1
        w.seq = self.seq
        cq = self.classes[cls]
        if t.live == 0:
            self._activate(t, cq)
        heapq.heappush(t.heap, (INF if deadline is None else deadline, w.seq, w))
        t.live += 1
        cq.waiting += 1
        self.waiting += 1
        cq.arrivals.append(w)
        return w, evicted

    def reachable(self, t: Tenant, cls: int, now: float, deadline: float) -> bool:
        if self.busy < self.capacity and self.waiting == 0:
            return now + self.ttft_s <= deadline
        ahead = 0
        for c in self.order:
            cq = self.classes[c]
            if c < cls:
                ahead += cq.waiting
            elif c == cls:
                ahead += min(cq.waiting, (t.live + 1) * max(cq.active, 1))
                break
        wait = (ahead + 1) * self.hold_s / max(self.capacity, 1)
        return now + wait + self.ttft_s <= deadline

    def _activate(self, t: Tenant, cq: ClassQueue) -> None:
        """`t` gets its first waiter: lifted to the smallest counter of the active tenants."""
        floor = cq.last_vt
        heap = cq.heap
        while heap:
            vt, _, ver, top = heap[0]
            if ver == top.ver and top.live > 0:
                floor = vt
                break
            heapq.heappop(heap)
        self.seq += 1
        seq = self.seq
        if t.vt < floor:
            # Lifted: it was served less than the active ones, so it wins the tie with them.
            t.vt = floor
            seq = -seq
        t.ver += 1  # entries from an earlier activity are stale
        heapq.heappush(heap, (t.vt, seq, t.ver, t))
        cq.active += 1

    # -- dispatch -----------------------------------------------------------------------------
    def next(self, now: float) -> Waiter | None:
        """The dispatch decision for one free slot: the waiter that takes it (DISPATCHED), or
        None when nobody waits or no slot is free."""
        if self.busy >= self.capacity or self.waiting == 0:
            return None
        for c in self.order:
            cq = self.classes[c]
            if cq.waiting == 0:
                continue
            heap = cq.heap
            while True:
                _, _, ver, t = heapq.heappop(heap)
                if ver == t.ver and t.live > 0:
                    break
            _, _, w = heapq.heappop(t.heap)
            while w.state != WAITING:
                _, _, w = heapq.heappop(t.heap)
            t.live -= 1
            cq.waiting -= 1
            self.waiting -= 1
            cq.last_vt = t.vt
            self._dispatch(w, cq, now)
            if t.live > 0:
                self.seq += 1
                heapq.heappush(heap, (t.vt, self.seq, t.ver, t))
            else:
                cq.active -= 1
                t.heap.clear()
            if len(cq.arrivals) > 2 * cq.waiting + 64:
                cq.arrivals = deque(x for x in cq.arrivals if x.state == WAITING)
            return w
        return None  # pragma: no cover - waiting > 0 means some class has a waiter

    def _dispatch(self, w: Waiter, cq: ClassQueue, now: float) -> None:
        t = w.tenant
        w.state = DISPATCHED
        w.dispatched = now
        cost = t.avg_cost or self.p.initial_cost
        w.charged = cost
        t.vt += cost / t.weight
        t.ver += 1
        t.in_flight += 1
        self.busy += 1

    def dispatchable(self, now: float) -> list[Waiter]:
        """Every waiter that can take a free slot now (after `finish` or a larger capacity)."""
        out: list[Waiter] = []
        while True:
            w = self.next(now)
            if w is None:
                return out
            out.append(w)

    def set_capacity(self, capacity: int, now: float) -> list[Waiter]:
        self.capacity = capacity
        return self.dispatchable(now)

    # -- leaving ------------------------------------------------------------------------------
    def leave(self, w: Waiter) -> None:
        """A waiter stops waiting (its client left, it timed out): its place is given up."""
        if w.state != WAITING:
            return
        w.state = GONE
        t = w.tenant
        cq = self.classes[w.cls]
        t.live -= 1
        cq.waiting -= 1
        self.waiting -= 1
        if t.live == 0:
            cq.active -= 1
            t.heap.clear()
        elif len(t.heap) > 2 * t.live + 16:
            t.heap = [e for e in t.heap if e[2].state == WAITING]
            heapq.heapify(t.heap)
        if len(cq.heap) > 2 * cq.active + 64:
            cq.heap = [e for e in cq.heap if e[2] == e[3].ver and e[3].live > 0]
            heapq.heapify(cq.heap)
        if len(cq.arrivals) > 2 * cq.waiting + 64:
            cq.arrivals = deque(x for x in cq.arrivals if x.state == WAITING)

    def _evict(self, cq: ClassQueue) -> Waiter:
        while True:
            w = cq.arrivals.pop()
            if w.state == WAITING:
                self.leave(w)
                return w

    def shed(self, keep: int) -> list[Waiter]:
        """Refuse every waiter of a class below `keep` (a number above it), newest first: an
        overload colour sheds the queue's tail."""
        out: list[Waiter] = []
        for c in reversed(self.order):
            if c <= keep:
                break
            cq = self.classes[c]
            while cq.waiting:
                out.append(self._evict(cq))
        return out

    # -- finish -------------------------------------------------------------------------------
    def finish(
        self, w: Waiter, now: float, cost: float, ttft: float | None = None, served: bool = True
    ) -> list[Waiter]:
        """A dispatched request ended: its slot is free, its tenant's counter reconciled with
        the `cost` it was served (tokens × the policy's weights); returns the waiters that take
        the free slots. `served` False: it never reached the backend (refused later, client
        gone): its charge is refunded and it teaches nothing about hold times."""
        if w.state != DISPATCHED:
            return []
        if not served:
            cost, ttft = 0.0, None
        w.state = GONE
        t = w.tenant
        t.in_flight -= 1
        self.busy -= 1
        if cost != w.charged:
            t.vt += (cost - w.charged) / t.weight
            t.ver += 1
            if t.live > 0:
                self.seq += 1
                heapq.heappush(self.classes[w.cls].heap, (t.vt, self.seq, t.ver, t))
        if not served:
            return self.dispatchable(now)
        t.served += cost
        t.avg_cost = cost if t.avg_cost == 0.0 else t.avg_cost + EWMA * (cost - t.avg_cost)
        hold = now - w.dispatched
        self.hold_s = hold if self.hold_s == 0.0 else self.hold_s + EWMA * (hold - self.hold_s)
        if ttft is not None and ttft >= 0.0:
            self.ttft_s = ttft if self.ttft_s == 0.0 else self.ttft_s + EWMA * (ttft - self.ttft_s)
        return self.dispatchable(now)


def _prune(cq: ClassQueue, bound: int) -> None:
    """Drop idle tenant records (no waiter, nothing in flight), oldest first, to a tenth below
    the bound; active ones are never dropped (the bound can then be passed, by the waiters)."""
    target = bound - max(1, bound // 10)
    for key in [k for k, t in cq.tenants.items() if t.live == 0 and t.in_flight == 0]:
        if len(cq.tenants) <= target:
            return
        del cq.tenants[key]
