"""The gRPC call lifecycle, written once for every gRPC engine (`GrpcExchange`).

Per call, in this order: begin (`gateway.forward.lifecycle`: snapshot, context, in-flight), on
a route that routes by model the model of the call's (first) request message, the chain's
`on_request` (its verdict; a route and an endpoint), the upstream call on a pooled channel
(`gateway.upstream.channels`) with what survives of the client's metadata and its remaining
deadline capped by the route's total timeout, retried on another member where the route allows
it (unary calls that failed UNAVAILABLE), the response (initial metadata, messages with
backpressure, the chain's TRAILERS event, the status), and the finish. The metadata each way is
`gateway.forward.grpc_metadata`'s; every answer carries `x-sluice-overhead-ms` (initial
metadata, or trailing for a trailers-only answer: `gateway.forward.grpc_status.overhead`).

Upstream failures map through `gateway.forward.failures` (the codes a backend sent are passed on
as sent, details capped; `gateway.forward.grpc_status`); deadlines (first message, idle between
messages, a client that stalls) are the coarse ticker of `gateway.forward.deadlines`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from gateway.context import RequestContext, Status
from gateway.core.body import RequestBody
from gateway.core.outcome import Outcome
from gateway.core.protowire import string_field
from gateway.core.verdict import (
    GRPC_CANCELLED,
    GRPC_DEADLINE_EXCEEDED,
    GRPC_OK,
    GRPC_UNAVAILABLE,
    GRPC_UNKNOWN,
)
from gateway.forward.deadlines import FIRST_BYTE, IDLE, STALL, Deadlines
from gateway.forward.failures import grpc_outcome
from gateway.forward.grpc_exchange import GrpcExchange, MessageRefused
from gateway.forward.grpc_metadata import client_trailers, send_initial, upstream_metadata
from gateway.forward.grpc_status import (
    cancelled,
    crashed,
    end,
    reject,
    upstream_failed,
)
from gateway.forward.lifecycle import Lifecycle, retry
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.filters.chain import Chain

    StreamCall = grpc.aio.StreamStreamCall[bytes, bytes]

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

# How long a streaming call on a route that routes by model waits for its first request message
# (its model) before it is routed on its head: clients of inference streams (KServe v2
# ModelStreamInfer) send first; one whose protocol has the server speak first is delayed by it.
FIRST_MESSAGE_S = 1.0


class GrpcForward:
    """One per listener (and loop); no per-call closures."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.deadlines = Deadlines(loop)
        self.lifecycle = Lifecycle(gateway, loop)

    async def serve(self, ex: GrpcExchange, request: bytes | None) -> None:
        """Serve one call to its end: `request` is the one request message of a method served
        as unary (one response message), None for a streaming call (messages both ways as they
        come; on a route that routes by model its first message is read before the chain, see
        `_first_message`). Raises CancelledError when the client went away or the engine
        refused a request message (the engine answers); every other failure is answered with a
        status."""
        snap, ctx = self.lifecycle.begin(ex.info)
        first: asyncio.Task[bytes | None] | None = None
        try:
            if request is not None:
                ctx.bytes_in = len(request)
                if snap.policy.body_routing:  # the model it names (field 1), for model routes
                    ctx.body = RequestBody(b"", len(request), model=string_field(request, 1))
            elif snap.policy.body_routing:
                route = snap.policy.match_head(ex.info)
                if route is not None and route.needs_body:
                    first = await self._first_message(ex, ctx)
            if await snap.chain.on_request(ctx) is Status.STOP:
                reject(ctx, ex)
                return
            if request is not None:
                await self._unary(ex, ctx, snap.chain, request)
            else:
                await self._stream(ex, ctx, snap.chain, first)
        except asyncio.CancelledError:
            if ctx.grpc_status is None:
                cancelled(ctx, ex)
            raise
        except Exception:
            crashed(ctx, ex)
        finally:
            if first is not None:
                _drop(first)
            _end_try(ctx)
            pending = self.lifecycle.finish(snap, ctx)
            if pending is not None:
                await pending

    async def _first_message(
        self, ex: GrpcExchange, ctx: RequestContext
    ) -> asyncio.Task[bytes | None]:
        """A streaming call on a route that routes by model: its first request message (the
        engine bounds its size), waited for at most `FIRST_MESSAGE_S`, names the model
        (`ctx.body`) before the chain routes the call. Returns the read, which `_pump` sends
        upstream first: still pending if the client had sent nothing by then (the call is
        routed on its head, as the model is unknown). The read runs in a task of its own
        because a grpc.aio read must not be cancelled while the call goes on."""
        read = self.loop.create_task(ex.read())
        try:
            await asyncio.wait((read,), timeout=FIRST_MESSAGE_S)
        except asyncio.CancelledError:
            read.cancel()
            raise
        if not read.done():
            return read
        try:
            msg = read.result()
        except MessageRefused as e:  # as in _pump: the engine answers with its code
            ctx.grpc_status, ctx.outcome = e.code, Outcome.BAD_REQUEST
            raise asyncio.CancelledError() from None
        except ConnectionError:  # the stream is gone: the client cancelled the call
            raise asyncio.CancelledError() from None
        if msg is not None:
            ctx.bytes_in += len(msg)
            ctx.body = RequestBody(b"", len(msg), model=string_field(msg, 1))
        return read

    async def unserved(
        self, ex: GrpcExchange, outcome: Outcome, code: int, details: str = ""
    ) -> None:
        """A call the engine ended before it could be served (the client reset its stream
        before its task ran, a message over the size limit, a malformed call): recorded
        through `finish` like any other; no filter ran. CANCELLED is recorded only (the
        client is gone); any other code is the client's answer."""
        snap, ctx = self.lifecycle.begin(ex.info)
        ctx.outcome = outcome
        if code == GRPC_CANCELLED:
            ctx.grpc_status = code
        else:
            end(ctx, ex, code, details, figure=False)
        pending = self.lifecycle.finish(snap, ctx)
        if pending is not None:
            await pending

    async def _unary(
        self, ex: GrpcExchange, ctx: RequestContext, chain: Chain, request: bytes
    ) -> None:
        assert ctx.endpoint is not None and ctx.route is not None
        task = asyncio.current_task(self.loop)
        assert task is not None
        deadlines = self.deadlines
        channels = self.gateway.channels
        while True:  # more than one try only for UNAVAILABLE, where the route allows retries
            ctx.begin_try(ctx.endpoint.backend, ctx.endpoint.address, time.monotonic())
            metadata, timeout = upstream_metadata(ctx, ex)
            sent = time.monotonic()
            call = channels.unary(ctx.endpoint, ctx.info.path)(
                request, timeout=timeout, metadata=metadata
            )
            deadlines.start(task, timeout)
            deadlines.tighten(task, ctx.route.timeouts.first_byte_s, FIRST_BYTE)
            try:
                try:
                    response: bytes = await call
                finally:  # upstream time, not Sluice's (x-sluice-overhead-ms)
                    ctx.upstream_s += time.monotonic() - sent
                break
            except grpc.aio.AioRpcError as e:
                if _retry(ctx, e):
                    continue
                upstream_failed(ctx, ex, e)
                return
            except asyncio.CancelledError:
                call.cancel()
                if self._timed_out(task, ctx, ex):
                    return
                cancelled(ctx, ex)
                raise
            finally:
                deadlines.stop(task)
        ctx.first_byte_at = now = time.monotonic()
        ctx.try_first_byte(now)
        await send_initial(ex, ctx, await call.initial_metadata())
        trailing = client_trailers(chain, ctx, ex, await call.trailing_metadata())
        if trailing is None:
            return
        ctx.grpc_status = GRPC_OK
        ctx.bytes_out = len(response)
        await ex.write(response)
        ex.end(GRPC_OK, "", trailing)

    async def _stream(
        self,
        ex: GrpcExchange,
        ctx: RequestContext,
        chain: Chain,
        first: asyncio.Task[bytes | None] | None,
    ) -> None:
        assert ctx.endpoint is not None and ctx.route is not None
        task = asyncio.current_task(self.loop)
        assert task is not None
        deadlines = self.deadlines
        ctx.begin_try(ctx.endpoint.backend, ctx.endpoint.address, time.monotonic())
        metadata, timeout = upstream_metadata(ctx, ex)
        t = ctx.route.timeouts
        sent = time.monotonic()
        call: StreamCall = self.gateway.channels.stream(ctx.endpoint, ctx.info.path)(
            None, timeout=timeout, metadata=metadata
        )
        # The one extra task of a streaming call: client → upstream, as messages come.
        pump = self.loop.create_task(_pump(ex, call, ctx, task, first))
        deadlines.start(task, timeout)
        try:
            try:
                deadlines.tighten(task, t.first_byte_s, FIRST_BYTE)
                try:
                    initial = await call.initial_metadata()
                finally:  # upstream time, not Sluice's (x-sluice-overhead-ms)
                    ctx.upstream_s += time.monotonic() - sent
                ctx.first_byte_at = now = time.monotonic()
                ctx.try_first_byte(now)
                await send_initial(ex, ctx, initial)
                # Backpressure: the next upstream message is read only once the previous one
                # was accepted downstream (the upstream channel's window is fixed, see
                # channels.py). A client that reads nothing for idle_s: the upstream call is
                # cancelled at once (a pending grpc.aio write cannot be cancelled without
                # breaking the call); the client gets DEADLINE_EXCEEDED after the one message
                # already queued for it.
                while True:
                    deadlines.tighten(task, t.idle_s, IDLE)
                    msg = await call.read()
                    if msg is EOF:
                        break
                    assert isinstance(msg, bytes)
                    ctx.bytes_out += len(msg)
                    ctx.stream_event(time.monotonic())
                    deadlines.tighten(task, t.idle_s, STALL, call.cancel)
                    await ex.write(msg)
                    if deadlines.expired(task) == STALL:
                        _stalled(ctx, ex, "client stalled")
                        return
                deadlines.relax(task)
                code = await call.code()
            except grpc.aio.AioRpcError as e:
                if deadlines.expired(task) == STALL:  # we cancelled it: the client stalled
                    _stalled(ctx, ex, "client stalled")
                    return
                upstream_failed(ctx, ex, e)
                return
            except asyncio.CancelledError:
                if self._timed_out(task, ctx, ex):
                    return
                raise
            finally:
                deadlines.stop(task)
            trailing = client_trailers(chain, ctx, ex, await call.trailing_metadata())
            if trailing is None:
                return
            if code is grpc.StatusCode.OK:
                ctx.grpc_status = GRPC_OK
                ex.end(GRPC_OK, "", trailing)
            else:
                ctx.outcome = grpc_outcome(code.value[0])
                end(ctx, ex, code.value[0], await call.details(), trailing)
        finally:
            if not pump.done():
                pump.cancel()
            if not call.done():
                call.cancel()  # client gone or we failed: the upstream must stop at once

    def _timed_out(self, task: asyncio.Task[Any], ctx: RequestContext, ex: GrpcExchange) -> bool:
        """The task was cancelled by one of our deadlines (not the client): answer it. True if
        so."""
        kind = self.deadlines.expired(task)
        if kind is None or task.uncancel() > 0:
            return False
        if kind == STALL:  # the client stopped reading: nothing more will reach it
            _stalled(ctx, ex, "client did not read in time")
            return True
        if ctx.endpoint is not None:
            metrics.UPSTREAM_ERRORS.labels(ctx.endpoint.backend, "timeout").inc()
        ctx.outcome = Outcome.UPSTREAM_TIMEOUT
        what = {FIRST_BYTE: "first byte", IDLE: "idle"}.get(kind, "total")
        end(ctx, ex, GRPC_DEADLINE_EXCEEDED, f"upstream {what} timeout")
        return True


