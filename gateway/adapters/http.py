"""HTTP/1.1 ingress: aiohttp's low-level `web.Server` in front of the filter chain and the pool.

Per request: RequestInfo → chain → (verdict answer | stream to the endpoint through
`gateway.http_pool` and stream the answer back). The adapter translates and does nothing else:
decisions live in filters, connections in the pool.

Limits and what the client sees:
- a header line over `max_line_bytes` (aiohttp's `max_line_size` / `max_field_size`) and more
  than `max_header_count` headers (aiohttp's `max_headers`) are refused by aiohttp's parser; our
  handler class maps those parser errors from 400 to 431 with a JSON body (connection closed).
  A request line over `max_line_bytes` gets the same 431 (aiohttp raises the same LineTooLong;
  414 would need a guess). These never reach the handler: no chain, no `finish`, no metric.
  The total of `max_header_bytes` is checked in the handler → 431 (aiohttp has no such limit);
  the chain is skipped, `finish` still runs.
- body: Content-Length over `max_body_bytes` → 413 before any backend is contacted; a chunked body
  that grows past it aborts the upstream request → 413 (or a cut if the answer had begun).
- header-read deadline: aiohttp 3.14 has none for the first request of a connection, so the
  handler class closes a connection that has not completed a request head within
  `header_read_s`; between requests aiohttp's `keepalive_timeout` (`keepalive_s`) closes idle and
  half-sent keep-alive connections.
- client disconnect: `handler_cancellation=True` makes aiohttp cancel the handler task; the pool
  then aborts the upstream connection and the request is recorded with `ctx.cancelled = True`.
- total deadline (`route.timeouts.total_s`): 504 before the response head, a cut after it;
  enforced by `_Deadlines` (one ticker, ±50 ms) instead of a timer per request.
- keep-alive timeout and parser limits are read from the policy when the listener starts; a
  reload changes them only for the next start (everything else is read per request).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from gateway.adapters.headers import (
    REQUEST_DROP,
    RESPONSE_DROP,
    connection_listed,
    error_body,
    retry_after_value,
)
from gateway.core.request import Protocol, RequestInfo
from gateway.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.filters.base import RequestContext, Status
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from gateway.app import Active, Gateway
    from gateway.policy.compiled import Endpoint

SMALL_BODY = 64 * 1024  # a body this small with a known length is read whole: one write upstream
_JSON = "application/json"


class _BodyTooLarge(Exception):
    pass


class _Response(web.StreamResponse):
    """A StreamResponse whose head leaves with the first body bytes: one write, not two.

    (aiohttp's plain `Response` does this; `StreamResponse` flushes the head in `prepare()`.
    We always hold the first chunk when we prepare, so nothing waits for it.)"""

    _send_headers_immediately = False


class _Handler(RequestHandler):
    """aiohttp's per-connection protocol, plus a header deadline, a cached peer and 431s."""

    __slots__ = ("sluice_peer", "_header_deadline", "_header_timer")

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.sluice_peer = ""
        self._header_deadline = manager.header_read_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.sluice_peer = str(peer[0]) if peer else ""
        self._header_timer = self._loop.call_later(self._header_deadline, self._header_expired)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _header_expired(self) -> None:
        self._header_timer = None
        if getattr(self, "_request_count", 1) == 0 and self.transport is not None:
            self.transport.close()  # no complete request head in time (slowloris)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status == 400 and (
            isinstance(exc, LineTooLong)
            or (isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc))
        ):
            resp = web.Response(
                status=431,
                body=error_body("headers_too_large", "request header fields too large"),
                content_type=_JSON,
            )
            resp.force_close()
            return resp
        return super().handle_error(request, status, exc, message)


