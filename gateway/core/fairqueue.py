"""(compiled) The fair admission queue of one backend pool: who gets the next free slot. Pure:
callers pass `now`; the waiting (futures, timers, disconnects) is the edge's
(`gateway.filters.admission`).

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

Two optional departures from a work-conserving queue (both off by default):

- **Anticipation** (`anticipate_s`): a closed-loop client (a chat stream, an agent) sends its
  next request a few milliseconds after its last one ends, so a tenant below its share looks
  idle exactly when its slot frees, and a work-conserving queue hands that slot to a waiter of
  a heavier tenant (or a lower class) for a whole generation: the "deceptive idleness" of
  Iyer and Druschel's anticipatory scheduling (SOSP 2001). When the request that ends leaves
  its tenant with nobody waiting, while others wait that the fair order would put behind it
  (a lower class, or a larger counter in its class), the slot is held for that tenant for
  `anticipate_s`: its next request takes it at once; else the hold expires (`expire`) and the
  slot goes to the queue. A tenant is presumed to come back until a hold for it expires unused;
  then it is not held for until one of its requests arrives within `anticipate_s` of the end of
  another. The price is a slot idle for at most `anticipate_s` per hold not used: at most one
  per tenant record, then one per change of its habit.
- **Reserved slots** (`reserve_share`, `reserve_rank`): ceil(share × capacity) of the slots
  only a class at or above `reserve_rank` may take (a lower class is dispatched only while
  fewer than capacity − reserved slots are busy), so that an arrival of a high class finds a
  slot free; the price is those slots left idle while the high classes ask for less.

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
import math
from collections import deque

from gateway.core.fairrecords import (
    DEADLINE_UNREACHABLE,
    DISPATCHED,
    EWMA,
    GONE,
    INF,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    SHED,
    WAITING,
    ClassQueue,
    QueueParams,
    Tenant,
    Waiter,
)

__all__ = ["DEADLINE_UNREACHABLE", "DISPATCHED", "GONE", "QUEUE_FULL", "QUEUE_TIMEOUT", "SHED",
           "WAITING", "ClassQueue", "FairQueue", "QueueParams", "Tenant", "Waiter"]  # fmt: skip


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
        self.holds: list[tuple[float, Tenant]] = []  # (until, tenant): slots held, counted busy

    def room(self, cls: int) -> int:
        """The slots class `cls` may fill: all of them, or those not reserved for the classes
        at or above `reserve_rank`."""
        share = self.p.reserve_share
        if share <= 0.0 or cls <= self.p.reserve_rank:
            return self.capacity
        return self.capacity - min(self.capacity, math.ceil(share * self.capacity - 1e-9))

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
        if now - t.last_end <= self.p.anticipate_s:
            t.quick = True
        if t.held:  # its slot was held for it: taken at once
            t.quick = True
            self._release(t)
            w = Waiter(t, cls, now, deadline)
            self._dispatch(w, self.classes[cls], now)
            return w, None
        room = self.room(cls) if self.p.reserve_share else self.capacity
        if self.busy < room and (self.waiting == 0 or self._clear(cls)):
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

    def _clear(self, cls: int) -> bool:
        """Nobody of class `cls` or above waits (they would go first)."""
        return not any(self.classes[c].waiting for c in self.order if c <= cls)

    def _floor(self, cq: ClassQueue) -> float:
        """The smallest counter of the active tenants of a class (stale entries dropped), or
        the last dispatched one's when none is active."""
        heap = cq.heap
        while heap:
            vt, _, ver, top = heap[0]
            if ver == top.ver and top.live > 0:
                return vt
            heapq.heappop(heap)
        return cq.last_vt

    def _activate(self, t: Tenant, cq: ClassQueue) -> None:
        """`t` gets its first waiter: lifted to the smallest counter of the active tenants."""
        floor = self._floor(cq)
        heap = cq.heap
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
            if self.p.reserve_share and self.busy >= self.room(c):
                return None  # the free slots are reserved for higher classes
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
        # Every dispatch, the uncontended ones too: a tenant served alone sets the floor a newcomer
        # starts from (it was not there to be served, it has no credit to spend).
        cq.last_vt = t.vt
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
        if cost != w.charged:
            t.vt += (cost - w.charged) / t.weight
            t.ver += 1
            if t.live > 0:
                self.seq += 1
                heapq.heappush(self.classes[w.cls].heap, (t.vt, self.seq, t.ver, t))
        if not served:
            self.busy -= 1
            return self.dispatchable(now)
        if self._anticipates(w):
            t.held += 1  # the slot stays busy, held for t's next request
            self.holds.append((now + self.p.anticipate_s, t))
        else:
            self.busy -= 1
        t.served += cost
        t.last_end = now
        t.avg_cost = cost if t.avg_cost == 0.0 else t.avg_cost + EWMA * (cost - t.avg_cost)
        hold = now - w.dispatched
        self.hold_s = hold if self.hold_s == 0.0 else self.hold_s + EWMA * (hold - self.hold_s)
        if ttft is not None and ttft >= 0.0:
            self.ttft_s = ttft if self.ttft_s == 0.0 else self.ttft_s + EWMA * (ttft - self.ttft_s)
        return self.dispatchable(now)

    def charge(self, cls: int, key: str, cost: float) -> None:
        """Tokens tenant `key` of class `cls` was served elsewhere (another replica of the
        fleet): its counter grows as if served here, so a tenant spreading its requests over
        replicas is charged once. Its share of `served` here is not touched."""
        cq = self.classes.get(cls)
        if cq is None or cost <= 0.0:
            return
        t = cq.tenants.get(key)
        if t is None:
            return
        t.vt += cost / t.weight
        t.ver += 1
        if t.live > 0:
            self.seq += 1
            heapq.heappush(cq.heap, (t.vt, self.seq, t.ver, t))

    # -- anticipation ---------------------------------------------------------------------------
    def _anticipates(self, w: Waiter) -> bool:
        """Hold the slot `w` frees for its tenant: it has nobody waiting, and the waiter that
        would take the slot comes after it in the fair order (a lower class, or a larger
        counter in its class: lifted on its return, the tenant would win)."""
        t = w.tenant
        if not t.quick or t.live or not self.waiting or self.p.anticipate_s <= 0.0:
            return False
        for c in self.order:
            cq = self.classes[c]
            if cq.waiting:
                return c > w.cls if c != w.cls else t.vt <= self._floor(cq)
        return False  # pragma: no cover - waiting > 0 means some class has a waiter

    def _release(self, t: Tenant) -> None:
        """One slot held for `t` is given up (taken by its request, or expired)."""
        for i, (_, held) in enumerate(self.holds):
            if held is t:
                del self.holds[i]
                break
        t.held -= 1
        self.busy -= 1

    def next_expiry(self) -> float | None:
        """When the earliest hold expires (the edge's timer calls `expire` then), or None."""
        return min(u for u, _ in self.holds) if self.holds else None

    def expire(self, now: float) -> list[Waiter]:
        """Holds whose time passed give their slots to the queue: the waiters that take them."""
        if any(u <= now for u, _ in self.holds):
            for _, t in [h for h in self.holds if h[0] <= now]:
                t.held -= 1
                t.quick = False  # it did not come back in time: no hold until it does
                self.busy -= 1
            self.holds = [h for h in self.holds if h[0] > now]
        return self.dispatchable(now)


def _prune(cq: ClassQueue, bound: int) -> None:
    """Drop idle tenant records (no waiter, nothing in flight), oldest first, to a tenth below
    the bound; active ones are never dropped (the bound can then be passed, by the waiters)."""
    target = bound - max(1, bound // 10)
    for key in [k for k, t in cq.tenants.items() if not (t.live or t.in_flight or t.held)]:
        if len(cq.tenants) <= target:
            return
        del cq.tenants[key]
