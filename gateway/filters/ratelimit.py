"""Rate limits on the request path: QPS and colour in `on_request`, LLM tokens in the body and
response phases. Decisions are `gateway.core`'s; state is the services' `Limiter`.

- `on_request` (plain: it decides against local state and leased shares, never awaiting;
  only a `strict` rule with Redis up, or a request waiting in the yellow queue, hands back
  an awaitable): the priority class, the backend pool's colour, then each rule's key:
  arrival counted, colour moved, admit / shed / refuse.
- `on_body` (HTTP): model-keyed rules, then the token reservation (prompt / 4 + max_tokens,
  or the policy default); a stream is asked for its usage chunk if the client did not ask
  (`body.usage_added`: the forwarding path hides that chunk from the client).
- `on_event`: completion tokens of each SSE chunk (an overrun is cut when the rule says
  `on_overrun: cut`), the gRPC usage trailer.
- `on_response`: the reservation settled from `ctx.usage`, the pool's latency sample.

Refusals: 429 / RESOURCE_EXHAUSTED with Retry-After and `x-ratelimit-{limit,remaining,reset}-
{requests,tokens}` (HTTP headers; gRPC trailing metadata); shed by colour: 503 / UNAVAILABLE
with Retry-After. A shadow rule (`enforce: false`) decides exactly as if it were enforced and
counts what it would have refused; the request goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from gateway.core.body import RequestBody
from gateway.core.keys import source_ip
from gateway.core.keystate import Code, KeyState, strict_seen
from gateway.core.outcome import Outcome
from gateway.core.overload import Colour, sheds
from gateway.core.request import Protocol
from gateway.core.tokens import Reservation, estimate, usage_from_trailer
from gateway.core.verdict import GRPC_RESOURCE_EXHAUSTED, GRPC_UNAVAILABLE, Verdict, reject
from gateway.errors import StoreUnavailable
from gateway.filters.base import EventKind, RequestContext, Status, StreamEvent
from gateway.policy.compiled import CompiledPolicy
from gateway.ratelimit.compiled import CompiledLimits, CompiledRule, compile_limits
from gateway.ratelimit.owner import Limiter, limiter_for
from gateway.ratelimit.state import (
    ADMIT,
    QUEUED,
    REJECT_PRESSURE,
    REJECT_QPS,
    REJECT_TOKENS,
    SHADOW_REJECT,
    SHADOW_SHED,
    SHED_RED,
    SHED_YELLOW,
    STRICT_FALLBACK,
    TOKEN_CUT,
    PoolState,
    RuleState,
)
from gateway.services import Services
from gateway.store.base import SyncOp, key_name

NAME = "ratelimit"
_ADMIT = Code.ADMIT
_CONTINUE = Status.CONTINUE
_OK = Outcome.OK
_COUNTER = {Code.QPS: REJECT_QPS, Code.TOKENS: REJECT_TOKENS, Code.PRESSURE: REJECT_PRESSURE}
_REASON = {Code.QPS: "qps", Code.TOKENS: "tokens", Code.PRESSURE: "pressure"}
SHED_RETRY_S = {Colour.YELLOW: 1.0, Colour.RED: 2.0}

Rule = tuple[CompiledRule, RuleState]


class Ticket:
    """What one request holds of the limiter (in `ctx.reservation`)."""

    __slots__ = ("entries", "tokens", "pool", "prio", "claims", "route", "strict")

    def __init__(self, prio: int, claims: Any, route: str | None) -> None:
        self.entries: list[tuple[RuleState, str, KeyState]] = []  # rules that admitted it
        self.tokens: Reservation | None = None
        self.pool: PoolState | None = None
        self.prio = prio
        self.claims = claims
        self.route = route
        self.strict: list[Rule] | None = None


class RateLimitFilter:
    name = NAME

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
        for _, rs in (*self.early, *self.late):
            rs.min_tokens = float(max(1, self.default_max))

    def activate(self) -> None:
        self.lim.activate(self.c)

    # -- request phase ------------------------------------------------------------------------
    def on_request(self, ctx: RequestContext) -> Status | Awaitable[Status]:
        c = self.c
        info = ctx.info
        p = ctx.principal
        claims = p.claims if p is not None else None
        prio = ctx.priority
        if prio is None:
            pf = c.priority
            prio = ctx.priority = pf.of(info.headers, claims) if pf is not None else 0
        route = None
        pool = None
        if c.needs_route:
            r = ctx.route or ctx.policy.match(info)
            if r is not None:
                route = r.name
                if self.lim.pools:
                    pool = self.lim.pools.get(c.pool_of_route.get(route, ""))
        if pool is None and self.simple:
            return self._fast(ctx, prio, claims, route)
        t = Ticket(prio, claims, route)
        if pool is not None:
            colour = pool.machine.colour
            if colour and sheds(colour, prio, self.top, self.lowest):
                return self._shed(ctx, t, colour, "pool", pool.name)
            if pool.limit.in_flight >= pool.limit.limit:  # the hard limit, for every class
                self.lim.rejected(pool.name, "concurrency")
                ctx.decide(NAME, "shed", f"pool:{pool.name}:concurrency")
                return ctx.stop(_CONCURRENCY)
            t.pool = pool
        return self._rules(ctx, t, self.early, 0)

    def _fast(
        self, ctx: RequestContext, prio: int, claims: Any, route: str | None
    ) -> Status | Awaitable[Status]:
        """QPS-only rules, no pool: nothing to hold for later phases, so no Ticket unless a
        rule refuses or sheds (then `_rules` takes over from there). Same steps as `_rules`."""
        lim = self.lim
        now = self.now()
        info = ctx.info
        shared = lim.store is not None
        rules = self.early
        done: list[tuple[RuleState, str, KeyState]] | None = None
        for i in range(len(rules)):
            rule, rs = rules[i]
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
                self._recoloured(rs, k, ks)
            if shared:
                rs.dirty[k] = ks
                if ks.leased and ks.req_share < 1.0:
                    lim.wake.set()
            if code is _ADMIT and not ks.colour:
                rs.counts[ADMIT] += 1
                if i + 1 < len(rules):
                    if done is None:
                        done = []
                    done.append((rs, k, ks))
                continue
            t = Ticket(prio, claims, route)
            if done:
                t.entries = done
            status = self._judge(ctx, t, rule, rs, ks, code, now, rules, i)
            if status is not None:
                return status
            return self._rules(ctx, t, rules, i + 1)
        return _CONTINUE

    def _rules(
        self, ctx: RequestContext, t: Ticket, rules: tuple[Rule, ...], start: int
    ) -> Status | Awaitable[Status]:
        lim = self.lim
        now = self.now()
        info = ctx.info
        shared = lim.store is not None
        redis_up = lim.mode == "redis"
        for i in range(start, len(rules)):
            rule, rs = rules[i]
            if rule.strict:
                if redis_up:
                    if t.strict is None:
                        t.strict = []
                    t.strict.append((rule, rs))
                    continue
                if shared:
                    rs.counts[STRICT_FALLBACK] += 1  # Redis away: decided here instead
            k = rule.key(info, t.claims, t.route, None)
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
                self._recoloured(rs, k, ks)
            if shared:
                rs.dirty[k] = ks
                if ks.leased and (ks.req_share < 1.0 or ks.tok_share <= 0.0):
                    lim.wake.set()  # the share runs low: sync now
            if code is _ADMIT and not ks.colour:  # the common case, inline
                rs.counts[ADMIT] += 1
                t.entries.append((rs, k, ks))
                continue
            status = self._judge(ctx, t, rule, rs, ks, code, now, rules, i)
            if status is not None:
                return status
        if t.strict:
            return self._strict(ctx, t)
        if t.pool is None and not self.grpc_tokens:
            ctx.reservation = t
            return _CONTINUE
        return self._admitted(ctx, t)

    def _judge(
        self,
        ctx: RequestContext,
        t: Ticket,
        rule: CompiledRule,
        rs: RuleState,
        ks: KeyState,
        code: Code,
        now: float,
        rules: tuple[Rule, ...],
        i: int,
    ) -> Status | Awaitable[Status] | None:
        """None: go on with the next rule; else what the request gets now."""
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
            return self._queued(ctx, t, rule, rs, ks, code, rules, i)
        return self._refuse(ctx, t, rule, rs, ks, code, now)

    async def _queued(
        self,
        ctx: RequestContext,
        t: Ticket,
        rule: CompiledRule,
        rs: RuleState,
        ks: KeyState,
        code: Code,
        rules: tuple[Rule, ...],
        i: int,
    ) -> Status:
        """Yellow: wait (bounded) for room instead of refusing at once."""
        lim = self.lim
        lim.waiting += 1
        rs.counts[QUEUED] += 1
        deadline = self.now() + self.delay_s
        try:
            while True:
                now = self.now()
                wait = ks.retry_after(rule.math, rs.scale, now, code)
                if wait > deadline - now:
                    return self._refuse(ctx, t, rule, rs, ks, code, now)
                await asyncio.sleep(max(wait, 0.001))
                now = self.now()
                ks.unoffer()
                code = ks.request(rule.math, rs.scale, now)
                if code is Code.ADMIT:
                    break
        finally:
            lim.waiting -= 1
        status = self._judge(ctx, t, rule, rs, ks, code, now, rules, i)
        if status is None:
            status = self._rules(ctx, t, rules, i + 1)
        if not isinstance(status, Status):
            status = await status
        return status

    async def _strict(self, ctx: RequestContext, t: Ticket) -> Status:
        """`strict` rules: one Redis decision each (deadline bound); local when Redis fails."""
        lim = self.lim
        store, cfg = lim.store, lim.store_cfg
        assert t.strict is not None and store is not None and cfg is not None
        grpc_cost = (
            float(estimate(0, None, self.default_max))
            if ctx.info.protocol is Protocol.GRPC
            else 0.0
        )
        for rule, rs in t.strict:
            now = self.now()
            k = rule.key(ctx.info, t.claims, t.route, None)
            ks = rs.key(k, now)
            if ks.rkey is None:
                ks.rkey = key_name(cfg.key_prefix, rule.name, rule.params, k)
            op = SyncOp(ks.rkey, rule.params, offered=1.0, want_req=1.0, strict=True)
            op.want_tok = grpc_cost if rule.has_t else 0.0
            try:
                res = await store.take(op) if lim.mode == "redis" else None
            except StoreUnavailable as exc:
                lim.fallback(str(exc))
                res = None
            now = self.now()
            if res is None:
                rs.counts[STRICT_FALLBACK] += 1  # this request's call failed: decided here
                code = ks.request(rule.math, rs.scale, now)
            else:
                code = Code.ADMIT if res.granted_req >= 1.0 else Code.QPS
                strict_seen(ks, rule.math, now, code is Code.ADMIT, res.admitted, res.offered,
                            res.tokens)  # fmt: skip
                if code is Code.ADMIT and op.want_tok:
                    ks.tok_unleased -= op.want_tok  # charged by the take itself
            if ks.changed is not None:
                self._recoloured(rs, k, ks)
            rs.dirty[k] = ks
            status = self._judge(ctx, t, rule, rs, ks, code, now, (), 0)
            if status is not None:
                if not isinstance(status, Status):
                    status = await status
                return status
        return self._admitted(ctx, t)

    def _admitted(self, ctx: RequestContext, t: Ticket) -> Status:
        ctx.reservation = t
        if t.pool is not None:
            t.pool.limit.start()
            self._pool_moved(t.pool)
        if self.grpc_tokens and ctx.info.protocol is Protocol.GRPC:
            # gRPC bodies are not parsed: reserve the default estimate.
            return self._reserve(ctx, t, estimate(0, None, self.default_max), 0)
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

    def _refuse(
        self,
        ctx: RequestContext,
        t: Ticket,
        rule: CompiledRule,
        rs: RuleState,
        ks: KeyState,
        code: Code,
        now: float,
    ) -> Status:
        self._undo(t)
        if ctx.reservation is t:
            self._release(ctx, t)
        rs.counts[_COUNTER[code]] += 1
        self.lim.rejected(rule.name, _REASON[code])
        ctx.decide(NAME, "reject", f"{rule.name}:{_REASON[code]}")
        m, scale = rule.math, rs.scale
        retry = max(ks.retry_after(m, scale, now, code), 0.001)
        headers: list[tuple[str, str]] = []
        local = 1.0 if ks.leased else scale
        if m.limit:
            q_reset = ks.retry_after(m, scale, now, Code.QPS)
            headers += [
                ("x-ratelimit-limit-requests", _num(m.limit)),
                ("x-ratelimit-remaining-requests", _num(ks.requests_left(m, scale, now) / local)),
                ("x-ratelimit-reset-requests", _dur(q_reset)),
            ]
        if m.rate:
            left = ks.tokens_left(m, scale, now)
            headers += [
                ("x-ratelimit-limit-tokens", _num(m.burst)),
                ("x-ratelimit-remaining-tokens", _num(max(0.0, left) / local)),
                ("x-ratelimit-reset-tokens", _dur((m.burst * local - left) / (m.rate * local))),
            ]
        what = "token budget" if code is Code.TOKENS else "rate limit"
        return ctx.stop(
            reject(
                429,
                GRPC_RESOURCE_EXHAUSTED,
                "rate_limited",
                f"{what} of rule {rule.name} exceeded",
                retry,
                tuple(headers),
            )
        )

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
        return ctx.stop(_shed_verdict(colour, ctx.priority or 0))

    # -- body phase: tokens -------------------------------------------------------------------
    def _reserve(self, ctx: RequestContext, t: Ticket, cost: int, prompt: int) -> Status:
        res = Reservation(cost, prompt)
        t.tokens = res
        now = self.now()
        for rs, k, ks in t.entries:
            rule = rs.rule
            if not rule.has_t:
                continue
            if ks.reserve(rule.math, rs.scale, now, float(cost)):
                res.entries.append((rs, k, ks))
                rs.tokens[0] += cost
                continue
            if not rule.enforce:
                rs.counts[SHADOW_REJECT] += 1
                continue
            rs.counts[ADMIT] -= 1  # counted at the request phase; refused now
            return self._refuse(ctx, t, rule, rs, ks, Code.TOKENS, now)
        if self.lim.store is not None:
            for rs, k, ks in res.entries:
                rs.dirty[k] = ks
                if ks.leased and ks.tok_share <= 0.0:
                    self.lim.wake.set()
        return Status.CONTINUE

    # -- response phase -----------------------------------------------------------------------
    def on_response(self, ctx: RequestContext) -> None:
        t = ctx.reservation
        if t is None or (t.pool is None and t.tokens is None and ctx.outcome is _OK):
            return  # nothing reserved, nothing to give back: the common QPS-only case
        if not isinstance(t, Ticket):
            return
        self._release(ctx, t)
        started = ctx.first_byte_at is not None or ctx.outcome is Outcome.OK
        res = t.tokens
        if res is not None and not res.settled:
            res.settled = True
            diff = float(res.difference(ctx.usage, started))
            if diff:
                shared = self.lim.store is not None
                for rs, k, ks in res.entries:
                    ks.settle(rs.math, rs.scale, diff)
                    rs.tokens[1 if diff > 0 else 2] += abs(diff)
                    if shared:
                        rs.dirty[k] = ks
        if not started and ctx.outcome is Outcome.REJECTED:
            for _, _, ks in t.entries:  # a later filter refused it: it never counted
                ks.undo()

    def _release(self, ctx: RequestContext, t: Ticket) -> None:
        pool = t.pool
        if pool is None:
            return
        t.pool = None
        latency = None
        if ctx.first_byte_at is not None:
            latency = ctx.first_byte_at - ctx.started
        elif ctx.outcome is Outcome.OK or ctx.outcome.upstream_failed:
            latency = ctx.elapsed
        pool.limit.finish(latency, self.now())
        self._pool_moved(pool)

    # -- colours ------------------------------------------------------------------------------
    def _recoloured(self, rs: RuleState, k: str, ks: KeyState) -> None:
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
    """The same, with the body and event phases (built only when a rule limits tokens or a
    rule is keyed by model, so that the others cost nothing there)."""

    def on_body(self, ctx: RequestContext, body: RequestBody) -> Status:
        t = ctx.reservation
        if not isinstance(t, Ticket):
            return Status.CONTINUE
        if self.late:
            status = self._late(ctx, t, body.model)
            if status is not Status.CONTINUE:
                return status
        if not self.c.has_tokens or t.tokens is not None or not body.size:
            return Status.CONTINUE  # no body (GET /v1/models...): nothing to reserve
        prompt = body.prompt_tokens_estimate
        status = self._reserve(ctx, t, estimate(prompt, body.max_tokens, self.default_max), prompt)
        if status is Status.CONTINUE and body.stream and body.parsed and not body.wants_usage:
            body.set("stream_options", {**(body.stream_options or {}), "include_usage": True})
            body.usage_added = True
        return status

    def _late(self, ctx: RequestContext, t: Ticket, model: str | None) -> Status:
        now = self.now()
        shared = self.lim.store is not None
        for rule, rs in self.late:
            k = rule.key(ctx.info, t.claims, t.route, model)
            ks = rs.key(k, now)
            code = ks.request(rule.math, rs.scale, now)
            if ks.changed is not None:
                self._recoloured(rs, k, ks)
            if shared:
                rs.dirty[k] = ks
            status = self._judge(ctx, t, rule, rs, ks, code, now, self.late, 0)
            if status is not None:
                assert isinstance(status, Status)  # the late rules do not queue
                return status
        return Status.CONTINUE

    def on_event(self, ctx: RequestContext, event: StreamEvent) -> Status:
        t = ctx.reservation
        if not isinstance(t, Ticket) or t.tokens is None:
            return Status.CONTINUE
        kind = event.kind
        if kind is EventKind.SSE:
            if t.tokens.on_chunk(event.doc) and ctx.usage is None:
                for rs, _, _ in t.tokens.entries:
                    if rs.rule.cut and rs.rule.enforce:
                        rs.counts[TOKEN_CUT] += 1
                        self.lim.rejected(rs.rule.name, "token_overrun")
                        return ctx.stop(_OVERRUN)
        elif kind is EventKind.TRAILERS and ctx.usage is None:
            for k, v in event.metadata:
                if k == self.trailer:
                    u = usage_from_trailer(v)
                    if u is not None:
                        ctx.usage = u
                    break
        return Status.CONTINUE


_CONCURRENCY = reject(
    503, GRPC_UNAVAILABLE, "overloaded", "the backend pool is at its concurrency limit", 1.0
)
_OVERRUN = reject(
    429,
    GRPC_RESOURCE_EXHAUSTED,
    "token_overrun",
    "the response used more tokens than were reserved for it",
)


def _shed_verdict(colour: Colour, prio: int) -> Verdict:
    return reject(
        503,
        GRPC_UNAVAILABLE,
        "overloaded",
        f"shed while {colour.label} (priority class {prio})",
        SHED_RETRY_S.get(colour, 1.0),
    )


def _num(x: float) -> str:
    return str(int(x)) if x >= 0 else "0"


def _dur(s: float) -> str:
    """Seconds as OpenAI writes them ("0.25s", "12s")."""
    s = max(0.0, s)
    return f"{s:.3f}".rstrip("0").rstrip(".") + "s"


def build(section: CompiledPolicy, services: Services) -> RateLimitFilter | None:
    rl = section.policy.rate_limits
    if rl is None or (not rl.rules and rl.concurrency is None):
        return None
    c = compile_limits(rl, section)
    cls = TokenRateLimitFilter if (c.has_tokens or c.late) else RateLimitFilter
    return cls(c, limiter_for(services))
