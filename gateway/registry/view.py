"""(compiled) One backend section as one policy wrote it (`BackendView`): its members over the
pool's shared member state (`gateway.registry.pool`), the traffic plan the pure balancer picks
from, and the way each try's result reaches the member's breaker, outlier record and passive
health.

The plan is rebuilt only when some member state changes (`BackendPool.changed`) or a time-based
change falls due: an open breaker's cool-down, a probe's deadline, an ejection's end, a
heartbeat going stale. Half-open probes are offered before the balancer's choice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from gateway.core.affinity import pick_affinity, pick_allowed
from gateway.core.balancer import MemberStatus, Plan, build_plan, pick, pick_excluding, pick_sticky
from gateway.core.breaker import Change, State
from gateway.core.outcome import Outcome
from gateway.core.outlier import Outlier, max_ejected
from gateway.policy.compiled import endpoint_of
from gateway.registry.health import start_checker
from gateway.registry.member import Attempt, Member, MemberBooks, Result, classify, timed_out
from gateway.registry.models import models_view
from gateway.registry.params import breaker_params, health_params, outlier_params
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint
    from gateway.policy.model import Backend
    from gateway.registry.dns import DnsWatcher
    from gateway.registry.heartbeats import Watcher
    from gateway.registry.scrape import Scraper

log: Final = logging.getLogger("sluice.backends")


class ViewPool(MemberBooks, Protocol):
    """What a view needs from the pool that made it (`gateway.registry.pool.BackendPool`): the
    shared member state, the registry poller of its `discovery.registry` section, and whether
    it is one of the views whose background work runs."""

    @property
    def started(self) -> bool: ...

    @property
    def latest(self) -> Mapping[str, BackendView]:
        """The views of the policy activated last, by backend name."""

    def watcher(self, backend: str, reg: Any) -> Watcher: ...

    def dns_watcher(self, backend: str, cfg: Any) -> DnsWatcher: ...

    def scraper(self, cfg: Backend) -> Scraper | None:
        """The scrapes of the backend's `load.metrics` section (None without one)."""


