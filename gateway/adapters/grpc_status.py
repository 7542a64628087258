"""How a gRPC call ends for the client: its status and details (capped), a verdict's code and
trailing metadata, an upstream failure passed on as the backend sent it, Sluice's own failure
or the client's cancellation. Shared by the unary and streaming relays of `grpc_relay`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import grpc
import grpc.aio

from gateway.core.outcome import Outcome
from gateway.core.verdict import GRPC_CANCELLED, GRPC_DEADLINE_EXCEEDED
from gateway.filters.base import RequestContext
from gateway.forward.failures import grpc_outcome, grpc_tls_failed
from gateway.forward.headers import retry_after_value
from gateway.telemetry import metrics

log = logging.getLogger("sluice.grpc")

Metadata = Sequence[tuple[str, str | bytes]]
Context = grpc.aio.ServicerContext[bytes, bytes]

CODES: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}

MAX_DETAILS = 4096  # characters of an upstream status message passed to the client

# sluice_upstream_errors_total{kind} for upstream call statuses (the failure table's kinds).
_UPSTREAM_KIND = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


def _status(ctx: RequestContext, context: Context, code: grpc.StatusCode, details: str) -> None:
    ctx.grpc_status = code.value[0]
    context.set_code(code)
    if details:
        # Details travel in a header: a huge upstream message would make the client's HTTP/2
        # stack reset the stream, so keep them well under the usual 8 KiB metadata limit.
        context.set_details(details[:MAX_DETAILS])


def bounded_metadata(
    md: Sequence[tuple[str, str | bytes]], cap: int
) -> tuple[tuple[str, str | bytes], ...]:
    """The first entries of an upstream's metadata that fit `cap` bytes as HTTP/2 counts them
    (name + value + 32 each, RFC 7541 4.1); the channel accepts more from a backend than the
    client is likely to (limits.grpc_max_upstream_metadata_bytes vs grpc_max_metadata_bytes)."""
    size, out = 0, []
    for k, v in md:
        size += len(k) + len(v) + 32
        if size > cap:
            break
        out.append((k, v))
    return tuple(out)


def _reject(ctx: RequestContext, context: Context) -> None:
    """Answer the chain's verdict: its code and reason, Retry-After and the verdict's headers
    as trailing metadata."""
    verdict = ctx.verdict
    ctx.outcome = Outcome.REJECTED
    trailing = list(verdict.headers)
    if verdict.retry_after is not None:
        trailing.append(("retry-after", retry_after_value(verdict.retry_after)))
    trailing.extend(ctx.response_headers)
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    _status(ctx, context, CODES.get(verdict.grpc_status, grpc.StatusCode.UNKNOWN), verdict.reason)


def _upstream_failed(ctx: RequestContext, context: Context, e: grpc.aio.AioRpcError) -> None:
    """The upstream call ended with a status: passed to the client as the backend sent it
    (details capped); the outcome comes from the one failure table."""
    code = e.code()
    ctx.outcome = grpc_outcome(code.value[0])
    kind = grpc_tls_failed(ctx, code.value[0], e.details() or "") or _UPSTREAM_KIND.get(code)
    if kind is not None and ctx.endpoint is not None:
        metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, kind).inc()
    trailing = e.trailing_metadata()
    if trailing:
        cap = ctx.policy.policy.limits.grpc_max_metadata_bytes
        context.set_trailing_metadata(bounded_metadata(cast(Metadata, trailing), cap))
    _status(ctx, context, code, e.details() or "")


def _crashed(ctx: RequestContext, context: Context) -> None:
    log.exception("gRPC proxy failed on %s", ctx.info.path)
    ctx.outcome = Outcome.INTERNAL
    _status(ctx, context, grpc.StatusCode.INTERNAL, "gateway error")


def _cancelled(ctx: RequestContext, context: Context) -> None:
    # The client's own deadline also reaches us as a cancellation: count it as a deadline.
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        ctx.grpc_status, ctx.outcome = GRPC_DEADLINE_EXCEEDED, Outcome.DEADLINE
    else:
        ctx.grpc_status, ctx.outcome = GRPC_CANCELLED, Outcome.CLIENT_CANCELLED
