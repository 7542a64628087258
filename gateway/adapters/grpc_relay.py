"""One gRPC call through Sluice, unary or streaming: the chain, the upstream call on a pooled
channel, and everything between the client and it (metadata, deadline, backpressure, status,
cancellation). `gateway.adapters.grpc` owns the server and picks the handler kind per method.

Upstream failures map through `gateway.forward.failures` (the codes a backend sent are passed on
as sent, details capped); deadlines (first byte, idle between messages, a client that stalls) are
the coarse ticker of `gateway.forward.deadlines`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from gateway.adapters.grpc_calls import CallAccounting
from gateway.adapters.grpc_status import (
    _cancelled,
    _crashed,
    _reject,
    _status,
    _upstream_failed,
    bounded_metadata,
)
from gateway.core.outcome import Outcome
from gateway.core.request import Protocol, RequestInfo
from gateway.core.verdict import (
    GRPC_OK,
    GRPC_UNAVAILABLE,
    GRPC_UNKNOWN,
)
from gateway.filters.base import EventKind, RequestContext, Status, StreamEvent
from gateway.forward.deadlines import FIRST_BYTE, IDLE, STALL, Deadlines
from gateway.forward.failures import grpc_outcome
from gateway.forward.lifecycle import Lifecycle, retry
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.snapshot import Snapshot

log = logging.getLogger("sluice.grpc")

Metadata = Sequence[tuple[str, str | bytes]]
Context = grpc.aio.ServicerContext[bytes, bytes]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

CALLS = CallAccounting()  # calls that end between handler lookup and _begin (one listener)
# Request metadata that must not travel upstream: HTTP/2 pseudo-headers and hop-by-hop headers
# (RFC 9113 §8.2.2), ones the upstream channel sets itself (te, content-type, user-agent), and the
# whole reserved `grpc-` namespace (grpc-timeout is re-derived from the remaining deadline).
DROPPED_METADATA = frozenset(
    {
        ":authority", ":path", ":method", ":scheme", "host", "te", "content-type", "user-agent",
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade",
    }
)  # fmt: skip


def _end_try(ctx: RequestContext) -> None:
    code = ctx.grpc_status if ctx.grpc_status is not None else GRPC_UNKNOWN
    ctx.end_try(time.monotonic(), code, "" if ctx.outcome is Outcome.OK else ctx.outcome.value)


def _retry(ctx: RequestContext, e: grpc.aio.AioRpcError) -> bool:
    """A unary call that failed UNAVAILABLE (nothing reached the client yet): try another
    member if the route's retries allow it (`gateway.forward.lifecycle.retry`)."""
    route = ctx.route
    if route is None or route.retries is None or e.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    ctx.grpc_status = GRPC_UNAVAILABLE
    ctx.outcome = Outcome.UPSTREAM_ERROR
    return retry(ctx, GRPC_UNAVAILABLE, "unavailable") is not None  # this try is over


def _begin(
    life: Lifecycle, method: str, context: Context
) -> tuple[Snapshot, RequestContext, Metadata]:
    CALLS.started()
    md: Metadata = context.invocation_metadata() or ()  # type: ignore[assignment]
    headers = {k: v for k, v in md if type(v) is str}
    if len(headers) != len(md):  # repeated keys (or -bin values): join repeats as HTTP does,
        headers = {}  # so that a filter sees two `authorization` entries, not the last one
        for k, v in md:
            if type(v) is str:
                headers[k] = v if k not in headers else headers[k] + ", " + v
    info = RequestInfo(Protocol.GRPC, "POST", method, headers, context.peer())
    active, ctx = life.begin(info)
    return active, ctx, md


def _trailers(chain: Any, ctx: RequestContext, context: Context, trailing: Any) -> bool:
    """The upstream's trailing metadata to the client (plus the filters' response headers);
    the chain's TRAILERS event first. False: a filter ended the call (its verdict is set)."""
    md = bounded_metadata(trailing or (), ctx.policy.policy.limits.grpc_max_metadata_bytes)
    if chain.has_events:
        text = tuple((k, v) for k, v in md if isinstance(v, str))
        if chain.on_event(ctx, StreamEvent(EventKind.TRAILERS, metadata=text)) is Status.STOP:
            _reject(ctx, context)
            ctx.outcome = Outcome.STREAM_CUT
            return False
    if ctx.response_headers:
        md = md + tuple(ctx.response_headers)
    if md:
        context.set_trailing_metadata(md)
    return True


