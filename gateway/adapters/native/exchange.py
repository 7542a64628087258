"""(compiled) The native engine's `Exchange`: one parsed request (`Req`) on an `H1Conn`, as raw
bytes.

Moves bytes only: the body from the connection's buffer (with flow control and
`100 Continue`), the response head and body to the transport (chunked framing, Connection,
Date). Every decision is in `gateway.forward.http`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Final

from gateway.adapters.common import DEFER_MAX, REASONS, date_value
from gateway.adapters.native.messages import CONTINUE, HIGH_WATER, Req
from gateway.core.request import RequestInfo, Wire
from gateway.forward.exchange import BodyTooLarge
from gateway.forward.headers import header_key, header_value

if TYPE_CHECKING:
    # The connection's class itself, not a Protocol: compiled code reads a compiled class's
    # fields and calls its methods directly, and a Protocol's by name (~175 instructions each).
    from gateway.adapters.native.conn import H1Conn
    from gateway.forward.http import HttpForward

log: Final = logging.getLogger(__name__)

_LAST_CHUNK: Final = b"0\r\n\r\n"
# Each status line made once (a `%` format a response before).
_STATUS_LINES: Final = {
    s: b"HTTP/1.1 %d %b\r\n" % (s, REASONS.get(s, b"")) for s in range(100, 600)
}


class H1Exchange:
    __slots__ = (
        "conn", "req", "info", "raw_headers", "header_bytes", "query", "has_body", "head_sent",
        "sse", "framed", "draining", "close_after", "task",
    )  # fmt: skip

    def __init__(self, conn: H1Conn, req: Req, draining: bool) -> None:
        self.conn = conn
        self.req = req
        raw = req.headers
        headers: dict[str, str] = {}
        for n, v in raw:  # repeated names: join them, as RFC 9110 §5.3 allows
            k = header_key(n)
            s = header_value(v)
            headers[k] = s if k not in headers else headers[k] + ", " + s
        path, _, self.query = header_value(req.target).partition("?")
        cl_raw = headers.get("content-length")
        cl = int(cl_raw) if cl_raw is not None else None  # digits only: llhttp checked them
        self.info = RequestInfo(
            Wire.HTTP,
            req.method,
            path,
            headers,
            conn.peer,
            headers.get("host", ""),
            cl,
            conn.client_cert,
        )
        self.raw_headers: Sequence[tuple[bytes, bytes]] = raw
        self.header_bytes = req.header_size
        self.has_body = req.chunked or bool(cl)
        self.head_sent = False
        self.sse = False
        self.task = conn.task  # the connection's, serving this request (`H1Conn.start`)
        self.close_after = draining
        self.framed = False
        self.draining = draining

    # --- request body ---

    def whole_body(self, limit: int) -> bytes | None:
        req = self.req
        if not req.body_done or req.body_error or req.buffered > limit or self.conn.closed:
            return None
        return self._take()

    async def read_body(self, limit: int) -> bytes | None:
        conn, req = self.conn, self.req
        self.send_continue()
        req.high_water = limit  # let the connection buffer the whole body (bounded by limit)
        try:
            while not req.body_done:
                if req.body_error or conn.closed:
                    raise EOFError("incomplete body")
                if req.buffered > limit:
                    return None
                if conn.read_paused:
                    conn.flow()
                await conn.wait()
        finally:
            req.high_water = HIGH_WATER
        if req.buffered > limit:
            return None
        return self._take()

    def _take(self) -> bytes:
        """The buffered body, taken from the request (it is complete)."""
        req = self.req
        data = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        req.body.clear()
        req.buffered = 0
        return data

    def body_stream(self, limit: int) -> AsyncIterator[bytes]:
        return BodyChunks(self, limit)

    def send_continue(self) -> None:
        conn, req = self.conn, self.req
        if req.continued or req.body_done or conn.transport is None:
            return
        req.continued = True
        if "expect" in self.info.headers:  # checked to be 100-continue before the chain
            conn.flush_out()
            conn.transport.write(CONTINUE)

    # --- response ---

    def _finish(self, close: bool = False) -> bytes:
        """The head's last lines (Connection, then the blank line); the request is answered."""
        conn, req = self.conn, self.req
        close = close or not req.keep_alive or self.draining or not req.body_done or conn.stopping
        req.close = close
        req.responded = True
        self.head_sent = True
        if close:
            return b"connection: close\r\n\r\n"
        return b"connection: keep-alive\r\n\r\n" if req.http10 else b"\r\n"

    async def send_head(self, status: int, lines: bytes, length: int | None, date: bool) -> None:
        req = self.req
        if length is not None:
            framing = b"content-length: %d\r\n" % length
        elif not req.http10:
            framing = b"transfer-encoding: chunked\r\n"
            self.framed = True
        else:
            framing = b""
            req.keep_alive = False  # HTTP/1.0: the end of the body is the close
        end = self._finish()
        conn = self.conn
        transport = conn.transport
        if transport is not None and not conn.closed:
            conn.flush_out()
            transport.write(b"".join((_status_line(status), lines, _date(date), framing, end)))

    async def write(self, chunk: bytes) -> None:
        conn = self.conn
        transport = conn.transport
        if transport is None or conn.closed:
            raise ConnectionResetError("client disconnected")
        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.framed else chunk)
        if conn.write_paused:
            await conn.drain()

    async def end(self) -> None:
        conn = self.conn
        if self.framed and conn.transport is not None and not conn.closed:
            conn.transport.write(_LAST_CHUNK)

    def respond(
        self, status: int, lines: bytes, body: bytes, date: bool, length: int | None = None
    ) -> None:  # written (or deferred to the loop turn's batch) here: nothing to await
        if length is not None:
            framing = b"content-length: %d\r\n" % length
        elif status >= 200 and status != 204:
            framing = b"content-length: %d\r\n" % len(body)
        else:
            framing = b""
        end = self._finish(self.close_after)
        conn = self.conn
        if conn.transport is not None and not conn.closed:
            # One join, one copy: the head is not grown in a buffer and copied out again.
            data = b"".join((_status_line(status), lines, _date(date), framing, end, body))
            if self.req.close or len(data) >= DEFER_MAX or conn.write_paused:
                conn.flush_out()
                conn.transport.write(data)
            else:  # the connection stays open: written with this loop turn's other answers
                conn.defer(data)

    def abort(self) -> None:
        self.req.responded = False  # the connection is cut when the request task ends
        if self.conn.transport is not None:
            self.conn.transport.abort()


