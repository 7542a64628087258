"""The backends owner in the services (`services.get("backends", ...)`): every backend's members
and their live state, which outlive policy reloads.

Per backend (`BackendState`): its members (static ones from the policy, others from registry
heartbeats), each with an in-flight count, heartbeat load, breaker, outlier record and health;
the traffic plan the pure balancer (`gateway.core.balancer`) picks from, rebuilt only when a
member's state changes or a time-based change falls due (an open breaker's cool-down, a probe's
deadline, an ejection's end, a heartbeat going stale); and its background tasks (health checks,
registry polling). Per route (`RouteState`): the canary guard and the retry budget.

What a reload does (`apply`, when the new policy goes live):
- a member whose address stays keeps its in-flight count, breaker, outlier record and health;
  a changed weight or priority applies at once;
- a changed `breaker` section gives every member of that backend a fresh closed breaker with the
  new parameters (likewise `outlier` and `health`: reset, checks restarted); unchanged sections
  keep their state;
- a changed `discovery` section restarts the registry poller; the members it found stay until
  the new poller's first answer replaces them;
- a backend or member the policy no longer names is dropped (requests still running on it
  finish; their results are discarded);
- a route's canary guard is kept while the route's canary section and split weights stay the
  same, and re-armed (weight back) when either changes; its retry budget counters are kept.

During a staged policy rollout both policies share this state, configured by the candidate's
sections while it serves (it is activated last); a rollback or abort activates the stable
policy's chain again, which puts its sections (and members) back.
"""

from __future__ import annotations

import logging
import math
import random as _random
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from gateway.core.balancer import MemberStatus, Plan, build_plan, pick, pick_excluding, pick_sticky
from gateway.core.breaker import Breaker, BreakerParams, Change, State
from gateway.core.canary import CanaryGuard, CanaryParams
from gateway.core.health import HealthParams, HealthState
from gateway.core.outcome import Outcome
from gateway.core.outlier import Outlier, OutlierParams, max_ejected
from gateway.core.retry import RetryBudget
from gateway.policy.compiled import Endpoint, endpoint_of
from gateway.registry.member import Attempt, Member, Result, classify, timed_out
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.model import Backend, Canary
    from gateway.services import Services

log = logging.getLogger("sluice.backends")

LIVE_POOLS: weakref.WeakSet[BackendPool] = weakref.WeakSet()  # read by the metrics collector
EMPTY: Plan[Member] = build_plan([], 0.0)


def breaker_params(b: Backend) -> BreakerParams | None:
    c = b.breaker
    if c is None:
        return None
    return BreakerParams(
        consecutive_failures=c.consecutive_failures,
        error_ratio=c.error_ratio,
        slow_call_s=c.slow_call_s,
        slow_ratio=c.slow_ratio,
        min_requests=c.min_requests,
        window_s=c.window_s,
        open_s=c.open_s,
        max_open_s=c.max_open_s,
        half_open_probes=c.half_open_probes,
        probe_timeout_s=c.probe_timeout_s if c.probe_timeout_s is not None else c.slow_call_s,
    )


def outlier_params(b: Backend) -> OutlierParams | None:
    c = b.outlier
    if c is None:
        return None
    return OutlierParams(
        c.timeout_ratio, c.window_s, c.min_requests, c.max_ejected, c.ejection_s, c.max_ejection_s
    )


def health_params(b: Backend) -> HealthParams | None:
    c = b.health
    if c is None:
        return None
    return HealthParams(
        c.interval_s, c.failing_interval_s, c.jitter, c.timeout_s, c.unhealthy_after,
        c.healthy_after,
    )  # fmt: skip