class BackendView:
    """One backend section of one policy: its members over the pool's shared state, its plan."""

    def __init__(self, pool: ViewPool, cfg: Backend, key: tuple[str, str]) -> None:
        self.pool = pool
        self.cfg = cfg
        self.key = key
        self.name = cfg.name
        self.bp = breaker_params(cfg)
        self.op = outlier_params(cfg)
        self.hp = health_params(cfg)
        self.members: dict[str, Member] = {}
        self.models = models_view(pool.services, cfg)  # what its members serve (`models`)
        self.prefixes = pool.prefixes(cfg.name)  # where its prompt prefixes are placed
        for e in cfg.endpoints:
            ep = endpoint_of(cfg, e.address, e.weight, e.priority)
            self.members[ep.address] = self._member(ep, "static")
        self.watcher: Watcher | DnsWatcher | None = None
        d = cfg.discovery
        if d is not None:
            self.watcher = (pool.watcher(cfg.name, d.registry) if d.registry is not None
                            else pool.dns_watcher(cfg.name, d.dns))  # fmt: skip
        self.scraper = pool.scraper(cfg)  # the model servers' own figures (load.metrics)
        self._plan: Plan | None = None
        self._expires = 0.0
        self._epoch = -1
        self.panic = False
        self.last_pick = 0.0
        # What the pool tracks, weakly, of this view (`gateway.registry.pool.ViewHold`): it
        # lives as long as the view does.
        self.hold: object = None

    def _member(self, ep: Endpoint, source: str) -> Member:
        pool, name, addr = self.pool, self.name, ep.address
        box = pool.box(name, addr, self.bp) if self.bp is not None else None
        outlier = pool.outlier(name, addr, self.op) if self.op is not None else None
        hbox = None
        if self.hp is not None and self.cfg.health is not None:
            hbox = pool.health(name, ep, self.hp, self.cfg.health)
        if self.models is not None:
            self.models.track(ep)
        return Member(ep, source, pool.core(name, addr), box, outlier, hbox)

    def _sync_discovered(self) -> None:
        """Members found by the registry or DNS join; those no longer found leave (their
        requests in flight finish: an attempt holds its member)."""
        w = self.watcher
        if w is None:
            return
        source = w.source
        for address in w.found:
            m = self.members.get(address)
            if m is None:
                weight, priority = w.placement(address)
                ep = endpoint_of(self.cfg, address, weight, priority)
                self.members[address] = self._member(ep, source)
        for address in [a for a, m in self.members.items() if m.source == source]:
            if address not in w.found:
                del self.members[address]
                if self.models is not None:
                    self.models.forget(address)

    def fresh_until(self, m: Member) -> float:
        if m.source != "registry" or self.watcher is None:
            return math.inf
        return self.watcher.fresh_until.get(m.address, 0.0)

    # --- the plan ------------------------------------------------------------------------------
    def plan(self, now: float) -> Plan:
        p = self._plan
        if p is None or now >= self._expires or self._epoch != self.pool.epoch:
            return self._rebuild(now)
        return p

    def _rebuild(self, now: float) -> Plan:
        pool = self.pool
        self._epoch = pool.epoch
        self._sync_discovered()
        if pool.started and self.pool.latest.get(self.name) is self:
            self.start_work()
        statuses: list[MemberStatus] = []
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
            fresh = self.fresh_until(m)
            if fresh <= now:
                continue  # heartbeat stale: out of membership
            expires = min(expires, fresh)
            ejected = False
            if m.outlier is not None and m.outlier.ejected(now):
                ejected = True
                expires = min(expires, m.outlier.ejected_until)
            healthy = m.hbox is None or m.hbox.state.healthy
            if self.models is not None:
                self.models.health(m.address, healthy)
            statuses.append(
                MemberStatus(
                    m, m.priority, m.weight, healthy and not ejected and closed, closed, probing
                )
            )
        plan = build_plan(statuses, self.cfg.panic_threshold)
        panic = any(lv.panic for lv in plan.levels)
        if panic != self.panic:
            self.panic = panic
            log.warning("backend %s: %s panic mode (%d of %d members available)", self.name,
                        "in" if panic else "out of", plan.available, plan.members)  # fmt: skip
        self._plan, self._expires = plan, expires
        self._epoch = pool.epoch  # our own transitions above must not make us rebuild again
        return plan

    def _judge_probes(self, m: Member, now: float) -> None:
        """Half-open probes whose first byte already went out are judged by it now (a stream
        may run for minutes after its first byte; the probe question is answered)."""
        br, box = m.breaker, m.box
        if br is None or box is None or not box.probes:
            return
        for ticket in br.pending_probes():
            a = box.probes.get(ticket)
            fb = None if a is None or a.ctx is None else a.ctx.first_byte_at
            if a is None or fb is None:
                continue
            a.reported = True
            a.ctx = None
            del box.probes[ticket]
            change = br.record(ticket, now, False, fb - a.started > br.p.slow_call_s)
            if change is not None:
                self._breaker_changed(m, change)
                return

    def _breaker_changed(self, m: Member, change: Change) -> None:
        self.pool.changed()
        metrics.BREAKER_TRANSITIONS.labels(self.name, change.new.value).inc()
        if change.new is State.OPEN:
            log.warning("breaker open: backend=%s member=%s (%s)", self.name, m.address,
                        change.reason)  # fmt: skip
        else:
            log.info("breaker %s: backend=%s member=%s (%s)", change.new.value, self.name,
                     m.address, change.reason)  # fmt: skip
        if change.new is not State.HALF_OPEN and m.box is not None:
            m.box.probes = {}

    # --- picking and results ----------------------------------------------------------------
    def take(
        self,
        now: float,
        key: int | None,
        exclude: Collection[Member] = (),
        ok: Callable[[Member], bool] | None = None,
        prefix: int | None = None,
        load_factor: float = 0.0,
        keep: bool = True,
    ) -> tuple[Member, int] | None:
        """A member and its breaker ticket (probes of half-open members first), or None. `ok`
        admits only some members (they serve the model; not tried yet); `prefix` is the
        prompt's key, placed with bounded load (`gateway.core.placement`, the backend's
        `prefixes` book; `keep` False for a retry, which leaves the placement) unless a sticky
        `key` is given. A member returned for a `prefix` is counted in the prefix's load (the
        caller calls `prefixes.finished` when the try ends)."""
        plan = self.plan(now)
        self.last_pick = now
        placed = prefix is not None and key is None
        if plan.probing:  # the plan's members are this view's `Member`s
            for c in plan.probing:
                p = cast("Member", c)
                pb = p.breaker
                if (
                    pb is not None
                    and p not in exclude
                    and (ok is None or ok(p))
                    and self.fresh_until(p) > now
                ):
                    t = pb.allow(now)
                    if t >= 0:
                        self.pool.changed()  # plans must now see this probe's deadline
                        if placed:
                            assert prefix is not None
                            self.prefixes.started(prefix, now)
                        return p, t
        got: object
        if key is not None and ok is not None:
            got = pick_sticky(plan, key, [x for x in self.members.values() if not ok(x)])
        elif prefix is not None and key is None:
            got = pick_affinity(plan, prefix, load_factor, ok, self.prefixes, now, keep)
        elif ok is not None:
            got = pick_allowed(plan, self.pool.random, ok)
        elif exclude:
            if key is None:
                got = pick_excluding(plan, self.pool.random, exclude)
            else:
                got = pick_sticky(plan, key, exclude)
        elif key is None:
            got = pick(plan, self.pool.random)
        else:
            got = pick_sticky(plan, key)
        m = cast("Member | None", got)
        if m is None:
            return None
        br = m.breaker
        if br is None:
            return m, 0
        t = br.allow(now)
        if t < 0:  # its state moved since the plan was made
            self.pool.changed()
            if placed:
                assert prefix is not None
                self.prefixes.finished(prefix, now)  # counted by the placement: not sent
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
        core = m.core
        core.in_flight -= 1
        if outcome is Outcome.OK and grpc_status is None and http_status < 500:
            res = Result.OK  # the common case, without a call
        else:
            res = classify(outcome, http_status, grpc_status)
        ttfb = (first_byte_at if first_byte_at is not None else now) - a.started
        if a.ctx is not None:
            a.ctx = None
            if m.box is not None:
                m.box.probes.pop(a.ticket, None)
        br = m.breaker
        if res is Result.IGNORED:
            if br is not None and not a.reported:
                br.ignore(a.ticket)
            a.reported = True
            return res, ttfb
        core.requests += 1
        failed = res is Result.FAILED
        if br is not None and not a.reported:
            change = br.record(a.ticket, now, failed, ttfb > br.p.slow_call_s)
            if change is not None:
                self._breaker_changed(m, change)
        a.reported = True
        outlier = m.outlier
        if failed:
            core.failures += 1
            slow = timed_out(outcome, grpc_status)
            if slow:
                core.timeouts += 1
            if m.hbox is not None and m.hbox.poke is not None:
                m.hbox.poke.set()  # passive health: check it now
            if outlier is not None and outlier.record(now, slow):
                self._try_eject(m, outlier, now)
        elif outlier is not None:
            outlier.record(now, False)
        return res, ttfb

    def _try_eject(self, m: Member, outlier: Outlier, now: float) -> None:
        assert self.op is not None
        ejected = sum((1 for x in self.members.values() if x.outlier and x.outlier.ejected(now)), 0)
        if ejected >= max_ejected(self.op, len(self.members)):
            return
        until = outlier.eject(now)
        metrics.OUTLIER_EJECTIONS.labels(self.name).inc()
        log.warning("outlier ejected: backend=%s member=%s timeout ratio %.2f for %.0fs",
                    self.name, m.address, outlier.last_ratio, until - now)  # fmt: skip
        self.pool.changed()

    # --- background work and state --------------------------------------------------------------
    def start_work(self) -> None:
        """Health check loops of its members, its registry poller and the scrapes of its
        members' model servers (idempotent)."""
        services = self.pool.services
        for m in self.members.values():
            if m.hbox is not None and m.hbox.checker is None:
                start_checker(services, self.pool, m.hbox)
        if self.watcher is not None:
            self.watcher.start()
        if self.scraper is not None:
            self.scraper.sync(self.members.values())
        if self.models is not None:
            self.models.start()

    def state(self, now: float) -> dict[str, object]:
        plan = self.plan(now)
        members = []
        for m in self.members.values():
            fresh = self.fresh_until(m)
            fresh_for = None if fresh == math.inf else round(fresh - now, 3)
            members.append(m.snapshot(now, fresh_for))
        out: dict[str, object] = {
            "protocol": self.cfg.protocol,
            "members": members,
            "in_rotation": plan.members,
            "available": plan.available,
            "panic": self.panic,
            "levels": [
                {
                    "priority": lv.priority,
                    "members": [cast("Member", m).address for m in lv.members],
                    "share": round(hi - lo, 4),
                    "panic": lv.panic,
                }
                for lv, lo, hi in zip(
                    plan.levels, (0.0, *plan.cum_load), plan.cum_load, strict=False
                )
            ],  # fmt: skip
        }
        if self.watcher is not None:
            out["registry"] = self.watcher.state()
        if self.models is not None:
            out["models"] = self.models.state()
        if self.prefixes.placed:
            out["prefixes"] = {"placed": len(self.prefixes.placed), "moves": self.prefixes.moves}
        return out