def _drop(read: asyncio.Task[bytes | None]) -> None:
    """The first message's read, after the call: cancelled if still waiting, its failure taken
    (a call refused before its message was forwarded)."""
    if not read.done():
        read.cancel()
    elif not read.cancelled():
        read.exception()


def _end_try(ctx: RequestContext) -> None:
    code = ctx.grpc_status if ctx.grpc_status is not None else GRPC_UNKNOWN
    ctx.end_try(time.monotonic(), code, "" if ctx.outcome is Outcome.OK else ctx.outcome.value)


def _stalled(ctx: RequestContext, ex: GrpcExchange, details: str) -> None:
    ctx.outcome = Outcome.STALLED
    end(ctx, ex, GRPC_DEADLINE_EXCEEDED, details)


def _retry(ctx: RequestContext, e: grpc.aio.AioRpcError) -> bool:
    """A unary call that failed UNAVAILABLE (nothing reached the client yet): try another
    member if the route's retries allow it (`gateway.forward.lifecycle.retry`)."""
    route = ctx.route
    if route is None or route.retries is None or e.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    ctx.grpc_status = GRPC_UNAVAILABLE
    ctx.outcome = Outcome.UPSTREAM_ERROR
    return retry(ctx, GRPC_UNAVAILABLE, "unavailable") is not None  # this try is over


async def _pump(
    ex: GrpcExchange,
    call: StreamCall,
    ctx: RequestContext,
    task: asyncio.Task[Any],
    first: asyncio.Task[bytes | None] | None,
) -> None:
    """Forward client messages upstream until the client half-closes or either side ends,
    `first` (the read of the first message, when the call was routed on it) first. A message
    the engine refuses ends the call (`task`, whose end cancels the upstream call) with the
    engine's code."""
    try:
        if first is not None:
            counted = first.done()  # read before routing: counted in bytes_in then
            msg = await first
            if msg is None:
                await call.done_writing()
                return
            if not counted:
                ctx.bytes_in += len(msg)
            await call.write(msg)
        while True:
            msg = await ex.read()
            if msg is None:
                break
            ctx.bytes_in += len(msg)
            await call.write(msg)
        await call.done_writing()
    except asyncio.CancelledError:
        raise
    except MessageRefused as e:
        ctx.grpc_status, ctx.outcome = e.code, Outcome.BAD_REQUEST
        task.cancel()
    except Exception:  # the upstream finished or the client went: the call reports it
        pass
