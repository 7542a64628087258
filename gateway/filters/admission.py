"""(compiled) Fair admission on the request path: a request for a full backend pool waits in the
pool's queue (`gateway.admission.owner`, decisions of `gateway.core.fairqueue`) instead of being
refused, and takes the next free slot in the queue's order. It sits just before `route`, so the
member is picked only once the request is dispatched, with the members' load then (late
binding). HTTP and gRPC requests of one pool share its queue.

- `on_request` (plain while a slot is free: the uncontended request pays a few lookups, the
  charge and its wait's histogram sample, ~4.5 µs in all): the effective class
  (`admission.priority` clamped, the same `ctx.priority` the limits use), the tenant
  (`fairness.key`) and its weight, the deadline header; then dispatch now, or wait (a
  coroutine, until dispatched, refused, `max_wait_ms` or the deadline passes); a client that
  goes away while waiting cancels the wait and leaves the queue at once.
- `on_response`: the slot is given back and the tenant's counter reconciled with the tokens it
  was served: `ctx.usage` when the backend reported it (prompt × input + completion × output),
  else estimated (request bytes / 4 and one token per stream event, or response bytes / 4).
  With `queue.anticipate_ms`, the slot may be held for the tenant's next request instead; the
  owner's timer gives it to the queue when the hold expires unused.

Refusals: 503 with Retry-After and `{"error": {"type": reason}}`: `queue_full` (gRPC
RESOURCE_EXHAUSTED), `queue_timeout`, `deadline_unreachable`, `shed` (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from gateway.admission.owner import AdmissionBook, PoolQueue, PoolSpec, admission_for
from gateway.context import RequestContext, Status
from gateway.core.fairqueue import (
    DEADLINE_UNREACHABLE,
    DISPATCHED,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    SHED,
    WAITING,
    QueueParams,
    Waiter,
)
from gateway.core.keys import compile_key
from gateway.core.overload import Colour
from gateway.core.request import first_route
from gateway.core.serverload import slots
from gateway.core.verdict import GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE, Verdict, reject
from gateway.fleet.slots import slots_for
from gateway.fleet.store import fleet_for
from gateway.policy.admission import Admission
from gateway.policy.compiled import CompiledPolicy
from gateway.policy.store import effective_store
from gateway.ratelimit.compiled import pool_name, priority_of
from gateway.ratelimit.owner import Limiter, limiter_for
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.services import Services
from gateway.settings import Settings
from gateway.telemetry import metrics

NAME: Final = "admission"
_CONTINUE: Final = Status.CONTINUE
MAX_DEADLINE_MS: Final = 3_600_000.0

REFUSALS: Final[dict[str, Verdict]] = {
    QUEUE_FULL: reject(503, GRPC_RESOURCE_EXHAUSTED, QUEUE_FULL,
                       "the backend pool's queue is full", 1.0),
    QUEUE_TIMEOUT: reject(503, GRPC_UNAVAILABLE, QUEUE_TIMEOUT,
                          "no slot of the backend pool freed in time", 1.0),
    DEADLINE_UNREACHABLE: reject(503, GRPC_UNAVAILABLE, DEADLINE_UNREACHABLE,
                                 "the request's deadline cannot be met", 1.0),
    SHED: reject(503, GRPC_UNAVAILABLE, SHED, "shed from the queue while overloaded", 1.0),
}  # fmt: skip


def pool_specs(policy: CompiledPolicy, workers: int = 1) -> dict[str, PoolSpec]:
    """Route name -> its pool's spec, for the routes whose pool has a limit to queue at: every
    backend with `max_in_flight` (× its members in rotation, `follow`; under `--workers N` each
    worker takes 1/N of it, rounded up, so that N workers pass it by at most N - 1), else the
    adaptive concurrency limit (`rate_limits.concurrency`); a pool with neither never queues
    and is left out."""
    p = policy.policy
    backends = {b.name: b for b in p.backends}
    adaptive = p.rate_limits is not None and p.rate_limits.concurrency is not None
    out: dict[str, PoolSpec] = {}
    for r in p.routes:
        names = [r.backend] if r.backend else [w.backend for w in r.backends]
        bs = [backends[n] for n in names if n in backends]
        if bs and all(b.max_in_flight for b in bs):
            fixed = sum(((b.max_in_flight or 0) * len(b.endpoints) for b in bs), 0)
            per = tuple((b.name, b.max_in_flight or 0) for b in bs)
            out[r.name] = PoolSpec(pool_name([b.name for b in bs]), -(-fixed // workers), per,
                                   workers, fixed)  # fmt: skip
        elif bs and adaptive:
            out[r.name] = PoolSpec(pool_name([b.name for b in bs]), 0)
    return out


class Weight:
    """A tenant's weight from a claim or header (a positive number), else the default."""

    __slots__ = ("kind", "name", "default")

    def __init__(self, source: str, default: float) -> None:
        kind, _, name = source.partition(":")
        self.kind, self.name, self.default = (
            kind,
            name.lower() if kind == "header" else name,
            default,
        )

    def of(self, headers: Mapping[str, str], claims: Mapping[str, Any] | None) -> float:
        v: Any = headers.get(self.name) if self.kind == "header" else (
            claims.get(self.name) if claims is not None else None)  # fmt: skip
        if v is None:
            return self.default
        try:
            w = float(v)
        except (TypeError, ValueError):
            return self.default
        return w if 0.0 < w <= 1e6 else self.default


