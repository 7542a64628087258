"""(compiled) The HTTP request lifecycle, written once for both engines.

Per request, in this order: header bounds (431), path safety (400), Expect (417), the chain's
`on_request` (its verdict; a route and an endpoint, else 404/503), Content-Length bound (413),
the body phase (a body up to `limits.max_buffered_body_bytes` is read whole within
`timeouts.body_read_s` before any upstream connection is taken, 408 past it; JSON bodies are
parsed and shown to `on_body`, which may rewrite them), the upstream call through the pool,
the response phase (`gateway.forward.relay`), and the finish (`gateway.forward.lifecycle`:
on_response in reverse, metrics, traffic book).

Failures map through the one table in `gateway.forward.failures`. Deadlines (total, body,
client stall) are the coarse ticker of `gateway.forward.deadlines`: an overdue request task is
cancelled and asks which deadline it was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final

from gateway import jsonfast
from gateway.context import RequestContext, Status
from gateway.core.outcome import Outcome
from gateway.core.request import unsafe_path
from gateway.core.verdict import (
    BAD_EXPECT,
    BAD_PATH,
    BODY_TOO_LARGE,
    GRPC_UNAVAILABLE,
    HEADERS_TOO_LARGE,
    NO_ROUTE,
    Verdict,
    reject,
)
from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from gateway.forward import answers, first_token, relay
from gateway.forward.body_phase import body_phase
from gateway.forward.deadlines import BODY, Deadlines
from gateway.forward.exchange import BodyTooLarge, Exchange
from gateway.forward.failures import TLS, failure_for
from gateway.forward.headers import request_headers
from gateway.forward.lifecycle import Lifecycle, retry

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable

    from gateway.app import Gateway
    from gateway.policy.compiled import RouteTimeouts
    from gateway.snapshot import Bounds, Snapshot
    from gateway.upstream.pool import UpstreamPool
    from gateway.upstream.response import UpstreamResponse

_monotonic: Final = time.monotonic  # a static: no module attribute lookup per call

log: Final = logging.getLogger("sluice.forward")

UPLOADS_FULL: Final = reject(
    503, GRPC_UNAVAILABLE, "uploads_busy", "too many streamed uploads to this backend", 1.0
)


class HttpForward:
    """One per listener (and loop); no per-request closures."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.deadlines = Deadlines(loop)
        self.lifecycle = Lifecycle(gateway, loop)
        # The gateway's upstream pool (one for its life): read here once, not through its
        # property on every request.
        self.pool: UpstreamPool = gateway.http_pool

    async def serve(self, ex: Exchange) -> None:
        """Serve one request to its end. Raises CancelledError / ConnectionError only when the
        client went away; every other failure is answered.

        Compiled (`gateway.native`): no `await` here runs inside an `except` or `finally` block.
        mypyc keeps one exception state per thread, not per coroutine, so a block that waits
        restores, when it ends, a state saved while an exception was being thrown into the
        task, and that exception was raised again later (a failed backend TLS handshake, after
        its 502). What such a block would await is awaited after it instead."""
        info = ex.info
        snap, ctx = self.lifecycle.begin(info)
        left: BaseException | None = None  # the client went away: raised once finished
        bug = False
        try:
            verdict = self._admit(ex, ctx, snap)
            if verdict is not None and verdict.__class__ is not Verdict:
                verdict = await verdict  # type: ignore[misc]
            if verdict is not None:
                await answers.refuse(ex, ctx, verdict, self.gateway.draining)
            else:
                await self._forward(ex, ctx, snap)
        except (asyncio.CancelledError, ConnectionError) as e:
            if ctx.outcome is Outcome.OK:
                ctx.outcome = Outcome.CLIENT_CANCELLED
            left = e
        except Exception:  # a bug of ours: one log line with the traceback, a 500 if possible
            log.exception("HTTP request failed: %s %s", info.method, info.path[:200])
            ctx.outcome = Outcome.INTERNAL
            bug = True
        if bug:
            left = await self._internal(ex, ctx)
        pending = self.lifecycle.finish(snap, ctx)
        if pending is not None:
            await pending
        if left is not None:
            raise left

    async def _internal(self, ex: Exchange, ctx: RequestContext) -> BaseException | None:
        """After a bug of ours: a 500 when no head went out yet, else the connection cut. What
        stopped that answer is returned, to be raised once the request is finished."""
        try:
            if not ex.head_sent:
                await answers.answer(
                    ex, ctx, 500, "internal", "gateway error", self.gateway.draining, close=True
                )
            else:
                ex.abort()
        except BaseException as e:
            return e
        return None

    async def cancelled(self, ex: Exchange) -> None:
        """A request whose client left before it could be served (an HTTP/2 stream reset before
        its task ran): recorded through `finish` as cancelled; no filter ran."""
        snap, ctx = self.lifecycle.begin(ex.info)
        ctx.outcome = Outcome.CLIENT_CANCELLED
        pending = self.lifecycle.finish(snap, ctx)
        if pending is not None:
            await pending

    def _admit(
        self, ex: Exchange, ctx: RequestContext, snap: Snapshot
    ) -> Verdict | None | Awaitable[Verdict | None]:
        """Checks, then the chain's request phase: None (go on), a Verdict, or an awaitable."""
        info = ctx.info
        limits = snap.bounds
        if (
            ex.header_bytes > limits.max_header_bytes
            or len(ex.raw_headers) > limits.max_header_count
        ):
            return HEADERS_TOO_LARGE  # no filter saw it: none gets on_response (ctx.ran == 0)
        if unsafe_path(info.path):
            return BAD_PATH
        expect = info.headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            return BAD_EXPECT
        status = snap.chain.run_request(ctx)
        if isinstance(status, Status):
            return self._admitted(ctx, status, limits)
        return self._admit_later(ctx, status, limits)

    async def _admit_later(
        self, ctx: RequestContext, pending: Awaitable[Status], limits: Bounds
    ) -> Verdict | None:
        return self._admitted(ctx, await pending, limits)

    def _admitted(self, ctx: RequestContext, status: Status, limits: Bounds) -> Verdict | None:
        if status is Status.STOP:
            return ctx.verdict
        # A route that needs the body's model or prompt takes its member in the body phase.
        if ctx.route is None or (ctx.endpoint is None and not ctx.route.needs_body):
            return NO_ROUTE
        cl = ctx.info.content_length
        if cl is not None and cl > limits.max_body_bytes:
            return BODY_TOO_LARGE
        return None

    async def _forward(self, ex: Exchange, ctx: RequestContext, snap: Snapshot) -> None:
        route = ctx.route
        assert route is not None
        limits, timeouts = snap.bounds, route.timeouts
        info = ctx.info
        loop = self.loop
        task = ex.task
        if task is None:
            task = asyncio.current_task(loop)
        assert task is not None
        deadlines = self.deadlines
        deadlines.start(task, timeouts.total_s)
        body: AsyncIterator[bytes] | bytes | None = None
        streamed = False
        pool = self.pool
        early: Exception | None = None  # what ended the request before its answer began
        expired: str | None = None  # the deadline that cancelled the task
        try:
            try:
                try:
                    if ex.has_body:
                        cap = min(limits.max_buffered_body_bytes, limits.max_body_bytes)
                        whole = ex.whole_body(cap)
                        if whole is None:  # not all here yet: read it within body_read_s
                            deadlines.tighten(task, limits.body_read_s, BODY)
                            whole = await ex.read_body(cap)
                            deadlines.relax(task)
                        if whole is not None:
                            body = whole
                            ctx.bytes_in = len(whole)
                        else:
                            body = Counted(ex.body_stream(limits.max_body_bytes), ctx)
                            streamed = True
                    if snap.chain.has_body:
                        verdict = body_phase(ctx, snap.chain, body, info.content_length)
                        if verdict is not None:
                            await answers.refuse(ex, ctx, verdict, self.gateway.draining)
                            return
                        b = ctx.body
                        if b is not None and b.dirty and b.doc is not None:
                            body = jsonfast.rewritten(b.raw, b.doc, b.changes)
                            ctx.bytes_in = len(body)
                        if ctx.route is not route:  # decided on the body: its own deadline
                            route = ctx.route
                            assert route is not None
                            timeouts = route.timeouts
                            deadlines.start(task, timeouts.total_s)
                    endpoint = ctx.endpoint
                    if endpoint is None:
                        await answers.refuse(ex, ctx, NO_ROUTE, self.gateway.draining)
                        return
                    if (
                        streamed
                        and pool.uploads(endpoint) >= limits.max_streamed_uploads_per_backend
                    ):
                        await answers.refuse(ex, ctx, UPLOADS_FULL, self.gateway.draining)
                        return
                    path = info.path
                    if route.strip_prefix:
                        path = route.upstream_path(path)
                    if ex.query:
                        path += "?" + ex.query
                    # begin_try counts the attempt and, when tracing, aims traceparent at this try.
                    ctx.begin_try(endpoint.backend, endpoint.address, _monotonic())
                    headers = request_headers(ex.raw_headers, ctx, endpoint)
                    if streamed:  # a streamed body cannot be sent twice: one try
                        pool.upload_started(endpoint)
                        sent = _monotonic()
                        try:
                            up = await pool.request(
                                endpoint, info.method, path, headers, body, timeouts,
                                content_length=info.content_length,
                            )  # fmt: skip
                        finally:
                            pool.upload_done(endpoint)
                            ctx.upstream_s += _monotonic() - sent
                    else:
                        assert body is None or isinstance(body, bytes)
                        if route.retries is None:  # one try (`tries` without its coroutine)
                            sent = _monotonic()
                            try:
                                up = await pool.request(
                                    endpoint, info.method, path, headers, body, timeouts
                                )
                            finally:
                                ctx.upstream_s += _monotonic() - sent
                        else:
                            up = await self.tries(
                                ctx, ex, info.method, path, headers, body, timeouts
                            )
                        if route.retries is not None and route.retries.before_first_token:
                            up = await first_token.until_first_token(
                                self.tries, ctx, ex, info.method, path, body, up, snap
                            )
                    ctx.try_first_byte(_monotonic(), up.status)
                except (BodyTooLarge, EOFError, UpstreamError) as e:
                    early = e  # answered after the block (`serve`: no await inside one)
                if early is not None:
                    await answers.before_answer(ex, ctx, early, self.gateway.draining)
                    return
                try:
                    end = relay.relay(ex, ctx, snap, up, task, deadlines, self.gateway)
                    if end is not None and not isinstance(end, Verdict | UpstreamError):
                        end = await end
                    if end is not None:  # what the response phase left to answer
                        if isinstance(end, Verdict):
                            await answers.refuse(ex, ctx, end, self.gateway.draining)
                        else:
                            await answers.upstream_failed(ex, ctx, end, self.gateway.draining)
                finally:
                    up.release()
            except asyncio.CancelledError:
                expired = deadlines.expired(task)
                if expired is None or task.uncancel() > 0:
                    raise  # the client left (or both at once): not ours to answer
            if expired is not None:
                await answers.expired(ex, ctx, expired, self.gateway.draining)
        finally:
            deadlines.stop(task)
            ctx.end_try(_monotonic(), 0, "" if ctx.outcome is Outcome.OK else ctx.outcome.value)

    async def tries(
        self,
        ctx: RequestContext,
        ex: Exchange,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        timeouts: RouteTimeouts,
    ) -> UpstreamResponse:
        """The upstream call, tried again where the route allows and it is safe
        (`gateway.forward.lifecycle.retry`: a connection that could not be had, or a 503
        before any byte reached the client; within the attempts and the route's retry budget,
        on another member). Each try's connect and first-byte timeouts are capped by the
        route's `retries.per_try_timeout_s`. The first try was begun by the caller."""
        pool = self.pool
        route = ctx.route
        assert route is not None and ctx.endpoint is not None
        sent = _monotonic()
        if route.retries is None:
            try:
                return await pool.request(ctx.endpoint, method, path, headers, body, timeouts)
            finally:
                ctx.upstream_s += _monotonic() - sent
        per_try = route.try_timeouts or timeouts
        while True:
            endpoint = ctx.endpoint
            assert endpoint is not None
            sent = _monotonic()
            try:
                up = await pool.request(endpoint, method, path, headers, body, per_try)
            except UpstreamError as e:
                ctx.upstream_s += _monotonic() - sent
                f = failure_for(e)
                never_sent = isinstance(e, UpstreamConnectError) or (
                    isinstance(e, UpstreamTimeout) and e.phase == "connect"
                )
                ctx.outcome = f.outcome if f is TLS or not never_sent else Outcome.UPSTREAM_CONNECT
                ctx.detail = str(e)[:200]
                nxt = retry(ctx, 0, f.kind)
                if nxt is None:
                    raise
            else:
                ctx.upstream_s += _monotonic() - sent
                if up.status != 503:
                    return up
                ctx.try_first_byte(_monotonic(), 503)
                ctx.http_status = 503
                ctx.outcome = Outcome.UPSTREAM_ERROR
                nxt = retry(ctx, 503, None)
                if nxt is None:
                    return up  # passed on as the backend sent it
                up.discard()
            ctx.begin_try(nxt.backend, nxt.address, _monotonic())
            headers = request_headers(ex.raw_headers, ctx, nxt)


class Counted:
    """A streamed request body, each chunk's size added to `ctx.bytes_in` as it passes. An
    iterator class, not an async generator: mypyc compiles no async generators."""

    __slots__ = ("chunks", "ctx")

    def __init__(self, chunks: AsyncIterator[bytes], ctx: RequestContext) -> None:
        self.chunks = chunks
        self.ctx = ctx

    def __aiter__(self) -> Counted:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.chunks.__anext__()
        self.ctx.bytes_in += len(chunk)
        return chunk
