"""The metadata of a proxied gRPC call, each way (steps of `gateway.forward.grpc`): what of the
client's metadata travels upstream and with what timeout, the upstream's initial metadata to the
client with Sluice's overhead figure, and the trailing metadata after the chain's TRAILERS
event. Upstream metadata is bounded (`limits.grpc_max_metadata_bytes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.context import EventKind, RequestContext, Status, StreamEvent
from gateway.core.outcome import Outcome
from gateway.forward.grpc_exchange import GrpcExchange, Metadata
from gateway.forward.grpc_status import bounded_metadata, overhead, reject

if TYPE_CHECKING:
    from gateway.filters.chain import Chain

# Request metadata that must not travel upstream: HTTP/2 pseudo-headers and hop-by-hop headers
# (RFC 9113 §8.2.2), ones the upstream channel sets itself (te, content-type, user-agent), and the
# whole reserved `grpc-` namespace (grpc-timeout is re-derived from the remaining deadline).
DROPPED_METADATA = frozenset(
    {
        ":authority", ":path", ":method", ":scheme", "host", "te", "content-type", "user-agent",
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade",
    }
)  # fmt: skip


def upstream_metadata(
    ctx: RequestContext, ex: GrpcExchange
) -> tuple[list[tuple[str, str | bytes]], float]:
    """Upstream metadata and timeout: what survives of the client's metadata plus the filters',
    and the client's remaining deadline capped by the route's total timeout."""
    extra = ctx.upstream_headers
    out: list[tuple[str, str | bytes]] = [
        (k, v)
        for k, v in ex.metadata
        if k not in DROPPED_METADATA and not k.startswith("grpc-") and k not in extra
    ]
    out.extend((k, v) for k, v in extra.items() if v)  # "": only drop the client's copy
    assert ctx.route is not None
    timeout = ctx.route.timeouts.total_s
    remaining = ex.time_remaining()
    if remaining is not None and remaining < timeout:
        timeout = remaining
    return out, timeout


async def send_initial(ex: GrpcExchange, ctx: RequestContext, initial: Any) -> None:
    """The upstream's initial metadata to the client, bounded, and Sluice's overhead figure."""
    md: Metadata = ()
    if initial:
        md = bounded_metadata(tuple(initial), ctx.policy.policy.limits.grpc_max_metadata_bytes)
    await ex.send_initial_metadata((*md, overhead(ctx)))


def client_trailers(
    chain: Chain, ctx: RequestContext, ex: GrpcExchange, trailing: Any
) -> Metadata | None:
    """The trailing metadata for the client: the upstream's (bounded) plus the filters'
    response headers, after the chain's TRAILERS event. None: a filter ended the call (its
    verdict was answered)."""
    md: Metadata = bounded_metadata(
        trailing or (), ctx.policy.policy.limits.grpc_max_metadata_bytes
    )
    if chain.listens(ctx):
        text = tuple((k, v) for k, v in md if isinstance(v, str))
        if chain.on_event(ctx, StreamEvent(EventKind.TRAILERS, metadata=text)) is Status.STOP:
            reject(ctx, ex)
            ctx.outcome = Outcome.STREAM_CUT
            return None
    if ctx.response_headers:
        md = (*md, *ctx.response_headers)
    return md
