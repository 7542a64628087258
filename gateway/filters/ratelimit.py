"""(compiled) Rate limits on the request path: QPS and colour in `on_request`, LLM tokens in the
body and response phases. Decisions are `gateway.core`'s; state is the services' `Limiter`.

- `on_request` (plain: it decides against local state and leased shares, never awaiting; only a
  `strict` rule with Redis up, or a request waiting in the yellow queue, hands back an
  awaitable): the priority class, the backend pool's colour, then each rule's key.
- `on_body`, `on_event` (`TokenRateLimitFilter`, built only when a rule limits tokens or is
  keyed by model): the token reservation and the stream's usage, in `ratelimit_tokens`.
- `on_response`: the reservation settled from `ctx.usage`, the pool's latency sample.
- The paths that wait (the yellow queue, `strict` Redis decisions): `ratelimit_wait`, through
  this filter's public steps (`ratelimit_steps.Steps`).

Refusals: 429 / RESOURCE_EXHAUSTED with Retry-After and `x-ratelimit-{limit,remaining,reset}-
{requests,tokens}`; shed by colour: 503 / UNAVAILABLE with Retry-After. A shadow rule
(`enforce: false`) decides as if enforced and counts what it would have refused.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, ClassVar, Final

from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.body import RequestBody
from gateway.core.keys import source_ip
from gateway.core.keystate import Code, KeyState
from gateway.core.outcome import Outcome
from gateway.core.overload import Colour, sheds
from gateway.core.request import Wire, first_route
from gateway.core.tokens import Reservation, estimate
from gateway.filters.ratelimit_steps import Rule, RuleStep, Ticket
from gateway.filters.ratelimit_tokens import on_body, on_event
from gateway.filters.ratelimit_wait import queued, strict
from gateway.policy.compiled import CompiledPolicy
from gateway.ratelimit.compiled import CompiledLimits, compile_limits
from gateway.ratelimit.owner import Limiter, limiter_for
from gateway.ratelimit.state import (
    ADMIT,
    REJECT_PRESSURE,
    REJECT_QPS,
    REJECT_TOKENS,
    SHADOW_REJECT,
    SHADOW_SHED,
    SHED_RED,
    SHED_YELLOW,
    STRICT_FALLBACK,
    PoolState,
    RuleState,
)
from gateway.ratelimit.verdicts import CONCURRENCY, REASON, refused, shed
from gateway.services import Services

NAME: Final = "ratelimit"
_ADMIT: Final = Code.ADMIT
_CONTINUE: Final = Status.CONTINUE
_COUNTER: Final = {Code.QPS: REJECT_QPS, Code.TOKENS: REJECT_TOKENS, Code.PRESSURE: REJECT_PRESSURE}


class RateLimitFilter:
    """The request and response phases; implements `ratelimit_steps.Steps` for the others."""

    name = "ratelimit"  # NAME (a literal: mypyc sets only literal defaults)

    def __init__(self, c: CompiledLimits, lim: Limiter) -> None:
        self.c = c
        self.lim = lim
        self.now = lim.now
        mk = c.section.max_keys
        self.early: tuple[Rule, ...] = tuple((r, lim.rule_state(r, mk)) for r in c.early)
        self.late: tuple[Rule, ...] = tuple((r, lim.rule_state(r, mk)) for r in c.late)
        self.top, self.lowest = c.top, c.lowest
        o = c.section.overload
        self.delay_s = o.yellow_delay_ms / 1000
        self.queue_size = o.queue_size
        self.red_deny = o.red_deny
        self.deny_after, self.deny_ttl = o.red_deny_after, o.red_deny_ttl_s
        self.default_max = c.section.default_max_tokens
        self.grpc_tokens = c.has_tokens  # gRPC requests reserve in the request phase
        # Only QPS rules, decided locally: the request holds nothing for the later phases.
        self.simple = not c.has_tokens and not c.late and not any(r.strict for r in c.rules)
        self.trailer = c.section.grpc_usage_trailer
        # on_body (the token filter's) reads a request without a body for model-keyed rules only.
        self.body_when_empty = bool(self.late)
        for _, rs in (*self.early, *self.late):
            rs.min_tokens = float(max(1, self.default_max))

    def activate(self) -> None:
        self.lim.activate(self.c, [rs for _, rs in (*self.early, *self.late)])
        for ps in self.lim.pools.values():
            ps.room = self.c.room

    # -- request phase ------------------------------------------------------------------------
    def on_request(self, ctx: RequestContext) -> Status | Awaitable[Status]:
        c = self.c
        info = ctx.info
        claims = ctx.claims
        prio = ctx.effective_class(c.priority, claims)
        route = None
        pool = None
        if c.needs_route:
            r = ctx.route or first_route(ctx.policy.routes, info)
            if r is not None:
                route = r.name
                if self.lim.pools:
                    pool = self.lim.pools.get(c.pool_of_route.get(route, ""))
        if pool is None and self.simple:
            return self.decide(ctx, None, self.early, 0, claims, route)  # nothing to hold
        t = Ticket(prio, claims, route)
        if pool is not None:
            colour = pool.machine.colour
            if colour and sheds(colour, prio, self.top, self.lowest):
                return self._shed(ctx, t, colour, "pool", pool.name)
            if pool.limit.in_flight >= pool.limit.limit and not c.queued:  # for every class
                self.lim.rejected(pool.name, "concurrency")
                ctx.decide(NAME, "shed", f"pool:{pool.name}:concurrency")
                return ctx.stop(CONCURRENCY)
            t.pool = pool
        return self.decide(ctx, t, self.early, 0, claims, route)

    def decide(
        self,
        ctx: RequestContext,
        t: Ticket | None,
        rules: tuple[Rule, ...],
        start: int,
        claims: Any,
        route: str | None,
    ) -> Status | Awaitable[Status]:
        """One step per rule of `rules` from `start`: find the key, count the arrival, move its
        colour and the peaks, mark it for the next sync (and wake the sync when a share it
        holds runs low); admit (the common case, inline), else `judge`. `strict` rules wait
        for Redis while it is up (decided after the local ones, `ratelimit_wait.strict`).

        `t` None: the request holds nothing for the later phases (`simple`: QPS rules decided
        locally, no pool), so no Ticket is made unless a rule does not simply admit; until then
        only the keys a later rule may need to undo are kept."""
        lim = self.lim
        now = self.now()
        info = ctx.info
        shared = lim.store is not None
        done: list[tuple[RuleState, str, KeyState]] | None = None
        last = len(rules) - 1
        for i in range(start, last + 1):
            rule, rs = rules[i]
            if rule.strict:
                if lim.mode == "redis":
                    if t is None:
                        t = Ticket(ctx.priority or 0, claims, route, done)
                    if t.strict is None:
                        t.strict = []
                    t.strict.append((rule, rs))
                    continue
                if shared:
                    rs.counts[STRICT_FALLBACK] += 1  # Redis away: decided here instead
            k = rule.key(info, claims, route, None)
            keys = rs.keys
            ks = keys.get(k)
            if ks is None:
                ks = rs.key(k, now)
            else:
                keys.move_to_end(k)
            code = ks.request(rule.math, rs.scale, now)
            if ks.q > rs.peak_q:
                rs.peak_q = ks.q
            if ks.t > rs.peak_t:
                rs.peak_t = ks.t
            if ks.changed is not None:
                self.recoloured(rs, k, ks)
            if shared:
                rs.dirty[k] = ks
                # The share runs low: sync now (a token share only where the rule has tokens).
                if ks.leased and (ks.req_share < 1.0 or (rule.has_t and ks.tok_share <= 0.0)):
                    lim.wake.set()
            if code is _ADMIT and not ks.colour:  # the common case, inline
                rs.counts[ADMIT] += 1
                if t is not None:
                    t.entries.append((rs, k, ks))
                elif i < last:  # kept only to be undone if a later rule stops the request
                    if done is None:
                        done = []
                    done.append((rs, k, ks))
                continue
            if t is None:
                t = Ticket(ctx.priority or 0, claims, route, done)
            status = self.judge(ctx, t, RuleStep(rule, rs, ks, code, now), rules, i)
            if status is not None:
                return status
        if t is None:
            return _CONTINUE  # every rule admitted it and nothing is held
        if t.strict:
            return strict(self, ctx, t)
        if t.pool is None and (not self.grpc_tokens or ctx.info.protocol is not Wire.GRPC):
            ctx.reservation = t  # what `admitted` does for it, without the call
            return _CONTINUE
        return self.admitted(ctx, t)

    def resume(
        self, ctx: RequestContext, t: Ticket, rules: tuple[Rule, ...], start: int
    ) -> Status | Awaitable[Status]:
        return self.decide(ctx, t, rules, start, t.claims, t.route)

    def judge(
        self, ctx: RequestContext, t: Ticket, step: RuleStep, rules: tuple[Rule, ...], i: int
    ) -> Status | Awaitable[Status] | None:
        """None: go on with the next rule; else what the request gets now."""
        rule, rs, ks, code = step.rule, step.rs, step.ks, step.code
        colour = ks.colour
        if colour and sheds(colour, t.prio, self.top, self.lowest):
            if code is Code.ADMIT:
                ks.undo()
            if rule.enforce:
                return self._shed(ctx, t, colour, "key", rule.name, rs)
            rs.counts[SHADOW_SHED] += 1
            return None
        if code is Code.ADMIT:
            rs.counts[ADMIT] += 1
            t.entries.append((rs, ks.name, ks))
            return None
        if not rule.enforce:
            rs.counts[SHADOW_REJECT] += 1
            ctx.decide(NAME, "shadow_reject", rule.name)
            return None
        if (
            colour is Colour.YELLOW
            and self.delay_s > 0
            and self.lim.waiting < self.queue_size
            and rules is self.early
        ):
            return queued(self, ctx, t, step, rules, i)
        return self.refuse(ctx, t, step)

    def admitted(self, ctx: RequestContext, t: Ticket) -> Status:
        ctx.reservation = t
        if t.pool is not None:
            t.pool.limit.start()
            self._pool_moved(t.pool)
        if self.grpc_tokens and ctx.info.protocol is Wire.GRPC:
            # gRPC bodies are not parsed: reserve the default estimate.
            return self.reserve(ctx, t, estimate(0, None, self.default_max), 0)
        return Status.CONTINUE

    # -- refusals -----------------------------------------------------------------------------
    def _undo(self, t: Ticket) -> None:
        for rs, _, ks in t.entries:
            ks.undo()
            rs.counts[ADMIT] -= 1
        t.entries.clear()
        if t.tokens is not None:
            for rs, _, ks in t.tokens.entries:
                ks.settle(rs.math, rs.scale, float(t.tokens.reserved))
            t.tokens = None

    def refuse(self, ctx: RequestContext, t: Ticket, step: RuleStep) -> Status:
        rule, rs, code = step.rule, step.rs, step.code
        self._undo(t)
        if ctx.reservation is t:
            self._release(ctx, t)
        rs.counts[_COUNTER[code]] += 1
        self.lim.rejected(rule.name, REASON[code])
        ctx.decide(NAME, "reject", f"{rule.name}:{REASON[code]}")
        return ctx.stop(refused(rule, step.ks, code, rs.scale, step.now))

    def _shed(
        self,
        ctx: RequestContext,
        t: Ticket,
        colour: Colour,
        scope: str,
        name: str,
        rs: RuleState | None = None,
    ) -> Status:
        self._undo(t)
        if ctx.reservation is t:
            self._release(ctx, t)
        if rs is not None:
            rs.counts[SHED_RED if colour is Colour.RED else SHED_YELLOW] += 1
        self.lim.rejected(name, f"shed_{colour.label}")
        ctx.decide(NAME, "shed", f"{scope}:{name}:{colour.label}")
        if colour is Colour.RED and self.red_deny:
            self.lim.shed_source(source_ip(ctx.info.peer), self.deny_after, self.deny_ttl)
        return ctx.stop(shed(colour, ctx.priority or 0))

    # -- body phase: tokens -------------------------------------------------------------------
    def reserve(self, ctx: RequestContext, t: Ticket, cost: int, prompt: int) -> Status:
        res = t.tokens = Reservation(cost, prompt)
        ctx.wants_events = True  # reconciled from the answer's usage: parse it for on_event
        now = self.now()
        amount = float(cost)
        held = res.entries
        for e in t.entries:
            rs, _, ks = e
            rule = rs.rule
            if not rule.has_t:
                continue
            if ks.reserve(rule.math, rs.scale, now, amount):
                held.append(e)
                rs.tokens[0] += cost
                continue
            if not rule.enforce:
                rs.counts[SHADOW_REJECT] += 1
                continue
            rs.counts[ADMIT] -= 1  # counted at the request phase; refused now
            return self.refuse(ctx, t, RuleStep(rule, rs, ks, Code.TOKENS, now))
        if self.lim.store is not None:
            for rs, k, ks in res.entries:
                rs.dirty[k] = ks
                if ks.leased and ks.tok_share <= 0.0:
                    self.lim.wake.set()
        return Status.CONTINUE

    # -- response phase -----------------------------------------------------------------------
    def on_response(self, ctx: RequestContext) -> None:
        t = ctx.reservation
        if t is None or (t.pool is None and t.tokens is None and ctx.outcome is Outcome.OK):
            return  # nothing reserved, nothing to give back: the common QPS-only case
        if not isinstance(t, Ticket):
            return
        if t.pool is not None:
            self._release(ctx, t)
        outcome = ctx.outcome
        started = outcome is Outcome.OK or ctx.first_byte_at is not None
        res = t.tokens
        if res is not None and not res.settled:
            res.settled = True
            diff = float(res.difference(ctx.usage, started))
            if diff:
                shared = self.lim.store is not None
                side = 1 if diff > 0 else 2
                size = abs(diff)
                for rs, k, ks in res.entries:
                    ks.settle(rs.math, rs.scale, diff)
                    rs.tokens[side] += size
                    if shared:
                        rs.dirty[k] = ks
        if not started and outcome is Outcome.REJECTED:
            for _, _, ks in t.entries:  # a later filter refused it: it never counted
                ks.undo()

    def _release(self, ctx: RequestContext, t: Ticket) -> None:
        pool = t.pool
        if pool is None:
            return
        t.pool = None
        latency = None
        if ctx.first_byte_at is not None:  # from the dispatch: a wait in the queue is not latency
            latency = ctx.first_byte_at - ctx.started - (ctx.queue_wait or 0.0)
        elif ctx.outcome is Outcome.OK or ctx.outcome.upstream_failed:
            latency = ctx.elapsed
        pool.limit.finish(latency, self.now())
        self._pool_moved(pool)

    # -- colours ------------------------------------------------------------------------------
    def recoloured(self, rs: RuleState, k: str, ks: KeyState) -> None:
        old = ks.changed
        assert old is not None
        rs.recolour(k, ks)
        self.lim.colour_changed("key", f"{rs.rule.name}[{k}]", old, ks.colour)

    def _pool_moved(self, pool: PoolState) -> None:
        old = pool.machine.colour
        new = pool.observe(self.now())
        if new is not None:
            self.lim.colour_changed("pool", pool.name, old, new)


class TokenRateLimitFilter(RateLimitFilter):
    """The same, with the body and event phases (`gateway.filters.ratelimit_tokens`). Its
    on_event matters only to a request with a token reservation, which asks for the response
    phase itself (`ctx.wants_events`): an answer to any other is not parsed for it."""

    events_when_asked = True
    # A JSON answer settles from `ctx.usage` (in on_response): no head or JSON event for it.
    event_kinds: ClassVar[frozenset[EventKind]] = frozenset({EventKind.SSE, EventKind.TRAILERS})

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        return on_body(self, ctx, body)

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        return on_event(self, ctx, event)


def build(section: CompiledPolicy, services: Services) -> RateLimitFilter | None:
    rl = section.policy.rate_limits
    if rl is None or (not rl.rules and rl.concurrency is None):
        return None
    c = compile_limits(rl, section)
    if c.has_tokens or c.late:
        return TokenRateLimitFilter(c, limiter_for(services))
    return RateLimitFilter(c, limiter_for(services))
