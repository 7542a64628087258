"""The per-request handler of the native HTTP engine: chain, then forward through the pool.

The same steps, limits and error mapping as `gateway.adapters.http_proxy.HttpProxy` (read it
first), on a parsed `Req` from `gateway.adapters.h1` instead of an aiohttp request; responses are
encoded here as raw bytes (no Server header; Date cached per second).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gateway.adapters.admission import admit
from gateway.adapters.h1_messages import CONTINUE, REASONS, Req, date_value, simple_response
from gateway.adapters.headers import RESPONSE_DROP, connection_listed
from gateway.adapters.headers import retry_after_value as _retry_after
from gateway.adapters.http_messages import BodyTooLarge, may_have_body, upstream_headers
from gateway.adapters.http_proxy import SMALL_BODY, Deadlines
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

    from gateway.adapters.h1 import H1Conn
    from gateway.adapters.upstream_response import UpstreamResponse
    from gateway.app import Gateway
    from gateway.snapshot import Snapshot as Active

log = logging.getLogger(__name__)


class H1Proxy:
    """The request handler: one instance per listener, no per-request closures."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway = gateway
        self.loop = loop
        self.deadlines = Deadlines()

    async def handle(self, conn: H1Conn, req: Req) -> None:
        req.started = True
        try:
            await self._serve(conn, req)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the client left: the request is recorded as cancelled
        except Exception:  # a bug of ours: log it, cut this connection, keep serving others
            log.exception("native HTTP request failed")
            req.responded = False
        finally:
            conn.request_done(req)

    async def _serve(self, conn: H1Conn, req: Req) -> None:
        gateway = self.gateway
        active = gateway.active
        raw = req.headers
        headers: dict[str, str] = {}
        for n, v in raw:  # repeated names: join them, as RFC 9110 §5.3 allows
            k = n.decode("latin-1").lower()
            s = v.decode("utf-8", "surrogateescape")
            headers[k] = s if k not in headers else headers[k] + ", " + s
        path, _, query = req.target.decode("utf-8", "surrogateescape").partition("?")
        cl_raw = headers.get("content-length")
        cl = int(cl_raw) if cl_raw is not None else None  # digits only: llhttp checked them
        info = RequestInfo(
            Protocol.HTTP, req.method, path, headers, conn.peer, headers.get("host", ""), cl
        )
        ctx = RequestContext(info, active.policy)
        gateway.inflight.enter()
        try:
            expect = headers.get("expect")
            if expect is not None and expect.lower() != "100-continue":
                ctx.ran = 0  # refused before any filter saw it
                msg = "only 100-continue is supported"
                return await self._error(conn, req, ctx, 417, "expectation_failed", msg)
            refusal = await admit(ctx, active, req.header_size, len(raw))
            if refusal is not None:
                r = refusal
                return await self._error(conn, req, ctx, r.status, r.kind, r.message, r.retry_after)
            assert ctx.route is not None
            upstream_path = ctx.route.upstream_path(path)
            if query:
                upstream_path += "?" + query
            return await self._forward(conn, req, ctx, active, upstream_path)
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
        self, conn: H1Conn, req: Req, ctx: RequestContext, active: Active, upstream_path: str
    ) -> None:
        endpoint = ctx.endpoint
        route = ctx.route
        assert endpoint is not None and route is not None
        out = upstream_headers(req.headers, ctx, endpoint)
        limit = active.policy.policy.limits.max_body_bytes
        body: AsyncIterator[bytes] | bytes | None = None
        cl = ctx.info.content_length
        loop = self.loop
        task = asyncio.current_task(loop)
        assert task is not None
        self.deadlines.add(task, loop.time() + route.timeouts.total_s, loop)
        try:
            if cl is not None and cl <= SMALL_BODY:
                if cl:
                    body = await self._read_all(conn, req)
                    ctx.bytes_in = len(body)
            elif req.chunked or cl:
                body = self._stream(conn, req, ctx, limit)
            up = await self.gateway.http_pool.request(
                endpoint, req.method, upstream_path, out, body, route.timeouts, content_length=cl
            )
            try:
                await self._relay(conn, req, ctx, up)
            finally:
                up.release()
        except BodyTooLarge:
            await self._fail(conn, req, ctx, 413, "body_too_large", "body too large")
        except UpstreamTimeout as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "timeout").inc()
            await self._fail(conn, req, ctx, 504, "upstream_timeout", str(e))
        except asyncio.CancelledError:
            if not self.deadlines.discard(task) or task.uncancel() > 0:
                raise  # the client left (or both at once): not ours to answer
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "timeout").inc()
            msg = "upstream total timeout"
            await self._fail(conn, req, ctx, 504, "upstream_timeout", msg)
        except UpstreamConnectError as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "connect").inc()
            await self._fail(conn, req, ctx, 502, "upstream_connect_error", str(e))
        except (UpstreamProtocolError, UpstreamError) as e:
            metrics.UPSTREAM_ERRORS.labels(endpoint.backend, "protocol").inc()
            await self._fail(conn, req, ctx, 502, "upstream_protocol_error", str(e))
        except EOFError:  # the client's body was malformed or cut
            await self._fail(conn, req, ctx, 400, "bad_request", "incomplete body")
        except ConnectionError:  # the client went away while we wrote to it
            ctx.outcome = Outcome.CLIENT_CANCELLED
            raise
        finally:
            self.deadlines.discard(task)

    async def _relay(
        self, conn: H1Conn, req: Req, ctx: RequestContext, up: UpstreamResponse
    ) -> None:
        transport = conn.transport
        assert transport is not None
        status = up.status
        ctx.http_status = status
        reason = up.reason.encode("latin-1") if up.reason else REASONS.get(status, b"")
        head = bytearray(b"HTTP/1.1 %d %b\r\n" % (status, reason))
        length: int | None = None
        chunked_up = False
        conn_listed: set[bytes] | None = None
        has_date = has_rid = False
        kept: list[tuple[bytes, bytes]] = []
        for n, v in up.headers:
            ln = n.lower()
            if ln in RESPONSE_DROP:
                if ln == b"content-length":
                    if v.isdigit():
                        length = int(v)
                elif ln == b"transfer-encoding":
                    chunked_up = True
                elif ln == b"connection":
                    conn_listed = connection_listed(v)
                continue
            if ln == b"date":
                has_date = True
            elif ln == b"x-request-id":
                has_rid = True
            kept.append((n, v))
        for n, v in kept:
            if conn_listed is None or n.lower() not in conn_listed:
                head += b"%b: %b\r\n" % (n, v)
        if chunked_up:
            length = None
        if not has_date:
            head += b"date: %b\r\n" % date_value()
        if ctx.request_id and not has_rid:
            head += b"x-request-id: %b\r\n" % ctx.request_id.encode("latin-1")
        bodied = may_have_body(req.method, status)
        chunk = await up.read_chunk()
        if up.complete:  # whole body is here: head + body in one write
            if bodied:
                head += b"content-length: %d\r\n" % (len(chunk) if length is None else length)
            elif length is not None:
                head += b"content-length: %d\r\n" % length
            self._finish_head(conn, req, head)
            transport.write(bytes(head) + chunk if bodied else bytes(head))
            ctx.bytes_out = len(chunk)
            return
        framed = False
        if length is not None:
            head += b"content-length: %d\r\n" % length
        elif bodied and not req.http10:
            head += b"transfer-encoding: chunked\r\n"
            framed = True
        elif bodied:
            req.keep_alive = False  # HTTP/1.0: the end of the body is the close
        self._finish_head(conn, req, head)
        transport.write(bytes(head))
        while chunk:  # SSE: each event goes out as soon as it arrived
            ctx.bytes_out += len(chunk)
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if framed else chunk)
            if conn.write_paused or conn.closed:
                await conn.drain()
            chunk = await up.read_chunk()
        if framed:
            transport.write(b"0\r\n\r\n")

    def _finish_head(self, conn: H1Conn, req: Req, head: bytearray) -> None:
        close = not req.keep_alive or self.gateway.draining or not req.body_done or conn.stopping
        if close:
            head += b"connection: close\r\n\r\n"
        elif req.http10:
            head += b"connection: keep-alive\r\n\r\n"
        else:
            head += b"\r\n"
        req.close = close
        req.responded = True

    async def _read_all(self, conn: H1Conn, req: Req) -> bytes:
        """A small body of known length: usually already buffered, so no wait, no copy."""
        self._continue(conn, req)
        while not req.body_done:
            if req.body_error or conn.closed:
                raise EOFError("incomplete body")
            await conn.wait()
        data = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        req.body.clear()
        req.buffered = 0
        return data

    async def _stream(
        self, conn: H1Conn, req: Req, ctx: RequestContext, limit: int
    ) -> AsyncIterator[bytes]:
        self._continue(conn, req)
        body = req.body
        while True:
            if body:
                chunk = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                req.buffered = 0
                if conn.read_paused:
                    conn.flow()
                ctx.bytes_in += len(chunk)
                if ctx.bytes_in > limit:
                    raise BodyTooLarge()
                yield chunk
            elif req.body_done:
                return
            elif req.body_error or conn.closed:
                raise EOFError("incomplete body")
            else:
                await conn.wait()

    def _continue(self, conn: H1Conn, req: Req) -> None:
        if req.continued or req.body_done or conn.transport is None:
            return
        req.continued = True
        for n, _ in req.headers:
            if n.lower() == b"expect":  # checked to be 100-continue before the chain
                conn.transport.write(CONTINUE)
                return

    async def _fail(
        self, conn: H1Conn, req: Req, ctx: RequestContext, status: int, kind: str, text: str
    ) -> None:
        ctx.outcome = OUTCOME_OF.get(kind, Outcome.INTERNAL)
        if not req.responded:
            return await self._error(conn, req, ctx, status, kind, text)
        # The head is gone already: all we can do is cut the connection (truncated body).
        req.responded = False
        if conn.transport is not None:
            conn.transport.abort()

    async def _error(
        self,
        conn: H1Conn,
        req: Req,
        ctx: RequestContext,
        status: int,
        error_type: str,
        message: str,
        retry_after: float | None = None,
    ) -> None:
        ctx.http_status = status
        if ctx.outcome is Outcome.OK and status >= 400:
            ctx.outcome = OUTCOME_OF.get(error_type, Outcome.REJECTED)
        extra = b""
        if retry_after is not None:
            extra += b"retry-after: %b\r\n" % _retry_after(retry_after).encode()
        if ctx.request_id:
            extra += b"x-request-id: %b\r\n" % ctx.request_id.encode("latin-1")
        close = (
            self.gateway.draining
            or status in (413, 417, 431)  # the rest of the request is not worth reading
            or not req.keep_alive
            or not req.body_done
            or conn.stopping
        )
        if not close and req.http10:
            extra += b"connection: keep-alive\r\n"
        head = req.method == "HEAD"
        data = simple_response(status, error_type or "error", message, extra, close, head)
        req.close = close
        req.responded = True
        ctx.bytes_out = len(data) - data.index(b"\r\n\r\n") - 4
        if conn.transport is not None and not conn.closed:
            conn.transport.write(data)
