"""(compiled) The rate-limit filter's body and event phases: the token reservation, streams asked
for their usage, overruns cut, the gRPC usage trailer. Only the filter built when a rule limits
tokens or is keyed by model (`TokenRateLimitFilter`) has these phases, so that the others cost
nothing there; they go on from the request phase through its public `Steps`.

- `on_body` (HTTP): model-keyed rules (decided here; they do not queue in yellow), then the
  reservation (prompt / 4 + max_tokens, or `default_max_tokens`; nothing for an empty body);
  a chat or text-completion stream is asked for its usage chunk if the client did not ask
  (`body.usage_added`: the forwarding path hides that chunk from the client); Responses and
  Messages streams report their usage unasked; `/v1/messages/count_tokens` is not counted.
- `on_event`: the completion tokens of each SSE chunk (an overrun is cut when the rule says
  `on_overrun: cut` and no usage is known yet), the gRPC usage trailer into `ctx.usage`.
"""

from __future__ import annotations

from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.apis import CHAT, COMPLETIONS, COUNT_TOKENS
from gateway.core.body import RequestBody
from gateway.core.tokens import estimate, usage_from_trailer
from gateway.filters.ratelimit_steps import RuleStep, Steps, Ticket
from gateway.ratelimit.state import TOKEN_CUT
from gateway.ratelimit.verdicts import OVERRUN


def on_body(f: Steps, ctx: RequestContext, body: RequestBody) -> Status:
    t = ctx.reservation
    if not isinstance(t, Ticket):
        return Status.CONTINUE
    if f.late:
        status = _late(f, ctx, t, body.model)
        if status is not Status.CONTINUE:
            return status
    if not f.c.has_tokens or t.tokens is not None or not body.size:
        return Status.CONTINUE  # no body (GET /v1/models...): nothing to reserve
    api = body.api
    if api == COUNT_TOKENS:
        return Status.CONTINUE  # counts, generates nothing: not counted
    prompt = body.prompt_tokens_estimate
    status = f.reserve(ctx, t, estimate(prompt, body.max_tokens, f.default_max), prompt)
    if (
        status is Status.CONTINUE
        and body.stream
        and body.parsed
        and not body.wants_usage
        and api in (CHAT, COMPLETIONS)  # the others report usage unasked
    ):
        body.set("stream_options", {**(body.stream_options or {}), "include_usage": True})
        body.usage_added = True
    return status


def _late(f: Steps, ctx: RequestContext, t: Ticket, model: str | None) -> Status:
    now = f.now()
    shared = f.lim.store is not None
    for rule, rs in f.late:
        k = rule.key(ctx.info, t.claims, t.route, model)
        ks = rs.key(k, now)
        code = ks.request(rule.math, rs.scale, now)
        if ks.changed is not None:
            f.recoloured(rs, k, ks)
        if shared:
            rs.dirty[k] = ks
        status = f.judge(ctx, t, RuleStep(rule, rs, ks, code, now), f.late, 0)
        if status is not None:
            assert isinstance(status, Status)  # the late rules do not queue
            return status
    return Status.CONTINUE


def on_event(f: Steps, ctx: RequestContext, event: StreamEvent) -> Status:
    t = ctx.reservation
    if not isinstance(t, Ticket) or t.tokens is None:
        return Status.CONTINUE
    kind = event.kind
    if kind is EventKind.SSE:
        if t.tokens.on_chunk(event.doc) and ctx.usage is None:
            for rs, _, _ in t.tokens.entries:
                if rs.rule.cut and rs.rule.enforce:
                    rs.counts[TOKEN_CUT] += 1
                    f.lim.rejected(rs.rule.name, "token_overrun")
                    return ctx.stop(OVERRUN)
    elif kind is EventKind.TRAILERS and ctx.usage is None:
        for k, v in event.metadata:
            if k == f.trailer:
                u = usage_from_trailer(v)
                if u is not None:
                    ctx.usage = u
                break
    return Status.CONTINUE
