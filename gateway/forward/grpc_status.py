"""How a gRPC call ends for the client: a status and its details (capped), a verdict's code and
trailing metadata, an upstream failure passed on as the backend sent it, Sluice's own failure,
or the client's cancellation. The steps of `gateway.forward.grpc`; each sets `ctx.grpc_status`
(and the outcome where it is theirs) and ends the exchange.

Every answer Sluice serves carries `x-sluice-overhead-ms` (`overhead`): in the initial metadata
when Sluice sends one (the upstream answered), else in the trailing metadata (a trailers-only
answer: a refusal, an upstream that failed before its first response)."""

from __future__ import annotations

import logging
import time
from typing import cast

import grpc
import grpc.aio

from gateway.context import RequestContext
from gateway.core.outcome import Outcome
from gateway.core.verdict import GRPC_CANCELLED, GRPC_DEADLINE_EXCEEDED, GRPC_INTERNAL
from gateway.forward.failures import grpc_outcome, grpc_tls_failed
from gateway.forward.grpc_exchange import GrpcExchange, Metadata
from gateway.forward.headers import retry_after_value
from gateway.telemetry import metrics

log = logging.getLogger("sluice.grpc")

MAX_DETAILS = 4096  # characters of an upstream status message passed to the client

# sluice_upstream_errors_total{kind} for upstream call statuses (the failure table's kinds).
UPSTREAM_KIND = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


OVERHEAD = "x-sluice-overhead-ms"


def overhead(ctx: RequestContext) -> tuple[str, str]:
    """`x-sluice-overhead-ms`: the time since the call arrived, every try's wait for its
    upstream's first answer excluded (as the HTTP header, `gateway.forward.headers`); kept for
    the metric (`sluice_overhead_seconds{protocol="grpc"}`)."""
    s = ctx.overhead_s = max(0.0, time.monotonic() - ctx.started - ctx.upstream_s)
    return (OVERHEAD, "%.3f" % (s * 1000.0))


def end(
    ctx: RequestContext,
    ex: GrpcExchange,
    code: int,
    details: str,
    trailing: Metadata = (),
    figure: bool = True,
) -> None:
    """End the call with `code`. Details travel in a header: a huge upstream message would make
    the client's HTTP/2 stack reset the stream, so they are kept well under the usual 8 KiB
    metadata limit. A call that sent no initial metadata gets its overhead figure here, unless
    `figure` is False (a call the engine ended before it was served: the grpcio engine's core
    answers those without Sluice, and both engines answer alike)."""
    ctx.grpc_status = code
    if figure and ctx.overhead_s is None:
        trailing = (*trailing, overhead(ctx))
    ex.end(code, details[:MAX_DETAILS], trailing)


def bounded_metadata(md: Metadata, cap: int) -> tuple[tuple[str, str | bytes], ...]:
    """The first entries of an upstream's metadata that fit `cap` bytes as HTTP/2 counts them
    (name + value + 32 each, RFC 7541 4.1); the channel accepts more from a backend than the
    client is likely to (limits.grpc_max_upstream_metadata_bytes vs grpc_max_metadata_bytes).
    An upstream's own overhead figure (a Sluice in front of a Sluice) is left out: this one's
    replaces it."""
    size, out = 0, []
    for k, v in md:
        if k == OVERHEAD:
            continue
        size += len(k) + len(v) + 32
        if size > cap:
            break
        out.append((k, v))
    return tuple(out)


def reject(ctx: RequestContext, ex: GrpcExchange) -> None:
    """Answer the chain's verdict: its code and reason, Retry-After and the verdict's headers
    (and the filters' response headers) as trailing metadata."""
    verdict = ctx.verdict
    ctx.outcome = Outcome.REJECTED
    trailing: list[tuple[str, str | bytes]] = list(verdict.headers)
    if verdict.retry_after is not None:
        trailing.append(("retry-after", retry_after_value(verdict.retry_after)))
    trailing.extend(ctx.response_headers)
    end(ctx, ex, verdict.grpc_status, verdict.reason, trailing)


def upstream_failed(ctx: RequestContext, ex: GrpcExchange, e: grpc.aio.AioRpcError) -> None:
    """The upstream call ended with a status: passed to the client as the backend sent it
    (details capped, trailing metadata bounded); the outcome comes from the one failure
    table."""
    code = e.code()
    ctx.outcome = grpc_outcome(code.value[0])
    kind = grpc_tls_failed(ctx, code.value[0], e.details() or "") or UPSTREAM_KIND.get(code)
    if kind is not None and ctx.endpoint is not None:
        metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, kind).inc()
    trailing = e.trailing_metadata()
    md: Metadata = ()
    if trailing:
        cap = ctx.policy.policy.limits.grpc_max_metadata_bytes
        md = bounded_metadata(cast(Metadata, trailing), cap)
    end(ctx, ex, code.value[0], e.details() or "", md)


def crashed(ctx: RequestContext, ex: GrpcExchange) -> None:
    """A bug of ours: one log line with the traceback, INTERNAL to the client."""
    log.exception("gRPC proxy failed on %s", ctx.info.path)
    ctx.outcome = Outcome.INTERNAL
    end(ctx, ex, GRPC_INTERNAL, "gateway error")


def cancelled(ctx: RequestContext, ex: GrpcExchange) -> None:
    """The client cancelled the call or went away: nothing more reaches it. The client's own
    deadline also reaches us as a cancellation: counted as a deadline."""
    remaining = ex.time_remaining()
    if remaining is not None and remaining <= 0:
        ctx.grpc_status, ctx.outcome = GRPC_DEADLINE_EXCEEDED, Outcome.DEADLINE
    else:
        ctx.grpc_status, ctx.outcome = GRPC_CANCELLED, Outcome.CLIENT_CANCELLED