class _Server(web.Server):
    """`web.Server` that builds our handler class (aiohttp builds `RequestHandler` itself)."""

    def __init__(self, *args: Any, header_read_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_read_s = header_read_s

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class HttpListener:
    """A bound HTTP listener. `port` is the real port (useful with port 0)."""

    def __init__(self, runner: web.ServerRunner, site: web.TCPSite, server: _Server) -> None:
        self._runner = runner
        self._site: web.TCPSite | None = site
        self._server = server
        addrs = runner.addresses
        self.port: int = int(addrs[0][1]) if addrs else 0

    async def stop_accepting(self) -> None:
        """Close the listening socket; open connections keep being served."""
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()

    async def close(self, timeout: float) -> None:
        """Stop accepting, give in-flight handlers `timeout` seconds, then close everything."""
        await self.stop_accepting()
        self._server.pre_shutdown()
        await self._server.shutdown(timeout)
        await self._runner.cleanup()


class _Deadlines:
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


class _Proxy:
    """The request handler: one instance per listener, no per-request closures."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.deadlines = _Deadlines()

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        gateway = self.gateway
        active = gateway.active
        limits = active.policy.policy.limits
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
            if size > limits.max_header_bytes or len(raw) > limits.max_header_count:
                ctx.attrs["_ran"] = 0  # no filter saw this request: none gets on_response
                return await self._error(
                    request, ctx, 431, "headers_too_large", "request header fields too large"
                )
            if await active.chain.on_request(ctx) is Status.STOP:
                vd = ctx.verdict
                return await self._error(
                    request, ctx, vd.http_status, vd.error_type, vd.reason, vd.retry_after
                )
            if ctx.route is None or ctx.endpoint is None:
                return await self._error(request, ctx, 404, "no_route", "no route matches")
            if cl is not None and cl > limits.max_body_bytes:
                return await self._error(request, ctx, 413, "body_too_large", "body too large")
            upstream_path = ctx.route.upstream_path(path)
            if query:
                upstream_path += "?" + query
            return await self._forward(request, ctx, active, raw, upstream_path)
        except asyncio.CancelledError:
            ctx.cancelled = True
            ctx.error = ctx.error or "client_cancelled"
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
        out = _upstream_headers(raw, ctx, endpoint)
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
                    body = await _read_small(request, cl)
                    ctx.bytes_in = len(body)
            elif request.body_exists:
                body = _stream_body(request, ctx, limit)
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
                resp, length = _response_head(up.status, up.reason, up.headers)
                ctx.http_status = up.status
                if ctx.request_id and "X-Request-Id" not in resp.headers:
                    resp.headers["X-Request-Id"] = ctx.request_id  # so clients can quote it
                if self.gateway.draining:
                    resp.force_close()
                chunk = await up.read_chunk()
                if up.complete:  # whole body is here: head + body in one write
                    if length is None and _may_have_body(request.method, up.status):
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
        except _BodyTooLarge:
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
            ctx.cancelled = True
            return await self._fail(request, ctx, resp, 400, "bad_request", "incomplete body")
        except ConnectionError:  # the client went away while we wrote to it
            ctx.cancelled = True
            ctx.error = "client_disconnected"
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
        ctx.error = error_type
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
        if not ctx.error and status >= 400:
            ctx.error = error_type
        body = error_body(error_type or "error", message)
        resp = web.Response(status=status, body=body, content_type=_JSON)
        if retry_after is not None:
            resp.headers["Retry-After"] = retry_after_value(retry_after)
        if ctx.request_id:
            resp.headers["X-Request-Id"] = ctx.request_id
        if self.gateway.draining or status in (413, 431):
            resp.force_close()  # 413/431: the rest of the request is not worth reading
        ctx.bytes_out = len(body)
        return resp


async def _read_small(request: web.BaseRequest, length: int) -> bytes:
    """A small body of known length: usually already buffered, so no read loop, no copy."""
    content = request.content
    data = content.read_nowait(-1)
    if len(data) < length:
        data += await content.readexactly(length - len(data))
    return data


def _may_have_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


async def _stream_body(
    request: web.BaseRequest, ctx: RequestContext, limit: int
) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_any():
        ctx.bytes_in += len(chunk)
        if ctx.bytes_in > limit:
            raise _BodyTooLarge()
        yield chunk


def _upstream_headers(
    raw: Any, ctx: RequestContext, endpoint: Endpoint
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop, plus Host, X-Forwarded-* and the filters' headers."""
    extra = ctx.upstream_headers
    drop = REQUEST_DROP
    conn_listed: set[bytes] | None = None
    xff = b""
    out: list[tuple[bytes, bytes]] = [(b"host", endpoint.address.encode())]
    for n, v in raw:
        ln = n.lower()
        if ln in drop:
            if ln == b"connection":
                conn_listed = connection_listed(v)
            elif ln == b"x-forwarded-for":
                xff = v if not xff else xff + b", " + v
            continue
        if extra and ln.decode("latin-1") in extra:
            continue
        out.append((n, v))
    if conn_listed:
        out = [(n, v) for n, v in out if n.lower() not in conn_listed or n == b"host"]
    peer = ctx.info.peer.encode()
    out.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
    out.append((b"x-forwarded-proto", b"http"))
    for name, value in extra.items():
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out


def _response_head(
    status: int, reason: str, headers: list[tuple[bytes, bytes]]
) -> tuple[web.StreamResponse, int | None]:
    """The client response for an upstream head: hop-by-hop dropped, length kept if known."""
    resp = _Response(status=status, reason=reason or None)
    h = resp.headers
    length: int | None = None
    chunked = False
    conn_listed: set[bytes] | None = None
    for n, v in headers:
        ln = n.lower()
        if ln in RESPONSE_DROP:
            if ln == b"content-length":
                with contextlib.suppress(ValueError):
                    length = int(v)
            elif ln == b"transfer-encoding":
                chunked = True
            elif ln == b"connection":
                conn_listed = connection_listed(v)
            continue
        if conn_listed is not None and ln in conn_listed:
            continue
        h.add(n.decode("latin-1"), v.decode("latin-1"))
    if conn_listed:
        for name in conn_listed:
            h.popall(name.decode("latin-1"), None)
    if length is not None and not chunked:
        resp.content_length = length
    else:
        length = None
    return resp, length


async def start_http(
    gateway: Gateway, host: str, port: int, *, reuse_port: bool = False
) -> HttpListener:
    """Bind the HTTP ingress. Parser limits and keep-alive come from the policy at start."""
    policy = gateway.active.policy.policy
    limits, timeouts = policy.limits, policy.timeouts
    server = _Server(
        _Proxy(gateway, asyncio.get_running_loop()),
        handler_cancellation=True,
        header_read_s=timeouts.header_read_s,
        keepalive_timeout=timeouts.keepalive_s,
        max_line_size=limits.max_line_bytes,
        max_field_size=limits.max_line_bytes,
        max_headers=limits.max_header_count,
        access_log=None,
        auto_decompress=False,
    )
    runner = web.ServerRunner(server, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    return HttpListener(runner, site, server)