def _upstream(
    ctx: RequestContext, md: Metadata, context: Context
) -> tuple[list[tuple[str, str | bytes]], float]:
    """Upstream metadata and timeout: what survives of the client's metadata plus the filters',
    and the client's remaining deadline capped by the route's total timeout."""
    extra = ctx.upstream_headers
    out: list[tuple[str, str | bytes]] = [
        (k, v)
        for k, v in md
        if k not in DROPPED_METADATA and not k.startswith("grpc-") and k not in extra
    ]
    out.extend((k, v) for k, v in extra.items() if v)  # "": only drop the client's copy
    assert ctx.route is not None
    timeout = ctx.route.timeouts.total_s
    remaining = context.time_remaining()
    if remaining is not None and remaining < timeout:
        timeout = remaining
    return out, timeout


# Module-level functions wrapped in functools.partial (not bound methods): grpc checks each
# behaviour with inspect.iscoroutinefunction per call, which is cheap only for plain functions.
async def _unary_call(
    life: Lifecycle, deadlines: Deadlines, method: str, request: bytes, context: Context
) -> bytes | None:
    active, ctx, md = _begin(life, method, context)
    gw = life.gateway
    ctx.bytes_in = len(request)
    task = asyncio.current_task()
    assert task is not None
    try:
        if await active.chain.on_request(ctx) is Status.STOP:
            _reject(ctx, context)
            return None
        assert ctx.endpoint is not None and ctx.route is not None
        while True:  # more than one try only for UNAVAILABLE, where the route allows retries
            ctx.begin_try(ctx.endpoint.backend, ctx.endpoint.address, time.monotonic())
            metadata, timeout = _upstream(ctx, md, context)
            call = gw.channels.unary(ctx.endpoint, method)(
                request, timeout=timeout, metadata=metadata
            )
            deadlines.start(task, timeout)
            deadlines.tighten(task, ctx.route.timeouts.first_byte_s, FIRST_BYTE)
            try:
                response: bytes = await call
                break
            except grpc.aio.AioRpcError as e:
                if _retry(ctx, e):
                    continue
                _upstream_failed(ctx, context, e)
                return None
            except asyncio.CancelledError:
                call.cancel()
                if _timed_out(deadlines, task, ctx, context):
                    return None
                _cancelled(ctx, context)
                raise
            finally:
                deadlines.stop(task)
        ctx.first_byte_at = now = time.monotonic()
        ctx.try_first_byte(now)
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(
                bounded_metadata(tuple(initial), ctx.policy.policy.limits.grpc_max_metadata_bytes)
            )
        if not _trailers(active.chain, ctx, context, await call.trailing_metadata()):
            return None
        ctx.grpc_status = GRPC_OK
        ctx.bytes_out = len(response)
        return response
    except asyncio.CancelledError:
        if ctx.grpc_status is None:
            _cancelled(ctx, context)
        raise
    except Exception:
        _crashed(ctx, context)
        return None
    finally:
        _end_try(ctx)
        pending = life.finish(active, ctx)
        if pending is not None:
            await pending


