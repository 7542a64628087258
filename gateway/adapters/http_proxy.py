"""The per-request handler of the HTTP ingress: chain, then forward through the pool or answer.

Per request: RequestInfo → chain → (verdict answer | stream to the endpoint through
`gateway.http_pool` and stream the answer back). Limits and what the client sees are listed in
`gateway.adapters.http`; this module applies the per-request ones.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from gateway.adapters.admission import admit
from gateway.adapters.headers import JSON, error_body, retry_after_value
from gateway.adapters.http_messages import (
    BodyTooLarge,
    may_have_body,
    read_small,
    response_head,
    stream_body,
    upstream_headers,
)
from gateway.core.outcome import OUTCOME_OF, Outcome
from gateway.core.request import Protocol, RequestInfo
from gateway.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.filters.base import RequestContext
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from gateway.app import Gateway
    from gateway.snapshot import Snapshot as Active

SMALL_BODY = 64 * 1024  # a body this small with a known length is read whole: one write upstream


class Deadlines:
    """Total-time deadlines of the requests in flight, checked by one coarse ticker.

    `asyncio.timeout` costs ~4.6 µs per request here (a `call_at` alone ~2.9 µs); `total_s` is
    seconds to minutes, so a `TICK_S` ticker that runs only while requests are in flight, and
    cancels the overdue ones, is as good and costs a dict insert and pop per request.
    """

    TICK_S = 0.05

    __slots__ = ("_due", "_fired", "_timer")

    def __init__(self) -> None:
        self._due: dict[asyncio.Task[Any], float] = {}
        self._fired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(
        self, task: asyncio.Task[Any], deadline: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._due[task] = deadline
        if self._timer is None:
            self._timer = loop.call_later(self.TICK_S, self._tick, loop)

    def discard(self, task: asyncio.Task[Any]) -> bool:
        """Forget `task`; True if its deadline expired (and it was cancelled for that)."""
        self._due.pop(task, None)
        if self._fired and task in self._fired:
            self._fired.discard(task)
            return True
        return False

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        overdue = [t for t, d in self._due.items() if d <= now]
        for task in overdue:
            del self._due[task]
            self._fired.add(task)
            task.cancel()
        if self._due:
            self._timer = loop.call_later(self.TICK_S, self._tick, loop)


class HttpProxy:
    """The request handler: one instance per listener, no per-request closures."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.deadlines = Deadlines()

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        gateway = self.gateway
        active = gateway.active
        raw = request.raw_headers
        headers = {k.lower(): v for k, v in request.headers.items()}
        if len(headers) != len(raw):  # repeated names: join them, as RFC 9110 §5.3 allows
            headers = {}
            for k, v in request.headers.items():
                k = k.lower()
                headers[k] = v if k not in headers else headers[k] + ", " + v
        size = sum([len(n) + len(v) for n, v in raw]) + 4 * len(raw)
        target = request.raw_path
        path, _, query = target.partition("?")
        cl = request.content_length
        proto: Any = request.protocol
        info = RequestInfo(
            Protocol.HTTP,
            request.method,
            path,
            headers,
            proto.sluice_peer,
            headers.get("host", ""),
            cl,
        )
        ctx = RequestContext(info, active.policy)
        gateway.inflight.enter()
        try:
            refusal = await admit(ctx, active, size, len(raw))
            if refusal is not None:
                r = refusal
                return await self._error(request, ctx, r.status, r.kind, r.message, r.retry_after)
            assert ctx.route is not None
            upstream_path = ctx.route.upstream_path(path)
            if query:
                upstream_path += "?" + query
            return await self._forward(request, ctx, active, raw, upstream_path)
        except asyncio.CancelledError:
            if ctx.outcome is Outcome.OK:
                ctx.outcome = Outcome.CLIENT_CANCELLED
            raise
        finally:
            try:
                await gateway.finish(active, ctx)
            finally:
                gateway.inflight.leave()  # after finish: the drain waits for the bookkeeping too

    async def _forward(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        active: Active,
        raw: Any,
        upstream_path: str,
    ) -> web.StreamResponse:
        endpoint = ctx.endpoint
        route = ctx.route
        assert endpoint is not None and route is not None
        out = upstream_headers(raw, ctx, endpoint)
        limit = active.policy.policy.limits.max_body_bytes
        body: AsyncIterator[bytes] | bytes | None = None
        cl = ctx.info.content_length
        resp: web.StreamResponse | None = None
        # With an explicit loop: on CPython 3.11 get_running_loop() costs a getpid() syscall.
        loop = self.loop
        task = asyncio.current_task(loop)
        assert task is not None
        self.deadlines.add(task, loop.time() + route.timeouts.total_s, loop)
        try:
            if cl is not None and cl <= SMALL_BODY:
                if cl:
                    body = await read_small(request, cl)
                    ctx.bytes_in = len(body)
            elif request.body_exists:
                body = stream_body(request, ctx, limit)
            up = await self.gateway.http_pool.request(
                endpoint,
                request.method,
                upstream_path,
                out,
                body,
                route.timeouts,
                content_length=cl,
            )
            try:
                resp, length = response_head(up.status, up.reason, up.headers)
                ctx.http_status = up.status
                if ctx.request_id and "X-Request-Id" not in resp.headers:
                    resp.headers["X-Request-Id"] = ctx.request_id  # so clients can quote it
                if self.gateway.draining:
                    resp.force_close()
                chunk = await up.read_chunk()
                if up.complete:  # whole body is here: head + body in one write
                    if length is None and may_have_body(request.method, up.status):
                        resp.content_length = len(chunk)
                    await resp.prepare(request)
                    await resp.write_eof(chunk)
                    ctx.bytes_out = len(chunk)
                    return resp
                await resp.prepare(request)
                while chunk:  # SSE: each event goes out as soon as it arrived
                    ctx.bytes_out += len(chunk)
                    await resp.write(chunk)
                    chunk = await up.read_chunk()
                await resp.write_eof()
                return resp
            finally:
                up.release()
        except BodyTooLarge:
            return await self._fail(request, ctx, resp, 413, "body_too_large", "body too large")
        except UpstreamTimeout as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "timeout").inc()
            return await self._fail(request, ctx, resp, 504, "upstream_timeout", str(e))
        except asyncio.CancelledError:
            if not self.deadlines.discard(task) or task.uncancel() > 0:
                raise  # the client left (or both at once): not ours to answer
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "timeout").inc()
            msg = "upstream total timeout"
            return await self._fail(request, ctx, resp, 504, "upstream_timeout", msg)
        except UpstreamConnectError as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "connect").inc()
            return await self._fail(request, ctx, resp, 502, "upstream_connect_error", str(e))
        except (UpstreamProtocolError, UpstreamError) as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "protocol").inc()
            return await self._fail(request, ctx, resp, 502, "upstream_protocol_error", str(e))
        except (EOFError, BadHttpMessage):  # the client hung up inside its own body
            return await self._fail(request, ctx, resp, 400, "bad_request", "incomplete body")
        except ConnectionError:  # the client went away while we wrote to it
            ctx.outcome = Outcome.CLIENT_CANCELLED
            raise
        finally:
            self.deadlines.discard(task)

    async def _fail(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        resp: web.StreamResponse | None,
        status: int,
        error_type: str,
        message: str,
    ) -> web.StreamResponse:
        ctx.outcome = OUTCOME_OF.get(error_type, Outcome.INTERNAL)
        if resp is None or not resp.prepared:
            return await self._error(request, ctx, status, error_type, message)
        # The head is gone already: all we can do is cut the connection (truncated body).
        if request.transport is not None:
            request.transport.abort()
        return resp

    async def _error(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        status: int,
        error_type: str,
        message: str,
        retry_after: float | None = None,
    ) -> web.StreamResponse:
        ctx.http_status = status
        if ctx.outcome is Outcome.OK and status >= 400:
            ctx.outcome = OUTCOME_OF.get(error_type, Outcome.REJECTED)
        body = error_body(error_type or "error", message)
        resp = web.Response(status=status, body=body, content_type=JSON)
        if retry_after is not None:
            resp.headers["Retry-After"] = retry_after_value(retry_after)
        if ctx.request_id:
            resp.headers["X-Request-Id"] = ctx.request_id
        if self.gateway.draining or status in (413, 417, 431) or not request.content.is_eof():
            # 413/417/431: the rest of the request is not worth reading; a body still arriving
            # is not waited for either (as on the native engine)
            resp.force_close()
        ctx.bytes_out = len(body)
        return resp