def held_back(per: int, plan: Any) -> int:
    """The slots that a plan's members whose model server reports itself full do not give
    (`load.metrics`; `gateway.core.serverload.slots`)."""
    out = 0
    for lv in plan.levels:
        for m in lv.members:
            c = m.core
            rec = c.scrape
            if rec is not None and rec.full:
                out += per - slots(per, True, c.in_flight)
    return out


class AdmissionFilter:
    name = "admission"  # NAME (a literal: mypyc sets only literal defaults)

    def __init__(self, section: Admission, policy: CompiledPolicy, book: AdmissionBook,
                 lim: Limiter | None, members: BackendPool | None = None,
                 services: Services | None = None) -> None:  # fmt: skip
        self.book = book
        self.services = services
        p = policy.policy
        self.store = effective_store(p.store, p.rate_limits)
        self.lim = lim
        self.members = members
        self.now: Callable[[], float] = book.clock.now
        q = section.queue
        pr = section.priority
        share = pr.reserve.share if pr is not None and pr.reserve is not None else 0.0
        rank = pr.reserve_rank() if pr is not None else 0
        self.params = QueueParams(max_queued=q.max_queued, max_wait_s=q.max_wait_ms / 1000,
                                  max_tenants=section.fairness.max_tenants,
                                  anticipate_s=q.anticipate_ms / 1000, reserve_share=share,
                                  reserve_rank=rank)  # fmt: skip
        specs = pool_specs(policy, Settings.from_env().workers)
        self.specs = list({s.name: s for s in specs.values()}.values())
        self.pools: dict[str, PoolQueue] = {
            route: book.pool(s, self.params) for route, s in specs.items()
        }
        self.priority, self.top, self.lowest = priority_of(policy)
        f = section.fairness
        self.key = compile_key(f.key)
        self.c_in, self.c_out = f.cost.input, f.cost.output
        w = f.weights
        self.weight = Weight(w.source, w.default) if w is not None else None
        d = section.deadline
        self.deadline = d.header.lower() if d is not None else None
        self.hist: dict[tuple[str, int], Any] = {}

    def activate(self) -> None:
        slots = None
        if self.services is not None:
            fleet = fleet_for(self.services)
            fleet.configure(self.store)  # (the gateway did already; a no-op then)
            if fleet.mode != "none":
                slots = slots_for(self.services)  # max_in_flight is the fleet's
        self.book.activate(self.specs, self.params, slots)

    # -- request phase ------------------------------------------------------------------------
    def on_request(self, ctx: RequestContext) -> Status | Awaitable[Status]:
        route = ctx.route or first_route(ctx.policy.routes, ctx.info)
        if route is None:
            return _CONTINUE
        pq = self.pools.get(route.name)
        if pq is None:
            return _CONTINUE
        info = ctx.info
        headers = info.headers
        claims = ctx.claims
        prio = ctx.effective_class(self.priority, claims)
        now = self.now()
        deadline = None
        if self.deadline is not None:
            v = headers.get(self.deadline)
            if v is not None:
                try:
                    ms = float(v)
                except ValueError:
                    ms = -1.0
                if 0.0 <= ms <= MAX_DEADLINE_MS:
                    deadline = now + ms / 1000
        q = pq.q
        spec = pq.spec
        if spec.per_member and self.members is not None:
            self.follow(pq, now)
        if self.lim is not None:
            ps = self.lim.pools.get(pq.name)
            if ps is not None:
                if not spec.per_member:
                    pq.resize(int(ps.limit.limit), now)
                colour = ps.machine.colour
                if colour and q.waiting and self.top < self.lowest:
                    # As the limits shed arrivals (core.overload.sheds), from the queue's tail:
                    # yellow sheds the lowest class, red every class but the top.
                    keep = self.top if colour is Colour.RED else self.lowest - 1
                    for gone in q.shed(keep):
                        pq.refuse(gone, SHED)
        wt = self.weight.of(headers, claims) if self.weight is not None else 1.0
        w, evicted = q.arrive(q.tenant(self.key(info, claims, route.name, None), prio, wt),
                              prio, now, deadline)  # fmt: skip
        if evicted is not None:
            pq.refuse(evicted, QUEUE_FULL)
        if isinstance(w, str):
            return self._refuse(ctx, pq, w, prio)
        ctx.admission = (pq, w)
        if w.state == DISPATCHED:
            ctx.queue_wait = 0.0
            self._dispatched(pq, prio, 0.0)
            return _CONTINUE
        if pq.lease is not None:
            pq.lease.poke()  # the fleet's slots: ask the store for more before the next tick
        return self._wait(ctx, pq, w)

    async def _wait(self, ctx: RequestContext, pq: PoolQueue, w: Waiter) -> Status:
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        w.handle = fut
        try:
            reason = await asyncio.wait_for(fut, max(w.expires - w.arrived, 0.0))
        except TimeoutError:
            pq.q.leave(w)
            late = w.deadline is not None and w.expires >= w.deadline
            reason = DEADLINE_UNREACHABLE if late else QUEUE_TIMEOUT
        except asyncio.CancelledError:
            pq.q.leave(w)  # the client left: its place goes at once (a slot it got: on_response)
            ctx.queue_wait = self.now() - w.arrived
            raise
        waited = self.now() - w.arrived
        ctx.queue_wait = waited
        if reason is not None:
            return self._refuse(ctx, pq, reason, w.cls)
        self._dispatched(pq, w.cls, waited)
        ctx.decide(NAME, "dispatched", f"{pq.name}:{waited * 1000:.1f}ms")
        return _CONTINUE

    def follow(self, pq: PoolQueue, now: float) -> None:
        """A fixed pool's slots follow its members: `max_in_flight` × each backend's members in
        rotation (the balancer's plan: healthy, not ejected, breaker not open), the worker's
        share; a member that leaves takes its slots with it, and a member whose model server
        reports itself full (`load.metrics`, `gateway.core.serverload.slots`) keeps only the
        slots this gateway's requests hold on it. Recounted only when a backend's
        plan changed (the plans are cached objects). At least 1: with no member, a request goes
        on to the route's 503 at once rather than waiting."""
        assert self.members is not None
        latest = self.members.latest
        spec = pq.spec
        seen = pq.plans
        if len(seen) == 1 and len(spec.per_member) == 1:  # one backend: the common case
            view = latest.get(spec.per_member[0][0])
            if view is None or view.plan(now) is seen[0]:
                return
        changed = len(seen) != len(spec.per_member)
        plans = []
        held = 0  # slots that members whose server is full hold back
        for i, (backend, per_member) in enumerate(spec.per_member):
            view = latest.get(backend)
            if view is None:  # the route filter has not activated it yet
                return
            plan = view.plan(now)
            plans.append(plan)
            held += held_back(per_member, plan)
            if not changed and plan is not seen[i]:
                changed = True
        if not changed:
            return
        pq.plans = plans
        n = -held
        for (_, per), plan in zip(spec.per_member, plans, strict=True):
            n += per * sum((len(lv.members) for lv in plan.levels), 0)
        pq.size(n, now)

    def _dispatched(self, pq: PoolQueue, cls: int, waited: float) -> None:
        pq.dispatched += 1
        if waited:
            pq.waits.append((cls, waited))
        h = self.hist.get((pq.name, cls))
        if h is None:
            h = self.hist[(pq.name, cls)] = metrics.ADMISSION_WAIT.labels(pq.name, str(cls))
        h.observe(waited)

    def _refuse(self, ctx: RequestContext, pq: PoolQueue, reason: str, cls: int) -> Status:
        pq.refused[reason] += 1
        metrics.ADMISSION_REFUSED.labels(pq.name, str(cls), reason).inc()
        ctx.decide(NAME, "refuse", f"{pq.name}:{reason}")
        return ctx.stop(REFUSALS[reason])

    # -- response phase -----------------------------------------------------------------------
    def on_response(self, ctx: RequestContext) -> None:
        held = ctx.admission
        if held is None:
            return
        ctx.admission = None
        pq, w = held
        if w.state == WAITING:
            pq.q.leave(w)
            return
        if w.state != DISPATCHED:
            return
        now = self.now()
        first = ctx.first_token_at or ctx.first_byte_at
        served = first is not None
        u = ctx.usage
        if u is not None:
            cost = u.prompt_tokens * self.c_in + u.completion_tokens * self.c_out
        else:
            out = ctx.stream_events or ctx.bytes_out // 4
            cost = (ctx.bytes_in // 4) * self.c_in + out * self.c_out
        ttft = first - ctx.started - (ctx.queue_wait or 0.0) if first is not None else None
        pq.wake(pq.q.finish(w, now, float(cost), ttft, served), now)
        if pq.q.holds:
            pq.arm(now)


def build(section: CompiledPolicy, services: Services) -> AdmissionFilter | None:
    a = section.policy.admission
    if a is None:
        return None
    lim = limiter_for(services) if section.policy.rate_limits is not None else None
    members = services.get(BACKENDS, lambda: BackendPool(services))  # the route filter's
    return AdmissionFilter(a, section, admission_for(services), lim, members, services)