def _status_line(status: int) -> bytes:
    """The status line from the code (never an upstream reason phrase)."""
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def _date(date: bool) -> bytes:
    """A Date line, unless the answer's lines carry one (`date`)."""
    return b"" if date else b"date: %b\r\n" % date_value()


class H1Handler:
    """Runs a connection's task: its requests in turn, each as an exchange handed to the
    forwarding path."""

    def __init__(self, forward: HttpForward) -> None:
        self.forward = forward

    async def serve(self, conn: H1Conn) -> None:
        """The connection's requests, one after another, until it closes or its client leaves.
        One task per connection, not per request: a request on a kept-alive connection costs
        a Future here, not a Task (whose creation registers it in asyncio's weak set of all
        tasks, two Python-level calls)."""
        req = conn.active
        while req is not None:
            req.started = True
            ex = H1Exchange(conn, req, self.forward.gateway.draining)
            left = False
            try:
                await self.forward.serve(ex)
            except (asyncio.CancelledError, ConnectionError):
                left = True  # the client left: the request is recorded as cancelled
            except Exception:  # a bug of ours: log it, cut this connection, keep serving others
                log.exception("native HTTP request failed")
                req.responded = False
            conn.request_done(req)
            if left:
                return
            req = conn.active  # a pipelined request that waited (`request_done` started it)
            if req is None:
                req = await conn.next_request()


class BodyChunks:
    """`H1Exchange.body_stream`: the body as it arrives, at most `limit` bytes (BodyTooLarge
    past it). An iterator class, not an async generator: mypyc compiles no async generators."""

    __slots__ = ("ex", "limit", "total", "started")

    def __init__(self, ex: H1Exchange, limit: int) -> None:
        self.ex, self.limit = ex, limit
        self.total = 0
        self.started = False

    def __aiter__(self) -> BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        ex = self.ex
        conn, req = ex.conn, ex.req
        if not self.started:  # 100 Continue once the body is asked for
            self.started = True
            ex.send_continue()
        body = req.body
        while True:
            if body:
                chunk = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                req.buffered = 0
                if conn.read_paused:
                    conn.flow()
                self.total += len(chunk)
                if self.total > self.limit:
                    raise BodyTooLarge()
                return chunk
            if req.body_done:
                raise StopAsyncIteration
            if req.body_error or conn.closed:
                raise EOFError("incomplete body")
            await conn.wait()
