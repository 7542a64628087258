"""One backend member's live state (in-flight count, load, breaker, outlier, health) and one
upstream try against it (`Attempt`), with the rule that turns a try's end into a result.

Plain objects owned by `gateway.registry.pool.BackendState`; the decisions they hold are the
pure ones of `gateway.core` (breaker, outlier, health).
"""

from __future__ import annotations

import asyncio
import enum
import math
from typing import TYPE_CHECKING, Any

from gateway.core.balancer import hash_key
from gateway.core.breaker import Breaker, State
from gateway.core.health import HealthState
from gateway.core.outcome import Outcome
from gateway.core.outlier import Outlier
from gateway.core.verdict import GRPC_DEADLINE_EXCEEDED

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint

# gRPC codes that blame the backend (the others are answers about the request).
GRPC_FAILURES = frozenset({2, 4, 13, 14, 15})  # UNKNOWN DEADLINE INTERNAL UNAVAILABLE DATA_LOSS
_BLAMES_BACKEND = frozenset(
    {Outcome.UPSTREAM_CONNECT, Outcome.UPSTREAM_TIMEOUT, Outcome.UPSTREAM_PROTOCOL}
)


class Result(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # the backend is to blame
    IGNORED = "ignored"  # says nothing about the backend (client gone, refused before, ...)


def classify(outcome: Outcome, http_status: int, grpc_status: int | None) -> Result:
    """What one try's end says about the member."""
    if outcome is Outcome.OK:
        if grpc_status is not None:
            return Result.FAILED if grpc_status in GRPC_FAILURES else Result.OK
        return Result.FAILED if http_status >= 500 else Result.OK
    if outcome in _BLAMES_BACKEND:
        return Result.FAILED
    if outcome is Outcome.UPSTREAM_ERROR:
        if grpc_status is not None and grpc_status not in GRPC_FAILURES:
            return Result.OK  # e.g. INVALID_ARGUMENT: the backend answered about the request
        return Result.FAILED
    return Result.IGNORED


def timed_out(outcome: Outcome, grpc_status: int | None) -> bool:
    return outcome is Outcome.UPSTREAM_TIMEOUT or grpc_status == GRPC_DEADLINE_EXCEEDED


class Member:
    """A backend instance in a pool. `source` is "static" (the policy) or "registry"."""

    __slots__ = (
        "backend", "endpoint", "address", "weight", "priority", "source", "in_flight", "load",
        "version", "hash_key", "breaker", "outlier", "health", "fresh_until", "seen_ts",
        "checker", "poke", "probes", "requests", "failures", "timeouts", "sid",
    )  # fmt: skip

    def __init__(self, backend: str, endpoint: Endpoint, source: str) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.address = endpoint.address
        self.weight = float(endpoint.weight)
        self.priority = endpoint.priority
        self.source = source
        self.in_flight = 0
        self.load = 0.0  # heartbeat load 0-100
        self.version = ""  # heartbeat `ver`
        self.sid = ""  # heartbeat `sid`
        self.hash_key = hash_key(self.address)
        self.breaker: Breaker | None = None
        self.outlier: Outlier | None = None
        self.health: HealthState | None = None
        self.fresh_until = math.inf  # registry members: until when the last heartbeat counts
        self.seen_ts = -1  # registry members: the heartbeat `ts` last read
        self.checker: asyncio.Task[Any] | None = None  # active health check loop
        self.poke: asyncio.Event | None = None  # set: check now (passive health)
        self.probes: dict[int, Attempt] = {}  # half-open probe ticket → its attempt
        self.requests = 0
        self.failures = 0
        self.timeouts = 0

    def set_endpoint(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.weight = float(endpoint.weight)
        self.priority = endpoint.priority

    def breaker_state(self) -> State:
        return State.CLOSED if self.breaker is None else self.breaker.state

    def snapshot(self, now: float) -> dict[str, object]:
        out: dict[str, object] = {
            "address": self.address,
            "source": self.source,
            "weight": self.weight,
            "priority": self.priority,
            "in_flight": self.in_flight,
            "load": round(self.load / 100.0, 3),  # heartbeat load as a fraction (status page)
            "requests": self.requests,
            "failures": self.failures,
            "timeouts": self.timeouts,
        }
        if self.source == "registry":
            out["sid"] = self.sid
            out["version"] = self.version
            out["heartbeat_fresh_for_s"] = (
                None if self.fresh_until == math.inf else round(self.fresh_until - now, 3)
            )
        if self.breaker is not None:
            out["breaker"] = self.breaker.snapshot(now)
        if self.outlier is not None:
            out["outlier"] = self.outlier.snapshot(now)
        if self.health is not None:
            out["health"] = self.health.snapshot()
        return out


class Attempt:
    """One upstream try: which member, the breaker's ticket, when it started. `ctx` is kept
    only for half-open probes (their first byte is looked at while the stream still runs)."""

    __slots__ = (
        "member", "ticket", "started", "retry", "reported", "done", "group", "tried", "ctx",
        "picker",
    )  # fmt: skip

    def __init__(
        self, picker: Any, member: Member, ticket: int, started: float, group: int
    ) -> None:
        self.picker = picker  # the route's picker (gateway.filters.routing.RoutePicker)
        self.member = member
        self.ticket = ticket
        self.started = started
        self.retry = False  # holds a retry-budget slot
        self.reported = False  # its result reached the breaker already
        self.done = False  # finished: counted once, whoever finished it
        self.group = group  # index of the backend in the route's split
        self.tried: tuple[Member, ...] = ()  # members earlier tries of the request used
        self.ctx: Any = None
