"""(compiled) Routing: the first matching route, then a member of one of its backends, chosen by the
pure balancer (`gateway.core.balancer`) over the live member state the services keep
(`gateway.registry.pool`); each try's result flows back to that state.

The forwarding path calls, for each request:
- `on_request` (the chain): picks the first member (`ctx.endpoint`, `ctx.upstream_attempt`);
- `ctx.upstream_attempt.next_try(ctx)` (`gateway.registry.member.Attempt`, through
  `gateway.forward.lifecycle.retry`) after a failed try, with `ctx.outcome` / `ctx.http_status`
  / `ctx.grpc_status` / `ctx.first_byte_at` describing it: `RoutePicker.retry_pick` returns the
  next endpoint when a retry is safe and within the route's budget (the failed try is reported
  first), else None;
- `on_response` (the chain, always): reports the last try (outcome, time to first byte) to the
  member's breaker, outlier record and passive health, and to the route's canary guard.

The canary override header (`canary.override_header`): `1`, `true` or `canary` sends the request
to the canary even while it is guarded (an explicit opt-in, e.g. a tester); `0`, `false` or
`stable` keeps it off the canary.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from gateway.context import RequestContext, Status
from gateway.core.balancer import SmoothWeightedRoundRobin, hash_key, split_sticky
from gateway.core.canary import CanaryGuard
from gateway.core.clock import reader
from gateway.core.models import ALL
from gateway.core.outcome import Outcome
from gateway.core.request import first_route
from gateway.core.retry import RetryBudget, RetryParams, retriable
from gateway.core.verdict import NO_ENDPOINT, NO_ROUTE
from gateway.filters.choice import MAX_SERVED, Choice, Served, Servings, admits
from gateway.registry.member import Attempt, Member, Result
from gateway.registry.pool import BACKENDS, BackendPool
from gateway.registry.view import BackendView
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.policy.compiled import CompiledPolicy, CompiledRoute, Endpoint
    from gateway.services import Services

log: Final = logging.getLogger("sluice.routing")

_MISSING: Final = object()  # not in the picker's `served` cache

CANARY_ON: Final = frozenset({"1", "true", "canary", "yes"})
CANARY_OFF: Final = frozenset({"0", "false", "stable", "no"})
_PROBE_MASK: Final = 0xFF


class RoutePicker:
    """One route's split and choice, built per policy over the pool's long-lived state."""

    __slots__ = (
        "route", "groups", "weights", "swrr", "canary", "guard", "budget", "override", "sticky",
        "retry", "now", "models", "prefix_bytes", "load_factor", "served", "served_epoch",
        "book",
    )  # fmt: skip

    def __init__(self, route: CompiledRoute, policy: CompiledPolicy, pool: BackendPool) -> None:
        self.route = route
        self.groups: tuple[BackendView, ...] = tuple(
            pool.view(policy.backends[n]) for n, _ in route.targets
        )
        self.weights = tuple(float(w) for _, w in route.targets)
        # by_model: what each backend serves (None: any model, it has no `models` section).
        self.models = tuple(g.models for g in self.groups) if route.by_model else ()
        self.prefix_bytes = route.prefix_bytes
        self.load_factor = route.load_factor
        # serving() answers by model, while no listing or membership changed (bounded).
        self.served: dict[str, Served | None] = {}
        self.served_epoch = -1
        self.book = next((mv.book for mv in self.models if mv is not None), None)
        self.swrr = SmoothWeightedRoundRobin(self.weights)
        self.now = reader(pool.clock)  # the pool's clock, as a plain function
        c = route.canary
        names = [n for n, _ in route.targets]
        self.canary = names.index(c.backend) if c is not None else -1
        self.guard: CanaryGuard | None = pool.guard(route.name, c, route.targets)
        self.override = c.override_header.lower() if c and c.override_header else None
        self.sticky = route.sticky.header.lower() if route.sticky is not None else None
        r = route.retries
        self.retry = (
            None
            if r is None
            else RetryParams(
                attempts=r.attempts,
                budget_ratio=r.budget_ratio,
                min_retries=r.min_retries,
                per_try_timeout_s=r.per_try_timeout_s,
                on_connect_failure="connect_failure" in r.retry_on,
                on_unavailable="unavailable" in r.retry_on,
                before_first_token=r.before_first_token,
            )
        )
        self.budget: RetryBudget | None = (
            pool.budget(route.name, r.budget_ratio, r.min_retries) if r is not None else None
        )

    # --- choice --------------------------------------------------------------------------------
    def _split(self, headers: Mapping[str, str], key: int | None, now: float) -> list[float]:
        weights = list(self.weights)
        c = self.canary
        if c >= 0:
            guard = self.guard
            if guard is not None and guard.tripped:
                weights[c] = 0.0
            if self.override is not None:
                v = headers.get(self.override)
                if v is not None:
                    v = v.strip().lower()
                    if v in CANARY_ON:
                        return [1.0 if i == c else 0.0 for i in range(len(weights))]
                    if v in CANARY_OFF:
                        weights[c] = 0.0
        for i, st in enumerate(self.groups):
            if weights[i] > 0 and st.plan(now).empty:
                weights[i] = 0.0  # nothing left there: its share goes to the others
        return weights

    def effective_weights(self, now: float) -> dict[str, float]:
        """The split as it stands (guard and empty backends applied), for state and metrics."""
        weights = self._split({}, None, now)
        return {st.name: w for st, w in zip(self.groups, weights, strict=True)}

    def serving(self, model: str) -> Served | None:
        """Who serves `model` in each backend of the split (by_model routes), and who would
        load it (an adapter's parent's members, per backend; None when none would), or None
        when no backend serves it."""
        book = self.book
        epoch = book.epoch if book is not None else 0
        served = self.served
        if epoch != self.served_epoch or len(served) >= MAX_SERVED:
            served.clear()
            self.served_epoch = epoch
        else:
            got = served.get(model, _MISSING)
            if got is not _MISSING:
                return got  # type: ignore[return-value]
        out = tuple(
            ALL if mv is None else mv.index().serving(model) for mv in self.models
        )  # fmt: skip
        res: Served | None = None
        if any(x is not None for x in out):
            fb = None
            if any(x is not None and x.fallback is not None for x in out):
                fb = tuple(x.fallback if x is not None else None for x in out)
            res = (out, fb)
        served[model] = res
        return res

    def first(
        self, ctx: RequestContext, now: float, choice: Choice | None = None
    ) -> Attempt | None:
        headers = ctx.info.headers
        key = None
        if self.sticky is not None:
            v = headers.get(self.sticky)
            if v:
                key = hash_key(v)
        groups = self.groups
        if choice is None:
            if len(groups) == 1:
                got = groups[0].take(now, key)
                g = 0
            else:
                weights = self._split(headers, key, now)
                g_ = split_sticky(weights, key) if key is not None else self.swrr.pick_with(weights)
                if g_ is None:
                    return None
                g = g_
                got = groups[g].take(now, key)
                if got is None:
                    for i, w in enumerate(weights):
                        if i != g and w > 0:
                            got = groups[i].take(now, key)
                            if got is not None:
                                g = i
                                break
        else:
            if key is not None:
                choice.prefix = None  # the sticky header wins over the prompt's prefix
            got, g = self._choose(choice, headers, key, now, ())
        if got is None:
            return None
        a = self._attempt(ctx, got[0], got[1], now, g)
        a.choice = choice
        budget = self.budget
        if budget is not None:
            budget.active += 1
        return a

    def _choose(
        self,
        c: Choice,
        headers: Mapping[str, str],
        key: int | None,
        now: float,
        tried: tuple[Member, ...],
        skip: int = -1,
    ) -> tuple[tuple[Member, int] | None, int]:
        """A member for a request routed on its body (model, prompt prefix): the backend by
        the split among those serving the model (by the key when there is one), then the
        member among those serving it; another serving backend when that one has none."""
        groups = self.groups
        sv = c.servings
        live = [0] if len(groups) == 1 else [i for i, s in enumerate(sv) if s] if sv else []
        weights: list[float] = [1.0]
        if len(live) != 1:  # the split between the backends that serve the model
            weights = self._split(headers, key, now)
            if sv is not None:
                weights = [w if sv[i] is not None else 0.0 for i, w in enumerate(weights)]
            live = [i for i, w in enumerate(weights) if w > 0]
        if skip >= 0:
            order = [skip]
        elif len(live) == 1:
            order = live  # one backend serves the model: no split to make
        else:
            k = key if key is not None else c.prefix
            g_ = split_sticky(weights, k) if k is not None else self.swrr.pick_with(weights)
            if g_ is None:
                return None, 0
            order = [g_]
        if len(live) > 1 or skip >= 0:
            order += [i for i in live if i != order[0]]
        tiers: tuple[Servings | None, ...] = (sv,) if c.fallback is None else (sv, c.fallback)
        for tier in tiers:  # an adapter's loaded members first, then its parent's
            for g in order:
                s = tier[g] if tier is not None else None
                if tier is not None and s is None:
                    continue
                members = s.members if s is not None else None
                ok = None
                if members is not None or tried:
                    ok = admits(members, tried)
                got = groups[g].take(now, key, ok=ok, prefix=c.prefix,
                                     load_factor=self.load_factor, keep=not tried)  # fmt: skip
                if got is not None:
                    return got, g
        return None, 0

    def _attempt(self, ctx: RequestContext, m: Member, ticket: int, now: float, g: int) -> Attempt:
        m.core.in_flight += 1
        a = Attempt(self, m, ticket, now, g)
        if ticket & _PROBE_MASK and m.box is not None:
            m.box.probes[ticket] = a
            a.ctx = ctx
        return a

    def retry_pick(self, ctx: RequestContext, a: Attempt) -> Endpoint | None:
        p = self.retry
        if p is None or len(a.tried) + 1 >= p.attempts:
            return None
        responded = ctx.first_byte_at is not None
        if not retriable(p, ctx.outcome, ctx.http_status, ctx.grpc_status, responded):
            return None
        now = self.now()
        self.close(a, ctx, now)
        budget = self.budget
        name = self.route.name
        if budget is None or not budget.try_acquire():
            metrics.RETRIES.labels(name, "budget_exhausted").inc()
            return None
        tried = (*a.tried, a.member)
        key = None
        if self.sticky is not None:
            v = ctx.info.headers.get(self.sticky)
            key = hash_key(v) if v else None
        choice: Choice | None = a.choice
        if choice is not None:
            got, g = self._choose(choice, ctx.info.headers, key, now, tried, a.group)
        else:
            got = self.groups[a.group].take(now, key, tried)
            g = a.group
        if got is None and choice is None and len(self.groups) > 1:
            weights = self._split(ctx.info.headers, key, now)
            for i, w in enumerate(weights):
                if i != a.group and w > 0:
                    got = self.groups[i].take(now, key, tried)
                    if got is not None:
                        g = i
                        break
        if got is None:
            budget.release()
            metrics.RETRIES.labels(name, "no_member").inc()
            return None
        na = self._attempt(ctx, got[0], got[1], now, g)
        na.retry = True
        na.tried = tried
        na.choice = choice
        ctx.upstream_attempt = na
        ctx.endpoint = na.member.endpoint
        # The next try starts clean: its own outcome and status.
        ctx.outcome = Outcome.OK
        ctx.http_status = 0
        ctx.grpc_status = None
        ctx.detail = ""
        metrics.RETRIES.labels(name, "attempted").inc()
        ctx.decide("route", "route.retry", na.member.address)
        return na.member.endpoint

    # --- results -------------------------------------------------------------------------------
    def close(self, a: Attempt, ctx: RequestContext, now: float) -> None:
        """Report a try once: to its member's state and the route's canary guard."""
        if a.done:
            return
        a.done = True
        st = self.groups[a.group]
        c = a.choice
        if c is not None and c.prefix is not None:
            st.prefixes.finished(c.prefix, now)
        res, ttfb = st.report(a, now, ctx.outcome, ctx.http_status, ctx.grpc_status,
                              ctx.first_byte_at)  # fmt: skip
        if a.retry:
            budget = self.budget
            if budget is not None:
                budget.release()
        guard = self.guard
        tripped = (
            guard is not None
            and res is not Result.IGNORED
            and guard.record(now, a.group == self.canary, ttfb, res is Result.FAILED)
        )
        if tripped:
            assert guard is not None
            backend = self.groups[self.canary].name
            metrics.CANARY_TRIPS.labels(self.route.name, backend).inc()
            log.warning("canary guard tripped: route=%s backend=%s weight -> 0 (%s); a policy "
                        "change to the route's canary or weights brings it back",
                        self.route.name, backend, guard.reason)  # fmt: skip

    def finish(self, ctx: RequestContext, a: Attempt) -> None:
        if not a.done:
            self.close(a, ctx, self.now())
        budget = self.budget
        if budget is not None and budget.active > 0:
            budget.active -= 1

    def state(self, now: float) -> dict[str, object]:
        out: dict[str, object] = {"weights": self.effective_weights(now)}
        if self.guard is not None:
            backend = self.groups[self.canary].name
            out["canary"] = {"backend": backend, **self.guard.snapshot(now)}
        if self.budget is not None:
            out["retry_budget"] = self.budget.snapshot()
        return out


class RouteFilter:
    name = "route"

    def __init__(self, policy: CompiledPolicy, pool: BackendPool | None = None) -> None:
        self.policy = policy
        private = pool is None
        if pool is None:  # a filter of its own (tests, tools): private state, live at once
            from gateway.services import Services

            pool = BackendPool(Services())
        self.pool = pool
        self.pickers = {r.name: RoutePicker(r, policy, pool) for r in policy.routes}
        self.views = [pool.view(b) for b in policy.policy.backends]
        self.now = reader(pool.clock)  # the pool's clock, as a plain function
        if private:
            self.activate()

    def activate(self) -> None:
        self.pool.activate(self.views, self.pickers)

    def on_request(self, ctx: RequestContext) -> Status:
        # An earlier filter of this chain (auth) may have matched it already: the same policy.
        route = ctx.route or first_route(self.policy.routes, ctx.info)
        if route is None:
            return ctx.stop(NO_ROUTE)
        ctx.route = route
        if not self.pool.started:
            self.pool.start()
        a = self.pickers[route.name].first(ctx, self.now())
        if a is None:
            return ctx.stop(NO_ENDPOINT)
        ctx.upstream_attempt = a
        ctx.endpoint = a.member.endpoint
        return Status.CONTINUE

    def on_response(self, ctx: RequestContext) -> None:
        a = ctx.upstream_attempt
        if a is not None:
            a.picker.finish(ctx, a)


def build(section: CompiledPolicy, services: Services) -> RouteFilter:
    """Without body routing (the registry builds the route filter through
    `gateway.filters.model_routing.build`, which picks this or the model-aware one)."""
    return RouteFilter(section, services.get(BACKENDS, lambda: BackendPool(services)))