class BackendState:
    """One backend's members and plan. See the module docstring for what a reload keeps."""

    def __init__(self, pool: BackendPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self.cfg: Backend | None = None
        self.members: dict[str, Member] = {}
        self._plan: Plan[Member] | None = None
        self._expires = 0.0
        self.panic = False
        self.bp: BreakerParams | None = None
        self.op: OutlierParams | None = None
        self.hp: HealthParams | None = None
        self.health_key: tuple[str, str, str] | None = None  # (protocol, path, grpc service)
        self.registry_up: bool | None = None  # None: no discovery
        self.registry_error = ""
        self.registry_polled_at: float | None = None
        self.watcher: Any = None  # the registry poller task

    # --- configuration -------------------------------------------------------------------------
    def configure(self, cfg: Backend) -> None:
        old = self.cfg
        self.cfg = cfg
        if old is not None and old.protocol != cfg.protocol:
            self.stop()
            self.members = {}
        bp, op, hp = breaker_params(cfg), outlier_params(cfg), health_params(cfg)
        hkey = None
        if cfg.health is not None:
            hkey = (cfg.protocol, cfg.health.path, cfg.health.grpc_service)
        reset_breaker = bp != self.bp
        reset_outlier = op != self.op
        reset_health = hp != self.hp or hkey != self.health_key
        self.bp, self.op, self.hp, self.health_key = bp, op, hp, hkey
        wanted = {e.address: e for e in cfg.endpoints}
        for address, e in wanted.items():
            ep = endpoint_of(cfg, address, e.weight, e.priority)
            m = self.members.get(address)
            if m is None:
                self.members[address] = self._new_member(ep, "static")
            else:
                m.source = "static"
                m.fresh_until = math.inf
                if m.endpoint != ep:
                    m.set_endpoint(ep)
        for address, m in list(self.members.items()):
            if m.source == "static" and address not in wanted:
                self._drop(m)
        if cfg.discovery is None:
            for m in [m for m in self.members.values() if m.source == "registry"]:
                self._drop(m)
            self.registry_up = None
        for m in self.members.values():
            if reset_breaker:
                m.breaker = self._breaker()
                m.probes = {}
            if reset_outlier:
                m.outlier = Outlier(op) if op is not None else None
            if reset_health:
                self._stop_checker(m)
                m.health = HealthState(hp) if hp is not None else None
        old_discovery = None if old is None else old.discovery
        if old_discovery != cfg.discovery and self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        self.invalidate()

    def _breaker(self) -> Breaker | None:
        return Breaker(self.bp, self.pool.random) if self.bp is not None else None

    def _new_member(self, ep: Endpoint, source: str) -> Member:
        m = Member(self.name, ep, source)
        m.breaker = self._breaker()
        m.outlier = Outlier(self.op) if self.op is not None else None
        m.health = HealthState(self.hp) if self.hp is not None else None
        return m

    def _drop(self, m: Member) -> None:
        self._stop_checker(m)
        self.members.pop(m.address, None)
        m.probes = {}

    def _stop_checker(self, m: Member) -> None:
        if m.checker is not None:
            m.checker.cancel()
            m.checker = None
            m.poke = None

    def stop(self) -> None:
        for m in self.members.values():
            self._stop_checker(m)
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    def start(self, services: Services) -> None:
        """Start what runs in the background: health checks, the registry poller."""
        cfg = self.cfg
        if cfg is None:
            return
        if cfg.health is not None:
            from gateway.registry.health import start_checker

            for m in self.members.values():
                if m.checker is None:
                    start_checker(services, self, m)
        if cfg.discovery is not None and self.watcher is None:
            from gateway.registry.heartbeats import start_watcher

            self.watcher = start_watcher(services, self, cfg.discovery.registry)

    # --- registry ------------------------------------------------------------------------------
    def set_discovered(
        self, found: Iterable[tuple[str, str, float, str, bool]], now: float
    ) -> None:
        """A successful poll: (address, sid, load, version, heartbeat changed since last poll,
        or first seen and fresh). Members not found leave; static ones stay."""
        cfg = self.cfg
        assert cfg is not None and cfg.discovery is not None
        reg = cfg.discovery.registry
        seen: set[str] = set()
        started = self.pool.started
        for address, sid, load, version, fresh in found:
            seen.add(address)
            m = self.members.get(address)
            if m is None:
                ep = endpoint_of(cfg, address, reg.weight, reg.priority)
                m = self.members[address] = self._new_member(ep, "registry")
                m.fresh_until = now + reg.stale_after_s if fresh else now
                if started:
                    self.start(self.pool.services)
                self.invalidate()
            elif m.source == "registry" and (fresh or m.fresh_until == math.inf):
                # (inf: kept while Redis was down; judged again from now on)
                was = m.fresh_until
                m.fresh_until = now + reg.stale_after_s
                if was <= now:
                    self.invalidate()  # back from stale
            if m.source == "registry":
                m.sid, m.version = sid, version
                m.load = min(100.0, max(0.0, load))
        for address, m in list(self.members.items()):
            if m.source == "registry" and address not in seen:
                self._drop(m)
                self.invalidate()
        self.registry_up = True
        self.registry_error = ""
        self.registry_polled_at = now

    def registry_failed(self, error: str, now: float) -> None:
        """Redis unreachable: the last known members keep serving (their staleness is not
        judged while the registry cannot be read)."""
        if self.registry_up is not False:
            log.warning("backend %s: registry unreachable, keeping %d members: %s",
                        self.name, len(self.members), error)  # fmt: skip
        self.registry_up = False
        self.registry_error = error[:200]
        for m in self.members.values():
            if m.source == "registry" and m.fresh_until > now:
                m.fresh_until = math.inf  # live when Redis went away: keeps serving
        self.invalidate()

    # --- the plan ------------------------------------------------------------------------------
    def invalidate(self) -> None:
        self._plan = None

    def plan(self, now: float) -> Plan[Member]:
        p = self._plan
        if p is None or now >= self._expires:
            return self._rebuild(now)
        return p

    def _rebuild(self, now: float) -> Plan[Member]:
        cfg = self.cfg
        if cfg is None:
            return EMPTY
        statuses: list[MemberStatus[Member]] = []
        expires = math.inf
        for m in self.members.values():
            br = m.breaker
            closed = True
            probing = False
            if br is not None:
                if br.state is not State.CLOSED:
                    self._judge_probes(m, now)
                    change = br.tick(now)
                    if change is not None and change.new is not change.old:
                        self._breaker_changed(m, change)
                    expires = min(expires, br.next_deadline())
                closed = br.state is State.CLOSED
                probing = br.state is State.HALF_OPEN
            if m.fresh_until <= now:
                continue  # heartbeat stale: out of membership
            expires = min(expires, m.fresh_until)
            ejected = False
            if m.outlier is not None and m.outlier.ejected(now):
                ejected = True
                expires = min(expires, m.outlier.ejected_until)
            healthy = m.health is None or m.health.healthy
            statuses.append(
                MemberStatus(
                    m, m.priority, m.weight, healthy and not ejected and closed, closed, probing
                )
            )
        plan = build_plan(statuses, cfg.panic_threshold)
        panic = any(lv.panic for lv in plan.levels)
        if panic != self.panic:
            self.panic = panic
            log.warning("backend %s: %s panic mode (%d of %d members available)", self.name,
                        "in" if panic else "out of", plan.available, plan.members)  # fmt: skip
        self._plan, self._expires = plan, expires
        return plan

    def _judge_probes(self, m: Member, now: float) -> None:
        """Half-open probes whose first byte already went out are judged by it now (a stream
        may run for minutes after its first byte; the probe question is answered)."""
        br = m.breaker
        if br is None or not m.probes:
            return
        for ticket in br.pending_probes():
            a = m.probes.get(ticket)
            fb = None if a is None or a.ctx is None else a.ctx.first_byte_at
            if a is None or fb is None:
                continue
            a.reported = True
            a.ctx = None
            del m.probes[ticket]
            change = br.record(ticket, now, False, fb - a.started > br.p.slow_call_s)
            if change is not None:
                self._breaker_changed(m, change)
                return

    def _breaker_changed(self, m: Member, change: Change) -> None:
        self.invalidate()
        metrics.BREAKER_TRANSITIONS.labels(self.name, change.new.value).inc()
        if change.new is State.OPEN:
            log.warning("breaker open: backend=%s member=%s (%s)", self.name, m.address,
                        change.reason)  # fmt: skip
        else:
            log.info("breaker %s: backend=%s member=%s (%s)", change.new.value, self.name,
                     m.address, change.reason)  # fmt: skip
        if change.new is not State.HALF_OPEN:
            m.probes = {}

    # --- picking and results ----------------------------------------------------------------
    def take(
        self, now: float, key: int | None, exclude: Collection[Member] = ()
    ) -> tuple[Member, int] | None:
        """A member and its breaker ticket (probes of half-open members first), or None."""
        plan = self.plan(now)
        if plan.probing:
            for p in plan.probing:
                pb = p.breaker
                if pb is not None and p not in exclude and p.fresh_until > now:
                    t = pb.allow(now)
                    if t >= 0:
                        self.invalidate()  # the next pick plans with this probe's deadline
                        return p, t
        m: Member | None
        if exclude:
            if key is None:
                m = pick_excluding(plan, self.pool.random, exclude)
            else:
                m = pick_sticky(plan, key, exclude)
        elif key is None:
            m = pick(plan, self.pool.random)
        else:
            m = pick_sticky(plan, key)
        if m is None:
            return None
        br = m.breaker
        if br is None:
            return m, 0
        t = br.allow(now)
        if t < 0:  # its state moved since the plan was made
            self.invalidate()
            return None
        return m, t

    def report(
        self,
        a: Attempt,
        now: float,
        outcome: Outcome,
        http_status: int,
        grpc_status: int | None,
        first_byte_at: float | None,
    ) -> tuple[Result, float]:
        """One try's end: feed the breaker, the outlier record and passive health. Returns the
        result and the time to first byte (the whole try when no byte came)."""
        m = a.member
        m.in_flight -= 1
        if outcome is Outcome.OK and grpc_status is None and http_status < 500:
            res = Result.OK  # the common case, without a call
        else:
            res = classify(outcome, http_status, grpc_status)
        ttfb = (first_byte_at if first_byte_at is not None else now) - a.started
        if a.ctx is not None:
            a.ctx = None
            m.probes.pop(a.ticket, None)
        if res is Result.IGNORED:
            if m.breaker is not None and not a.reported:
                m.breaker.ignore(a.ticket)
            a.reported = True
            return res, ttfb
        m.requests += 1
        failed = res is Result.FAILED
        br = m.breaker
        if br is not None and not a.reported:
            change = br.record(a.ticket, now, failed, ttfb > br.p.slow_call_s)
            if change is not None:
                self._breaker_changed(m, change)
        a.reported = True
        if failed:
            m.failures += 1
            slow = timed_out(outcome, grpc_status)
            if slow:
                m.timeouts += 1
            if m.poke is not None:
                m.poke.set()  # passive health: check it now
            if m.outlier is not None and m.outlier.record(now, slow):
                self._try_eject(m, now)
        elif m.outlier is not None:
            m.outlier.record(now, False)
        return res, ttfb

    def _try_eject(self, m: Member, now: float) -> None:
        op = self.op
        assert op is not None and m.outlier is not None
        ejected = sum(1 for x in self.members.values() if x.outlier and x.outlier.ejected(now))
        if ejected >= max_ejected(op, len(self.members)):
            return
        until = m.outlier.eject(now)
        metrics.OUTLIER_EJECTIONS.labels(self.name).inc()
        log.warning("outlier ejected: backend=%s member=%s timeout ratio %.2f for %.0fs",
                    self.name, m.address, m.outlier.last_ratio, until - now)  # fmt: skip
        self.invalidate()

    def health_changed(self, m: Member) -> None:
        assert m.health is not None
        self.invalidate()
        log.warning("health: backend=%s member=%s %s%s", self.name, m.address,
                    "healthy" if m.health.healthy else "unhealthy",
                    f" ({m.health.last_error})" if not m.health.healthy else "")  # fmt: skip

    def state(self, now: float) -> dict[str, object]:
        plan = self.plan(now)
        out: dict[str, object] = {
            "protocol": self.cfg.protocol if self.cfg else None,
            "members": [m.snapshot(now) for m in self.members.values()],
            "in_rotation": plan.members,
            "available": plan.available,
            "panic": self.panic,
            "levels": [
                {
                    "priority": lv.priority,
                    "members": [m.address for m in lv.members],
                    "share": round(hi - lo, 4),
                    "panic": lv.panic,
                }
                for lv, lo, hi in zip(
                    plan.levels, (0.0, *plan.cum_load), plan.cum_load, strict=False
                )
            ],  # fmt: skip
        }
        if self.registry_up is not None:
            out["registry"] = {
                "up": self.registry_up,
                "error": self.registry_error,
                "polled_at": self.registry_polled_at,
            }
        return out


class RouteState:
    """A route's canary guard and retry budget (kept across reloads, see the module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.guard: CanaryGuard | None = None
        self.guard_key: object = None
        self.canary_backend = ""
        self.budget: RetryBudget | None = None
        self.picker: Any = None  # the live policy's RoutePicker (gateway.filters.routing)

    def configure(self, canary: Canary | None, targets: tuple[tuple[str, int], ...]) -> None:
        key = None if canary is None else (canary.model_dump_json(), targets)
        if key != self.guard_key:
            self.guard_key = key
            self.guard = None
            if canary is not None:
                self.guard = CanaryGuard(
                    CanaryParams(
                        canary.p95_ms, canary.max_error_ratio, canary.window_s, canary.min_requests
                    )
                )
                self.canary_backend = canary.backend

    def budget_for(self, ratio: float, floor: int) -> RetryBudget:
        b = self.budget
        if b is None:
            b = self.budget = RetryBudget(ratio, floor)
        b.ratio, b.floor = ratio, floor
        return b

    def state(self, now: float) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.picker is not None:
            out["weights"] = self.picker.effective_weights(now)
        if self.guard is not None:
            out["canary"] = {"backend": self.canary_backend, **self.guard.snapshot(now)}
        if self.budget is not None:
            out["retry_budget"] = self.budget.snapshot()
        return out


class BackendPool:
    """The services' owner of every backend's members (key "backends")."""

    def __init__(self, services: Services, random: Callable[[], float] | None = None) -> None:
        self.services = services
        self.clock = services.clock
        self.random: Callable[[], float] = random or _random.Random().random
        self.backends: dict[str, BackendState] = {}
        self.routes: dict[str, RouteState] = {}
        self.started = False
        LIVE_POOLS.add(self)

    def backend(self, name: str) -> BackendState:
        st = self.backends.get(name)
        if st is None:
            st = self.backends[name] = BackendState(self, name)
        return st

    def route(self, name: str) -> RouteState:
        st = self.routes.get(name)
        if st is None:
            st = self.routes[name] = RouteState(name)
        return st

    def apply(self, backends: list[Backend], routes: Iterable[str]) -> None:
        """Make the pool match a policy going live (see the module docstring)."""
        names = {b.name for b in backends}
        for b in backends:
            self.backend(b.name).configure(b)
        for name in [n for n in self.backends if n not in names]:
            self.backends.pop(name).stop()
        keep = set(routes)
        for name in [n for n in self.routes if n not in keep]:
            del self.routes[name]
        if self.started:
            self.start()

    def start(self) -> None:
        """Start background work (needs a running loop): at activation, or the first request."""
        self.started = True
        for st in self.backends.values():
            st.start(self.services)

    def addresses(self, protocol: str) -> set[str]:
        """Every member address of the backends speaking `protocol` (static and discovered)."""
        return {
            a
            for st in self.backends.values()
            if st.cfg is not None and st.cfg.protocol == protocol
            for a in st.members
        }

    def readiness(self) -> dict[str, object]:
        now = self.clock.now()
        out: dict[str, object] = {}
        for name, st in self.backends.items():
            plan = st.plan(now)
            item: dict[str, object] = {"available": plan.available, "members": plan.members}
            if st.registry_up is not None:
                item["registry_up"] = st.registry_up
            out[name] = item
        return out

    def state(self) -> dict[str, object]:
        now = self.clock.now()
        return {
            "backends": {name: st.state(now) for name, st in self.backends.items()},
            "routes": {name: rs.state(now) for name, rs in self.routes.items()},
        }

    def aclose(self) -> None:
        for st in self.backends.values():
            st.stop()
        LIVE_POOLS.discard(self)
