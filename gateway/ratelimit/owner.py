"""The limiter's one owner in the services (key `RATELIMIT`): every bucket, window, colour and
concurrency limit, the store, the sync loop, and what /admin/state and /readyz show.

What a policy reload does to the state:

- a rule whose identity (name, key parts, qps, window_s, tokens_per_second, burst_tokens) is
  unchanged keeps every key: counts, token balances, leases, colours;
- a rule whose identity changed starts over: fresh keys (buckets full, windows empty, green);
  its Redis keys change too (the parameters are part of their names), so no replica inherits
  counts made under other numbers; the old keys expire on their own;
- `enforce`, `strict`, `on_overrun`, priority classes, weights-free settings (yellow delay,
  queue size, red deny) apply to the next request without touching counts;
- a removed rule's keys are dropped when the new policy goes live;
- backend pools keep their concurrency limit while their name (the route's backends) stays;
- the store: switching memory <-> redis, or another URL, keeps every local key (they decide
  locally until their first lease from the new store).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import secrets
import socket
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import Any, Final

from gateway.core.clock import MonotonicClock
from gateway.core.concurrency import LimitParams
from gateway.core.overload import Colour, History, Thresholds
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.ratelimit.compiled import CompiledLimits, CompiledRule
from gateway.ratelimit.state import DECISIONS, PoolState, RuleState
from gateway.ratelimit.sync import run, sync_once
from gateway.services import ServiceKey, Services
from gateway.store.base import LimitStore
from gateway.telemetry import metrics

log = logging.getLogger("sluice.ratelimit")

MAX_RECENT = 50
MAX_SOURCES = 10_000  # sources counted while red (for the datapath deny list)
ALERT_EVERY_S = 10.0


class Limiter:
    def __init__(self, services: Services) -> None:
        self.services = services
        clock = services.clock
        # The production clock's method is one Python frame more than time.monotonic itself.
        self.now = time.monotonic if isinstance(clock, MonotonicClock) else clock.now
        self.rules: dict[str, RuleState] = {}
        self.pools: dict[str, PoolState] = {}
        self.compiled: CompiledLimits | None = None
        self.previous: set[str] = set()  # the rules of the chain activated before this one
        self.store: LimitStore | None = None
        self.store_cfg: RedisStoreOptions | None = None
        self.mode = "memory"
        self.workers = max(1, int(os.environ.get("SLUICE_WORKERS", "1") or 1))
        self.replicas = 1
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.waiting = 0  # requests in the yellow queue now
        self.colour = Colour.GREEN  # the gateway's: the worst backend pool's
        self.history = History(300)  # the gateway's colour, per second
        self.key_history = History(300)  # the worst colour of any key, per second
        self.transitions: deque[tuple[float, str, str, str]] = deque(maxlen=MAX_RECENT)
        self.recent: deque[tuple[float, str, str]] = deque(maxlen=MAX_RECENT)
        self.reasons: Counter[str] = Counter()
        self.red_sources: OrderedDict[str, int] = OrderedDict()
        self.denied = 0
        self.last_error = ""
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._log_budget = 0.0
        self._log_at = 0.0
        self._alerted: dict[str, float] = {}  # key or pool -> when its last alert was logged

    # -- building and activating --------------------------------------------------------------
    def rule_state(self, rule: CompiledRule, max_keys: int) -> RuleState:
        """The state of `rule` (found by identity, else created): called at build time, so a
        build that is thrown away leaves nothing but an unused entry, pruned at activate."""
        rs = self.rules.get(rule.ident)
        if rs is None:
            rs = self.rules[rule.ident] = RuleState(rule, max_keys, self.local_scale())
        else:
            rs.rule = rule  # enforce / strict / on_overrun may have changed
            rs.max_keys = max_keys
        return rs

    def pool(self, name: str) -> PoolState | None:
        return self.pools.get(name)

    def activate(self, compiled: CompiledLimits, states: Iterable[RuleState] = ()) -> None:
        """Configure for `compiled`, whose filter holds `states`. The rules of the chain
        activated before stay synced too: during a staged rollout both policies serve, and a
        rollback activates the stable chain again, whose states come back here."""
        self.compiled = compiled
        for rs in states:
            self.rules[rs.rule.ident] = rs
        live = {r.ident for r in compiled.rules}
        keep = live | self.previous
        self.previous = live
        for ident in [i for i in self.rules if i not in keep]:
            del self.rules[ident]
        c = compiled.section.concurrency
        if c is None:
            self.pools.clear()
        else:
            params = LimitParams(
                c.latency_slo_ms / 1000, c.initial_limit, c.min_limit, c.max_limit, c.smoothing
            )
            o = compiled.section.overload
            th = Thresholds(o.green_below, o.yellow_above, o.red_above)
            names = set(compiled.pool_of_route.values())
            for n in [n for n in self.pools if n not in names]:
                del self.pools[n]
            for n in names:
                p = self.pools.get(n)
                if p is None:
                    self.pools[n] = PoolState(n, params, th, self.now())
                else:
                    p.limit.p, p.thresholds = params, th
        self._configure_store(compiled)
        if self.task is None or self.task.done():
            self.task = self.services.spawn(run(self), "sluice-ratelimit")

    def _configure_store(self, compiled: CompiledLimits) -> None:
        from gateway.fleet.store import fleet_for

        fleet = fleet_for(self.services)
        fleet.configure(compiled.fleet_store)
        # One replica id for the fleet: the limits announce the one the fleet store does.
        self.replica_id = fleet.replica_id
        cfg = compiled.store
        if cfg == self.store_cfg and (cfg is None) == (self.store is None):
            return
        old = self.store_cfg
        self.store_cfg = cfg
        if cfg is None:
            from gateway.store.redis_client import release_redis

            self.store = None
            release_redis(self.services, self)
            self.set_mode("memory")
        else:
            from gateway.store.redis import RedisStore
            from gateway.store.redis_client import redis_for

            same = old is not None and (old.url, old.cluster, old.key_prefix) == (
                cfg.url, cfg.cluster, cfg.key_prefix,
            )  # fmt: skip
            deadline = cfg.deadline_ms / 1000
            background = max(cfg.deadline_ms, cfg.sync_interval_ms) / 1000
            if same and isinstance(self.store, RedisStore):
                self.store.deadline_s, self.store.sync_deadline_s = deadline, background
                return
            client = redis_for(self.services, cfg.url, cluster=cfg.cluster, holder=self)
            self.store = RedisStore(
                client, prefix=cfg.key_prefix, deadline_s=deadline, sync_deadline_s=background
            )
            self.fallback("not connected yet")
        self.wake.set()

    # -- modes --------------------------------------------------------------------------------
    def local_scale(self) -> float:
        """What a key deciding locally gets of each limit: 1/workers (memory), 1/live replicas
        (Redis away, or not yet leased)."""
        if self.store is None:
            return 1.0 / self.workers
        return 1.0 / max(1, self.replicas)

    def set_mode(self, mode: str, reason: str = "") -> None:
        if mode != self.mode:
            why = f" ({reason})" if reason else ""
            # Losing Redis is worth a warning; starting up, recovering or switching is not.
            level = logging.WARNING if self.mode == "redis" else logging.INFO
            log.log(level, "rate limits: store mode %s -> %s%s", self.mode, mode, why)
        self.mode = mode
        for m in ("memory", "redis", "fallback"):
            metrics.RL_STORE_MODE.labels(m).set(1 if m == mode else 0)
        scale = self.local_scale()
        for rs in self.rules.values():
            rs.scale = scale

    def fallback(self, reason: str) -> None:
        """Redis is away: every rule decides locally (sized by the live replica count)."""
        from gateway.core.lease import drop

        self.last_error = reason
        for rs in self.rules.values():
            for k, ks in list(rs.leased.items()):
                drop(ks)
                if rs.keys.get(k) is ks:  # (a key evicted while leased goes now)
                    rs.dirty[k] = ks
            rs.leased.clear()
        self.set_mode("fallback", reason)

    # -- what the request path reports --------------------------------------------------------
    def rejected(self, rule: str, reason: str) -> None:
        self.reasons[reason] += 1
        self.recent.append((self.now(), rule, reason))

    def colour_changed(self, scope: str, name: str, old: Colour, new: Colour) -> None:
        now = self.now()
        self.transitions.append((now, scope, name, f"{old.label}->{new.label}"))
        metrics.RL_COLOUR_CHANGES.labels(scope, new.label).inc()
        # An alert line per transition into yellow or red: at most one per key or pool every
        # ALERT_EVERY_S, and 10 a second in all (a flapping key must not flood the log).
        if new > old:
            last = self._alerted.get(name)
            if last is not None and now - last < ALERT_EVERY_S:
                return
            if now - self._log_at >= 1.0:
                self._log_at, self._log_budget = now, 10.0
            if self._log_budget >= 1.0:
                self._log_budget -= 1.0
                if len(self._alerted) >= MAX_SOURCES:
                    self._alerted.clear()
                self._alerted[name] = now
                log.warning("overload: %s %s turned %s", scope, name, new.label)

    def shed_source(self, source: str, after: int, ttl_s: float | None) -> None:
        """Count a source shed in red; hand it to the datapath after `after` of them."""
        deny = self.services.deny
        if deny is None or not source:
            return
        n = self.red_sources.pop(source, 0) + 1
        if n >= after:
            if deny(source, ttl_s):
                self.denied += 1
            return
        self.red_sources[source] = n
        if len(self.red_sources) > MAX_SOURCES:
            self.red_sources.popitem(last=False)

    # -- /readyz, /admin/state ----------------------------------------------------------------
    def readiness(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "colour": self.colour.label}
        if self.store is not None:
            out["replicas"] = self.replicas
            if self.mode == "fallback":
                out["store_error"] = self.last_error
        return out

    def state(self) -> dict[str, Any]:
        now = self.now()
        # The active policy's rules (those of the chain before it are only kept in sync).
        live = {r.ident for r in self.compiled.rules} if self.compiled is not None else set()
        rules = [_rule_state(rs, now) for i, rs in self.rules.items() if i in live]
        return {
            "mode": self.mode,
            "workers": self.workers,
            "replicas": self.replicas,
            # The section's colour on the status page: the gateway's (backend pools), and at
            # least yellow while some key is not green (a tenant is being shed).
            "colour": self.section_colour().label,
            "gateway_colour": self.colour.label,
            "history": {
                "gateway": self.history.series(now),
                "keys": self.key_history.series(now),
            },
            "pools": {
                n: {
                    "colour": p.machine.colour.label,
                    "limit": round(p.limit.limit, 1),
                    "in_flight": p.limit.in_flight,
                    "latency_ms": round(p.limit.latency * 1000, 1),
                }
                for n, p in self.pools.items()
            },
            "rules": rules,
            "queue": {"waiting": self.waiting},
            "rejections": dict(self.reasons),  # by reason, since start
            "recent_rejections": [
                {"ago_s": round(now - t, 1), "rule": r, "reason": why}
                for t, r, why in reversed(self.recent)
            ],
            "transitions": [
                {"ago_s": round(now - t, 1), "scope": s, "name": n, "change": c}
                for t, s, n, c in reversed(self.transitions)
            ],
            "denied_sources": self.denied,
        }

    def section_colour(self) -> Colour:
        worst_key = Colour.GREEN
        for rs in self.rules.values():
            for ks in rs.hot.values():
                worst_key = max(worst_key, ks.colour)
        return max(self.colour, min(worst_key, Colour.YELLOW))

    async def aclose(self) -> None:
        """Give leased shares back and leave the replica set (bounded by the deadline)."""
        if self.store is None or self.mode != "redis":
            return
        for rs in self.rules.values():
            for ks in rs.leased.values():
                ks.last = -1e9  # idle: the final sync gives the share back
        try:
            await sync_once(self)
            await self.store.leave(self.replica_id)
        except Exception as exc:
            log.info("rate limits: could not return leases at stop: %s", exc)


def _rule_state(rs: RuleState, now: float) -> dict[str, Any]:
    m = rs.math
    w = m.weights

    def row(k: str, ks: Any) -> dict[str, Any]:
        tu = min(ks.t, 1.0)
        return {
            "key": k,
            "colour": ks.colour.label,
            "qps_utilisation": round(ks.q, 3),
            "token_utilisation": round(ks.t, 3),
            "pressure": round(w.q * ks.q + w.t * tu, 3),
            "leased": ks.leased,
        }

    hot = heapq.nlargest(5, rs.keys.items(), key=lambda kv: max(kv[1].q, kv[1].t))
    return {
        "name": rs.rule.name,
        "key": list(rs.rule.key_parts),
        "enforce": rs.rule.enforce,
        "strict": rs.rule.strict,
        "qps_limit": m.limit / m.window_s if m.limit else None,
        "tokens_per_second": m.rate or None,
        "keys": len(rs.keys),
        "evicted": rs.evicted,
        "colours": dict(zip(("green", "yellow", "red"), rs.colours(), strict=True)),
        "colour": max((ks.colour for ks in rs.hot.values()), default=Colour.GREEN).label,
        "qps_util": round(rs.shown[0], 3),  # the highest of any key over the last second
        "token_util": round(rs.shown[1], 3),
        "pressure": round(w.q * rs.shown[0] + w.t * min(rs.shown[1], 1.0), 3),
        "decisions": dict(zip(DECISIONS, rs.counts, strict=True)),
        "hottest": [row(k, ks) for k, ks in hot],
    }


RATELIMIT: Final = ServiceKey[Limiter]("ratelimit")


def limiter_for(services: Services) -> Limiter:
    return services.get(RATELIMIT, lambda: Limiter(services))
