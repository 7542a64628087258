"""(compiled) Backend member state, split by what it depends on, and one upstream try (`Attempt`).

- `Core` (per backend and address): requests in flight, heartbeat load, counters. Every policy
  that names the member sees the same one, so a reload (or both sides of a staged rollout) see
  the requests still running.
- `BreakerBox` (per backend, address and breaker parameters), `Outlier` (per outlier
  parameters), `HealthBox` (per health-check settings, with its check loop): unchanged
  parameters find the state where it was; changed ones start fresh.
- `Member`: one policy's view of a member (its weight and priority from that policy) over those.
- `MemberBooks`: where that state is kept, as the views, health checks and registry pollers
  reach it (`gateway.registry.pool.BackendPool` keeps it).

Also the rule that turns a try's end into a result for breakers and outlier detection.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from gateway.core.balancer import hash_key
from gateway.core.breaker import Breaker, State
from gateway.core.health import HealthState
from gateway.core.outcome import Outcome
from gateway.core.outlier import Outlier, OutlierParams
from gateway.core.verdict import GRPC_DEADLINE_EXCEEDED

if TYPE_CHECKING:
    from gateway.core.breaker import BreakerParams
    from gateway.core.health import HealthParams
    from gateway.core.placement import PrefixBook
    from gateway.core.serverload import Figures
    from gateway.policy.compiled import Endpoint
    from gateway.policy.model import HealthCheck
    from gateway.services import Services

# gRPC codes that blame the backend (the others are answers about the request): UNKNOWN,
# DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE, DATA_LOSS.
GRPC_FAILURES: Final = frozenset({2, 4, 13, 14, 15})
_BLAMES_BACKEND: Final = frozenset(
    {
        Outcome.UPSTREAM_CONNECT,
        Outcome.UPSTREAM_TLS,
        Outcome.UPSTREAM_TIMEOUT,
        Outcome.UPSTREAM_PROTOCOL,
    }
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


class Core:
    """What every policy shares about one member of a backend."""

    __slots__ = (
        "backend", "address", "in_flight", "load", "avg", "avg_at", "version", "sid", "requests",
        "failures", "timeouts", "server", "figures", "scrape",
    )  # fmt: skip

    def __init__(self, backend: str, address: str) -> None:
        self.backend = backend
        self.address = address
        self.in_flight = 0
        self.load = 0.0  # heartbeat load 0-100 (0 for static members)
        self.avg = 0.0  # in flight + load / 10, averaged over time (gateway.core.placement)
        self.avg_at = -1.0  # when `avg` was last brought up to date (< 0: never)
        self.version = ""  # heartbeat `ver`
        self.sid = ""  # heartbeat `sid`
        self.requests = 0
        self.failures = 0
        self.timeouts = 0
        # What the member's model server says (`load.metrics`, gateway.registry.scrape): the
        # requests in flight its figures add to `in_flight` in the pick (0 when stale or off),
        # the last figures read, and the scraper's own record (shown in /admin/state).
        self.server = 0.0
        self.figures: Figures | None = None
        self.scrape: Any = None


class BreakerBox:
    """A member's breaker and its half-open probes still running (ticket → attempt)."""

    __slots__ = ("breaker", "probes")

    def __init__(self, breaker: Breaker) -> None:
        self.breaker = breaker
        self.probes: dict[int, Attempt] = {}


class HealthBox:
    """A member's active-check verdict and the loop that checks it."""

    __slots__ = (
        "state", "checker", "poke", "host", "port", "protocol", "check", "backend", "tls",
    )  # fmt: skip

    def __init__(self, state: HealthState, ep: Endpoint, check: HealthCheck) -> None:
        self.state = state
        self.checker: asyncio.Task[Any] | None = None
        self.poke: asyncio.Event | None = None  # set: check now (passive health)
        self.host, self.port, self.protocol = ep.host, ep.port, ep.protocol
        self.backend = ep.backend
        self.tls = ep.tls  # built at policy load (the pool keys boxes by it)
        self.check = check

    def stop(self) -> None:
        if self.checker is not None:
            self.checker.cancel()
            self.checker = None
            self.poke = None