async def _stream_call(
    life: Lifecycle,
    deadlines: Deadlines,
    method: str,
    request_iterator: AsyncIterator[bytes],
    context: Context,
) -> None:
    active, ctx, md = _begin(life, method, context)
    gw = life.gateway
    pump: asyncio.Task[None] | None = None
    call: grpc.aio.StreamStreamCall[bytes, bytes] | None = None
    task = asyncio.current_task()
    assert task is not None
    try:
        if await active.chain.on_request(ctx) is Status.STOP:
            _reject(ctx, context)
            return
        assert ctx.endpoint is not None and ctx.route is not None
        ctx.begin_try(ctx.endpoint.backend, ctx.endpoint.address, time.monotonic())
        metadata, timeout = _upstream(ctx, md, context)
        t = ctx.route.timeouts
        call = gw.channels.stream(ctx.endpoint, method)(None, timeout=timeout, metadata=metadata)
        # The one extra task of a streaming call: client → upstream, as messages come.
        pump = asyncio.get_running_loop().create_task(_pump(context, call, ctx))
        deadlines.start(task, timeout)
        try:
            deadlines.tighten(task, t.first_byte_s, FIRST_BYTE)
            initial = await call.initial_metadata()
            ctx.first_byte_at = now = time.monotonic()
            ctx.try_first_byte(now)
            if initial:
                await context.send_initial_metadata(
                    bounded_metadata(
                        tuple(initial), ctx.policy.policy.limits.grpc_max_metadata_bytes
                    )
                )
            # Backpressure: the next upstream message is read only once the previous one was
            # accepted downstream (the upstream channel's window is fixed, see channels.py).
            # A client that reads nothing for idle_s: the upstream call is cancelled at once
            # (the pending write cannot be cancelled without breaking the call in grpc.aio);
            # the client gets DEADLINE_EXCEEDED after the one message already queued for it.
            while True:
                deadlines.tighten(task, t.idle_s, IDLE)
                msg = await call.read()
                if msg is EOF:
                    break
                assert isinstance(msg, bytes)
                ctx.bytes_out += len(msg)
                ctx.stream_event(time.monotonic())
                deadlines.tighten(task, t.idle_s, STALL, call.cancel)
                await context.write(msg)
                if deadlines.expired(task) == STALL:
                    ctx.outcome = Outcome.STALLED
                    _status(ctx, context, grpc.StatusCode.DEADLINE_EXCEEDED, "client stalled")
                    return
            deadlines.relax(task)
            code = await call.code()
        except grpc.aio.AioRpcError as e:
            if deadlines.expired(task) == STALL:  # we cancelled it: the client stalled
                ctx.outcome = Outcome.STALLED
                _status(ctx, context, grpc.StatusCode.DEADLINE_EXCEEDED, "client stalled")
                return
            _upstream_failed(ctx, context, e)
            return
        except asyncio.CancelledError:
            if _timed_out(deadlines, task, ctx, context):
                return
            raise
        finally:
            deadlines.stop(task)
        if not _trailers(active.chain, ctx, context, await call.trailing_metadata()):
            return
        if code is grpc.StatusCode.OK:
            ctx.grpc_status = GRPC_OK
        else:
            ctx.outcome = grpc_outcome(code.value[0])
            _status(ctx, context, code, await call.details())
    except asyncio.CancelledError:
        if ctx.grpc_status is None:
            _cancelled(ctx, context)
        raise
    except Exception:
        _crashed(ctx, context)
    finally:
        if pump is not None and not pump.done():
            pump.cancel()
        if call is not None and not call.done():
            call.cancel()  # client gone or we failed: the upstream must stop at once
        _end_try(ctx)
        pending = life.finish(active, ctx)
        if pending is not None:
            await pending


def _timed_out(
    deadlines: Deadlines, task: asyncio.Task[Any], ctx: RequestContext, context: Context
) -> bool:
    """The task was cancelled by one of our deadlines (not the client): answer it. True if so."""
    kind = deadlines.expired(task)
    if kind is None or task.uncancel() > 0:
        return False
    if kind == STALL:  # the client stopped reading: nothing more will reach it
        ctx.outcome = Outcome.STALLED
        _status(ctx, context, grpc.StatusCode.DEADLINE_EXCEEDED, "client did not read in time")
        return True
    if ctx.endpoint is not None:
        metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, "timeout").inc()
    ctx.outcome = Outcome.UPSTREAM_TIMEOUT
    what = {FIRST_BYTE: "first byte", IDLE: "idle"}.get(kind, "total")
    _status(ctx, context, grpc.StatusCode.DEADLINE_EXCEEDED, f"upstream {what} timeout")
    return True


async def _pump(
    context: Context, call: grpc.aio.StreamStreamCall[bytes, bytes], ctx: RequestContext
) -> None:
    """Forward client messages upstream until the client half-closes or either side ends."""
    try:
        while True:
            msg = await context.read()
            if msg is EOF:
                break
            ctx.bytes_in += len(msg)
            await call.write(msg)
        await call.done_writing()
    except asyncio.CancelledError:
        raise
    except Exception:  # the upstream finished or the client went: the handler reports it
        pass
