"""(compiled) The one table from an upstream failure to what the client sees, for both protocols.

HTTP status, gRPC code, the JSON error type, the outcome, and the `kind` label of
`sluice_upstream_errors_total`. Timeouts before the response head are 504 /
DEADLINE_EXCEEDED; a connection that cannot be had is 502 / UNAVAILABLE (a client may retry
it elsewhere), and so is a TLS handshake that failed (its own outcome and kind, so that an
expired or misissued certificate is told apart from a dead backend); a backend that speaks
broken HTTP or cuts its answer is 502 / INTERNAL. A gRPC channel reports its failed handshake
as UNAVAILABLE with grpc core's reason in the details (`grpc_failure` tells it apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gateway.core.outcome import Outcome
from gateway.core.verdict import (
    GRPC_DEADLINE_EXCEEDED,
    GRPC_INTERNAL,
    GRPC_UNAVAILABLE,
)
from gateway.errors import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTlsError,
)
from gateway.tls.upstream import GRPC_TLS_MARKERS, grpc_tls_reason

if TYPE_CHECKING:
    from gateway.context import RequestContext


@dataclass(frozen=True, slots=True)
class Failure:
    outcome: Outcome
    http_status: int
    grpc_status: int
    error_type: str  # the JSON error body's `type` / the SSE error event's type
    kind: str  # sluice_upstream_errors_total{kind}


CONNECT: Final = Failure(
    Outcome.UPSTREAM_CONNECT, 502, GRPC_UNAVAILABLE, "upstream_connect_error", "connect"
)
TLS: Final = Failure(Outcome.UPSTREAM_TLS, 502, GRPC_UNAVAILABLE, "upstream_tls_error", "tls")
TIMEOUT: Final = Failure(
    Outcome.UPSTREAM_TIMEOUT, 504, GRPC_DEADLINE_EXCEEDED, "upstream_timeout", "timeout"
)
PROTOCOL: Final = Failure(
    Outcome.UPSTREAM_PROTOCOL, 502, GRPC_INTERNAL, "upstream_protocol_error", "protocol"
)
UNAVAILABLE = Failure(
    Outcome.UPSTREAM_ERROR, 503, GRPC_UNAVAILABLE, "upstream_unavailable", "unavailable"
)


def failure_for(exc: BaseException) -> Failure:
    """The failure an exception of the upstream side stands for."""
    if isinstance(exc, UpstreamTimeout):
        return TIMEOUT
    if isinstance(exc, UpstreamTlsError):
        return TLS
    if isinstance(exc, UpstreamConnectError):
        return CONNECT
    if isinstance(exc, UpstreamProtocolError):
        return PROTOCOL
    return PROTOCOL


# gRPC status codes an upstream call ended with → the outcome (the code itself is passed to the
# client as the backend sent it).
GRPC_OUTCOMES: Final[dict[int, Outcome]] = {
    0: Outcome.OK,
    1: Outcome.UPSTREAM_ERROR,  # CANCELLED by the backend
    4: Outcome.UPSTREAM_TIMEOUT,
    13: Outcome.UPSTREAM_ERROR,
    14: Outcome.UPSTREAM_ERROR,
    15: Outcome.UPSTREAM_ERROR,
}


def grpc_outcome(code: int) -> Outcome:
    """Application errors (NOT_FOUND, INVALID_ARGUMENT, ...) are the backend's answer: OK for the
    gateway; UNAVAILABLE, INTERNAL, DATA_LOSS, DEADLINE_EXCEEDED, CANCELLED are failures."""
    return GRPC_OUTCOMES.get(code, Outcome.OK)


def grpc_failure(code: int, details: str, tls: bool) -> Failure | None:
    """The failure an upstream gRPC status stands for when the channel itself failed (the TLS
    handshake of a `tls` backend); None when the status is the backend's answer (see
    `grpc_outcome`)."""
    if tls and code == GRPC_UNAVAILABLE and any(m in details for m in GRPC_TLS_MARKERS):
        return TLS
    return None


def grpc_tls_failed(ctx: RequestContext, code: int, details: str) -> str | None:
    """When an upstream gRPC status is our own channel's failed handshake (`grpc_failure`): its
    outcome and reason on `ctx` (the access log's `error` and `detail`), one warning line
    (rate-limited per member), and the metric kind to count it under; else None."""
    endpoint = ctx.endpoint
    tls = endpoint.tls if endpoint is not None else None
    failure = grpc_failure(code, details, tls is not None)
    if failure is None or tls is None or endpoint is None:
        return None
    reason = grpc_tls_reason(details)
    ctx.outcome, ctx.detail = failure.outcome, reason[:300]
    tls.failed(endpoint.address, reason)
    return failure.kind
