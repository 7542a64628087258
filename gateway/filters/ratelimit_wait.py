"""(compiled) The two request-phase paths of the rate-limit filter that wait, for the one request
that must: the yellow queue (a request the limits would refuse waits, bounded in time and in
number, for room) and `strict` rules (one Redis decision each, within the store's deadline;
local when Redis fails). The plain request phase hands back one of these coroutines; they
go on through the filter's public `Steps`."""

from __future__ import annotations

import asyncio

from gateway.context import RequestContext, Status
from gateway.core.keystate import Code, strict_seen
from gateway.core.request import Wire
from gateway.core.tokens import estimate
from gateway.errors import StoreUnavailable
from gateway.filters.ratelimit_steps import Rule, RuleStep, Steps, Ticket
from gateway.ratelimit.state import QUEUED, STRICT_FALLBACK
from gateway.store.base import SyncOp, key_name


async def queued(
    f: Steps, ctx: RequestContext, t: Ticket, step: RuleStep, rules: tuple[Rule, ...], i: int
) -> Status:
    """Yellow: wait (bounded) for room instead of refusing at once."""
    rule, rs, ks = step.rule, step.rs, step.ks
    code = step.code
    lim = f.lim
    lim.waiting += 1
    rs.counts[QUEUED] += 1
    deadline = f.now() + f.delay_s
    try:
        while True:
            now = f.now()
            wait = ks.retry_after(rule.math, rs.scale, now, code)
            if wait > deadline - now:
                step.code, step.now = code, now
                return f.refuse(ctx, t, step)
            await asyncio.sleep(max(wait, 0.001))
            now = f.now()
            ks.unoffer()
            code = ks.request(rule.math, rs.scale, now)
            if code is Code.ADMIT:
                break
    finally:
        lim.waiting -= 1
    step.code, step.now = code, now
    status = f.judge(ctx, t, step, rules, i)
    if status is None:
        status = f.resume(ctx, t, rules, i + 1)
    if not isinstance(status, Status):
        status = await status
    return status


async def strict(f: Steps, ctx: RequestContext, t: Ticket) -> Status:
    """`strict` rules: one Redis decision each (deadline bound); local when Redis fails."""
    lim = f.lim
    store, cfg = lim.store, lim.store_cfg
    assert t.strict is not None and store is not None and cfg is not None
    grpc_cost = float(estimate(0, None, f.default_max)) if ctx.info.protocol is Wire.GRPC else 0.0
    for rule, rs in t.strict:
        now = f.now()
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
        now = f.now()
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
            f.recoloured(rs, k, ks)
        rs.dirty[k] = ks
        status = f.judge(ctx, t, RuleStep(rule, rs, ks, code, now), (), 0)
        if status is not None:
            if not isinstance(status, Status):
                status = await status
            return status
    return f.admitted(ctx, t)