class MemberBooks(Protocol):
    """The member state every policy shares, found by key and created on first use. `changed()`
    says some of it changed: each view rebuilds its plan at its next pick (`epoch` counts)."""

    @property
    def services(self) -> Services: ...

    @property
    def random(self) -> Callable[[], float]: ...

    @property
    def epoch(self) -> int: ...

    def changed(self) -> None: ...

    def core(self, backend: str, address: str) -> Core: ...

    def box(self, backend: str, address: str, p: BreakerParams) -> BreakerBox: ...

    def outlier(self, backend: str, address: str, p: OutlierParams) -> Outlier: ...

    def health(self, backend: str, ep: Endpoint, p: HealthParams, check: Any) -> HealthBox: ...

    def prefixes(self, backend: str) -> PrefixBook: ...


class Member:
    """One policy's view of a member: its endpoint (weight, priority) over the shared state.
    The balancer reads `weight`, `hash_key` and `core.in_flight` / `core.load`."""

    __slots__ = (
        "endpoint", "address", "weight", "priority", "source", "core", "box", "breaker",
        "outlier", "hbox", "hash_key",
    )  # fmt: skip

    def __init__(
        self,
        endpoint: Endpoint,
        source: str,
        core: Core,
        box: BreakerBox | None,
        outlier: Outlier | None,
        hbox: HealthBox | None,
    ) -> None:
        self.endpoint = endpoint
        self.address = endpoint.address
        self.weight = float(endpoint.weight)
        self.priority = endpoint.priority
        self.source = source  # "static" (the policy), "registry" (heartbeats) or "dns"
        self.core = core
        self.box = box
        self.breaker = box.breaker if box is not None else None
        self.outlier = outlier
        self.hbox = hbox
        self.hash_key = hash_key(self.address)

    @property
    def health(self) -> HealthState | None:
        return self.hbox.state if self.hbox is not None else None

    def breaker_state(self) -> State:
        return State.CLOSED if self.breaker is None else self.breaker.state

    def snapshot(self, now: float, fresh_for: float | None) -> dict[str, object]:
        c = self.core
        out: dict[str, object] = {
            "address": self.address,
            "source": self.source,
            "weight": self.weight,
            "priority": self.priority,
            "in_flight": c.in_flight,
            "load": round(c.load / 100.0, 3),  # heartbeat load as a fraction (status page)
            "requests": c.requests,
            "failures": c.failures,
            "timeouts": c.timeouts,
        }
        if c.scrape is not None:
            out["server"] = c.scrape.snapshot_of(c, now)
        if self.source == "registry":
            out["sid"] = c.sid
            out["version"] = c.version
            out["heartbeat_fresh_for_s"] = fresh_for
        if self.breaker is not None:
            out["breaker"] = self.breaker.snapshot(now)
        if self.outlier is not None:
            out["outlier"] = self.outlier.snapshot(now)
        if self.hbox is not None:
            out["health"] = self.hbox.state.snapshot()
        return out


class Attempt:
    """One upstream try: which member, the breaker's ticket, when it started. `ctx` is kept
    only for half-open probes (their first byte is looked at while the stream still runs)."""

    __slots__ = (
        "member", "ticket", "started", "retry", "reported", "done", "group", "tried", "ctx",
        "picker", "choice",
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
        self.choice: Any = None  # a body-routed request's model and prefix (routing.Choice)

    def next_try(self, ctx: Any) -> Endpoint | None:
        """After this try failed (`ctx.outcome`, `ctx.http_status`, `ctx.grpc_status`,
        `ctx.first_byte_at` describe it; a byte that reached the client is never retried): the
        endpoint of the next try, or None (not safe to retry, tries or the route's retry budget
        used up, no other member). The route's picker reports this try first; on success
        `ctx.endpoint` and `ctx.upstream_attempt` are the new try's and the outcome fields are
        reset for it. The caller counts `ctx.attempts` (`begin_try`) and applies the per-try
        timeout (`ctx.route.retries.per_try_timeout_s`)."""
        endpoint: Endpoint | None = self.picker.retry_pick(ctx, self)
        return endpoint
