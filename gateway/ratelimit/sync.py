"""The limiter's background loop, the one place it awaits Redis (strict rules aside).

Every sync interval (sooner when a key's share runs low, never closer than a fifth of the
interval): one pipelined round trip that reports every key touched since the last one (and
gives back the shares of keys idle for `IDLE_S`) and leases new shares.
Every second: the replica announces itself (the live count sizes the fallback), counters go
to Prometheus, idle non-green keys get their colour re-evaluated, the colour history moves.

When a call fails or passes its deadline the limiter falls back (every rule decides locally,
sized by limit / live replicas), and Redis is retried in the background with a jittered
backoff (0.25 s doubling to 5 s): a (re)connect gets its own budget (`connect_timeout_ms`),
which no request ever waits for.

The loop works on its owner (`gateway.ratelimit.owner.Limiter`, which starts and stops it)
through `Synced`: what it reads and moves of the limiter, and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from gateway.core.keystate import KeyState
from gateway.core.lease import IDLE_S, Report, apply, report, restore
from gateway.core.overload import Colour, History
from gateway.errors import StoreUnavailable
from gateway.fleet.store import FLEET
from gateway.policy.ratelimits import RedisStoreOptions
from gateway.ratelimit.state import DECISIONS, PoolState, RuleState
from gateway.services import Services
from gateway.store.base import LimitStore, SyncOp, key_name
from gateway.telemetry import metrics

log = logging.getLogger("sluice.ratelimit")

MAX_OPS = 5000  # keys reported in one round trip; the rest wait for the next
ANNOUNCE_S = 1.0
RETRY_MIN_S, RETRY_MAX_S = 0.25, 5.0
IDLE_OBSERVE_S = 1.0


class Synced(Protocol):
    """The limiter as its sync loop sees it."""

    services: Services  # the loop ends once they close
    now: Callable[[], float]
    store: LimitStore | None
    store_cfg: RedisStoreOptions | None
    mode: str  # "memory", "redis" or "fallback"
    replicas: int  # live replicas (announced to Redis), the size of the local fallback
    replica_id: str
    last_error: str
    wake: asyncio.Event  # set when a share runs low: sync before the interval ends
    rules: dict[str, RuleState]
    pools: dict[str, PoolState]
    colour: Colour  # the gateway's: the worst backend pool's
    history: History
    key_history: History
    red_sources: OrderedDict[str, int]

    def set_mode(self, mode: str, reason: str = "") -> None: ...

    def fallback(self, reason: str) -> None:
        """Redis is away: every rule decides locally."""
        ...

    def colour_changed(self, scope: str, name: str, old: Colour, new: Colour) -> None: ...


async def run(lim: Synced) -> None:
    next_flush = next_announce = retry_at = last_sync = 0.0
    backoff = RETRY_MIN_S
    # Also ends by itself once the services close: a cancellation that races a Redis call's
    # own deadline can be lost inside the client (seen with redis-py on Python 3.11).
    while not lim.services.closed:
        cfg = lim.store_cfg
        interval = cfg.sync_interval_ms / 1000 if cfg is not None else 1.0
        try:  # (not wait_for: on 3.11 it can lose a cancellation that races its timeout)
            async with asyncio.timeout(interval):
                await lim.wake.wait()
        except TimeoutError:
            pass
        lim.wake.clear()
        gap = interval / 5 - (lim.now() - last_sync)
        if gap > 0:
            await asyncio.sleep(gap)
        now = lim.now()
        store = lim.store
        if store is not None and cfg is not None:
            if lim.mode == "fallback":
                if now >= retry_at:
                    if await reconnect(lim):
                        backoff, next_announce = RETRY_MIN_S, now + ANNOUNCE_S
                    else:
                        retry_at = now + backoff * (0.5 + random.random())
                        backoff = min(RETRY_MAX_S, backoff * 2)
            else:
                await sync_once(lim)
                last_sync = now
                if lim.mode == "redis" and now >= next_announce:
                    await announce(lim)
                    next_announce = now + ANNOUNCE_S
        if now >= next_flush:
            flush(lim, now)
            next_flush = now + 1.0


async def reconnect(lim: Synced) -> bool:
    store, cfg = lim.store, lim.store_cfg
    assert store is not None and cfg is not None
    try:
        await store.connect(cfg.connect_timeout_ms / 1000)
        lim.replicas = await store.announce(lim.replica_id, cfg.replica_ttl_s)
    except StoreUnavailable as exc:
        lim.last_error = str(exc)
        metrics.RL_REDIS_ERRORS.labels("connect").inc()
        return False
    metrics.RL_REPLICAS.set(lim.replicas)
    lim.set_mode("redis")
    lim.wake.set()  # lease at once
    return True


async def announce(lim: Synced) -> None:
    store, cfg = lim.store, lim.store_cfg
    assert store is not None and cfg is not None
    fleet = lim.services.peek(FLEET)
    if (
        fleet is not None
        and fleet.shared
        and fleet.cfg is not None
        and (fleet.cfg.url, fleet.cfg.key_prefix) == (cfg.url, cfg.key_prefix)
    ):
        # The fleet store announces this replica (the same id, the same set) once a second.
        n = fleet.replicas
        if n != lim.replicas:
            lim.replicas = n
            lim.set_mode(lim.mode)
        metrics.RL_REPLICAS.set(n)
        return
    try:
        n = await store.announce(lim.replica_id, cfg.replica_ttl_s)
    except StoreUnavailable as exc:
        metrics.RL_REDIS_ERRORS.labels("announce").inc()
        lim.fallback(str(exc))
        return
    if n != lim.replicas:
        lim.replicas = n
        lim.set_mode(lim.mode)  # re-sizes the local scale
    metrics.RL_REPLICAS.set(n)


async def sync_once(lim: Synced) -> None:
    """Report every active key and lease new shares, in one pipelined round trip."""
    store, cfg = lim.store, lim.store_cfg
    if store is None or cfg is None:
        return
    now = lim.now()
    ops: list[SyncOp] = []
    refs: list[tuple[RuleState, str, KeyState, Report]] = []
    for rs in lim.rules.values():
        rule = rs.rule
        todo = rs.dirty
        rs.dirty = {}
        # A leased key nobody touched since the last sync has nothing to report; once it has
        # been idle for IDLE_S it is synced one last time, to give its share back. So the
        # work per sync follows the keys that are active, not the keys that hold a share.
        for k, ks in rs.leased.items():
            if k not in todo and now - ks.last > IDLE_S:
                todo[k] = ks
        for k, ks in todo.items():
            if len(ops) >= MAX_OPS:
                rs.dirty[k] = ks
                continue
            r = report(ks, rs.math, now, rs.min_tokens)
            if r is None:
                continue
            if rule.strict:
                r.want_req = r.want_tok = 0.0  # strict keys are decided by Redis, not leased
            if ks.rkey is None:
                ks.rkey = key_name(cfg.key_prefix, rule.name, rule.params, k)
            ops.append(
                SyncOp(
                    ks.rkey,
                    rule.params,
                    r.req_delta,
                    r.tok_delta,
                    r.offered,
                    r.want_req,
                    r.want_tok,
                    r.reset,
                )  # fmt: skip
            )
            refs.append((rs, k, ks, r))
    if not ops:
        return
    t0 = time.perf_counter()
    try:
        results = await store.sync(ops)
    except StoreUnavailable as exc:
        _restore(refs)
        metrics.RL_REDIS_ERRORS.labels("sync").inc()
        lim.fallback(str(exc))
        return
    metrics.RL_SYNC_SECONDS.observe(time.perf_counter() - t0)
    if lim.mode != "redis":  # went away while we waited (a strict call failed meanwhile)
        _restore(refs)
        return
    for (rs, k, ks, r), res in zip(refs, results, strict=True):
        apply(ks, r, res.granted_req, res.granted_tok, res.admitted, res.offered, res.tokens)
        if ks.leased:
            rs.leased[k] = ks
        else:
            rs.leased.pop(k, None)


def _restore(refs: list[tuple[RuleState, str, KeyState, Report]]) -> None:
    """A sync that failed: its keys report again at the next one, except those forgotten
    (evicted) while it ran, which would otherwise stay in `dirty` for the whole outage."""
    for rs, k, ks, r in refs:
        restore(ks, r)
        if rs.keys.get(k) is ks:
            rs.dirty[k] = ks


def flush(lim: Synced, now: float) -> None:
    """Once a second: counters and gauges to Prometheus, idle colours, the history."""
    worst_key = Colour.GREEN
    for rs in lim.rules.values():
        name = rs.rule.name
        for i, n in enumerate(rs.counts):
            d = n - rs.flushed[i]
            if d:
                metrics.RL_DECISIONS.labels(name, DECISIONS[i]).inc(d)
                rs.flushed[i] = n
        for kind, i in (("reserved", 0), ("refunded", 1), ("charged", 2)):
            if rs.tokens[i]:
                metrics.RL_TOKENS.labels(name, kind).inc(rs.tokens[i])
                rs.tokens[i] = 0.0
        w = rs.math.weights
        metrics.RL_SIGNAL.labels(name, "qps").set(rs.peak_q)
        metrics.RL_SIGNAL.labels(name, "tokens").set(rs.peak_t)
        metrics.RL_SIGNAL.labels(name, "pressure").set(w.q * rs.peak_q + w.t * min(rs.peak_t, 1))
        rs.shown = (rs.peak_q, rs.peak_t)
        rs.peak_q = rs.peak_t = 0.0
        for k, ks in list(rs.hot.items()):
            if now - ks.last >= IDLE_OBSERVE_S and ks.observe(rs.math, rs.scale, now):
                rs.recolour(k, ks)
                assert ks.changed is not None
                lim.colour_changed("key", f"{name}[{k}]", ks.changed, ks.colour)
            worst_key = max(worst_key, ks.colour)
        g, y, r = rs.colours()
        for label, n in (("green", g), ("yellow", y), ("red", r)):
            metrics.RL_KEYS.labels(name, label).set(n)
        leased_req = sum(max(0.0, ks.req_share) for ks in rs.leased.values())
        leased_tok = sum(max(0.0, ks.tok_share) for ks in rs.leased.values())
        metrics.RL_OUTSTANDING.labels(name, "requests").set(leased_req)
        metrics.RL_OUTSTANDING.labels(name, "tokens").set(leased_tok)
    gateway = Colour.GREEN
    for p in lim.pools.values():
        p.observe(now)
        gateway = max(gateway, p.machine.colour)
        metrics.RL_COLOUR.labels(f"pool:{p.name}").set(int(p.machine.colour))
        metrics.RL_CONCURRENCY.labels(p.name, "limit").set(p.limit.limit)
        metrics.RL_CONCURRENCY.labels(p.name, "in_flight").set(p.limit.in_flight)
    lim.colour = gateway
    metrics.RL_COLOUR.labels("gateway").set(int(gateway))
    lim.history.note(gateway, now)
    lim.key_history.note(worst_key, now)
    if gateway is not Colour.RED and worst_key is not Colour.RED:
        lim.red_sources.clear()  # counts of shed sources only matter within a red episode
