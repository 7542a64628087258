"""(compiled) The answers the HTTP lifecycle (`gateway.forward.http`) writes itself: refusals,
failures before the upstream answer began, and expired deadlines. Each sets the request's outcome
and writes one whole JSON error response in the request's API dialect, or, once a head went out,
ends the stream early (`relay.end_early`: the family's SSE error events, never a truncated 200).

`draining`: the gateway is draining, so the connection closes after the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core import apis
from gateway.core.outcome import Outcome
from gateway.core.verdict import BODY_TIMEOUT, BODY_TOO_LARGE, Verdict
from gateway.forward import relay
from gateway.forward.body_phase import api_of
from gateway.forward.deadlines import BODY, STALL, TOTAL
from gateway.forward.exchange import BodyTooLarge, Exchange
from gateway.forward.failures import failure_for
from gateway.forward.headers import error_body, response_lines
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.context import RequestContext

__all__ = ["answer", "before_answer", "expired", "refuse", "upstream_failed"]


async def before_answer(ex: Exchange, ctx: RequestContext, e: Exception, draining: bool) -> None:
    """A request that failed before its upstream answer began: its body too large, or
    malformed or cut by the client, or the upstream call failed."""
    if isinstance(e, BodyTooLarge):
        await refuse(ex, ctx, BODY_TOO_LARGE, draining)
    elif isinstance(e, EOFError):
        ctx.outcome = Outcome.BAD_REQUEST
        await answer(ex, ctx, 400, "bad_request", "incomplete body", draining, close=True)
    else:
        await upstream_failed(ex, ctx, e, draining)


async def expired(ex: Exchange, ctx: RequestContext, kind: str, draining: bool) -> None:
    """The deadline `kind` (`gateway.forward.deadlines`) cancelled the request."""
    if kind == BODY:
        await refuse(ex, ctx, BODY_TIMEOUT, draining)
        return
    if kind == STALL:  # the client stopped reading: cut both ways (the upstream is released)
        ctx.outcome = Outcome.STALLED
        ex.abort()
        return
    assert kind == TOTAL
    if ctx.endpoint is not None:
        metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, "timeout").inc()
    ctx.outcome = Outcome.UPSTREAM_TIMEOUT
    if not ex.head_sent:
        await answer(ex, ctx, 504, "upstream_timeout", "upstream total timeout", draining)
    else:
        await relay.end_early(ex, ctx, "upstream_timeout", "upstream total timeout")


async def upstream_failed(ex: Exchange, ctx: RequestContext, e: Exception, draining: bool) -> None:
    """The upstream call failed (`gateway.forward.failures` maps it)."""
    f = failure_for(e)
    if ctx.endpoint is not None:
        metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, f.kind).inc()
    ctx.outcome = f.outcome
    ctx.detail = str(e)[:200]
    if not ex.head_sent:
        await answer(ex, ctx, f.http_status, f.error_type, str(e), draining)
    else:
        await relay.end_early(ex, ctx, f.error_type, str(e))


async def refuse(ex: Exchange, ctx: RequestContext, v: Verdict, draining: bool) -> None:
    """The verdict's answer (its status, Retry-After and headers, or its own body)."""
    ctx.verdict = v
    ctx.outcome = Outcome.REJECTED if v.http_status >= 400 else Outcome.OK
    close = v.http_status in (408, 413, 417, 431)  # the rest is not worth reading
    await answer(
        ex, ctx, v.http_status, v.error_type, v.reason, draining, v.retry_after, v.headers,
        close, v.body,
    )  # fmt: skip


async def answer(
    ex: Exchange,
    ctx: RequestContext,
    status: int,
    error_type: str,
    message: str,
    draining: bool,
    retry_after: float | None = None,
    extra: tuple[tuple[str, str], ...] = (),
    close: bool = False,
    body: bytes = b"",
) -> None:
    """A JSON error response (or `body`), whole, in one write; in the dialect of the request's
    API family (Anthropic's shape and statuses for Messages, `gateway.core.apis`)."""
    if not body:
        api = api_of(ctx)
        if api in apis.ANTHROPIC:
            status, body = apis.error_answer(api, status, error_type, message)
        else:
            body = error_body(error_type or "error", message)
    ctx.http_status = status
    lines = response_lines(ctx, retry_after, extra)
    if close or draining:
        ex.close_after = True
    if ctx.info.method == "HEAD":  # the length of the body, without it (RFC 9110 §9.3.2)
        pending = ex.respond(status, lines, b"", False, len(body))
    else:
        ctx.bytes_out, pending = len(body), ex.respond(status, lines, body, False)
    if pending is not None:
        await pending
