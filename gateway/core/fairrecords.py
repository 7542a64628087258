"""(compiled) The records of the fair admission queue (`gateway.core.fairqueue`): its parameters,
one waiting request, one tenant of a class, one class. Plain data, no decisions."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
DEADLINE_UNREACHABLE = "deadline_unreachable"
SHED = "shed"

WAITING, DISPATCHED, GONE = 0, 1, 2
INF: Final = float("inf")
EWMA = 0.2  # weight of one sample in the smoothed hold time, time to first token and cost


@dataclass(frozen=True, slots=True)
class QueueParams:
    max_queued: int = 2000
    max_wait_s: float = 5.0
    max_tenants: int = 10_000  # tenant records kept per class
    initial_cost: float = 256.0  # charged at dispatch before a tenant's first reported cost
    anticipate_s: float = 0.0  # a freed slot held for its tenant's next request (0: never)
    reserve_share: float = 0.0  # of the slots, only for classes up to reserve_rank (0: none)
    reserve_rank: int = 0


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

    __slots__ = ("key", "weight", "vt", "ver", "heap", "live", "in_flight", "avg_cost", "served",
                 "held", "last_end", "quick")  # fmt: skip

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
        self.held = 0  # slots held for its next request (anticipation)
        self.last_end = -INF  # when a request of it last ended
        self.quick = True  # presumed to come back: no hold of it expired unused since it did


class ClassQueue:
    __slots__ = ("tenants", "heap", "waiting", "active", "last_vt", "arrivals")

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.heap: list[tuple[float, int, int, Tenant]] = []  # (vt, seq, ver, tenant)
        self.waiting = 0
        self.active = 0  # tenants with a waiter
        self.last_vt = 0.0  # the counter of the tenant dispatched last
        self.arrivals: deque[Waiter] = deque()  # arrival order, for refusing from the tail
