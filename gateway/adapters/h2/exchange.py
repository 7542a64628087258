"""(compiled) The HTTP/2 engine's `Exchange`: one stream (`H2Stream`) of an `H2Conn` serving an
HTTP route.

Moves bytes only: the request head from h2's decoded header list, the body as the stream
receives it (window returned as it is taken), the response as HEADERS and DATA within the send
windows. Every decision is in `gateway.forward.http`, as for HTTP/1.1. An answer that cannot be
finished ends its stream with RST_STREAM (never a clean END_STREAM after a cut body); the
connection and its other streams live on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Final

from h2.errors import ErrorCodes
from hpack import NeverIndexedHeaderTuple

from gateway.adapters.common import date_value
from gateway.adapters.h2.codec import UNIQUE
from gateway.adapters.h2.stream import H2Stream, StreamConn
from gateway.core.request import RequestInfo, Wire
from gateway.forward.exchange import BodyTooLarge
from gateway.forward.headers import error_body, header_value
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.forward.http import HttpForward

log: Final = logging.getLogger(__name__)

_STATUS: Final = {s: b"%d" % s for s in range(100, 600)}
_JSON_LINES: Final = b"content-type: application/json\r\n"


class H2Exchange:
    __slots__ = (
        "stream", "conn", "info", "raw_headers", "header_bytes", "query", "has_body",
        "head_sent", "sse", "close_after", "parts", "taken", "valid", "task",
    )  # fmt: skip

    def __init__(self, stream: H2Stream, peer: str, client_cert: str = "") -> None:
        self.stream = stream
        self.conn: StreamConn = stream.conn
        method = path = authority = b""
        raw: list[tuple[bytes, bytes]] = []
        cookies: list[bytes] = []
        size = 0
        for n, v in stream.headers:
            if n[:1] == b":":
                if n == b":method":
                    method = v
                elif n == b":path":
                    path = v
                elif n == b":authority":
                    authority = v
                continue
            size += len(n) + len(v) + 4
            if n == b"cookie":  # split crumbs are one field again (RFC 9113 §8.2.3)
                cookies.append(v)
            else:
                raw.append((n, v))
        if cookies:
            raw.append((b"cookie", b"; ".join(cookies)))
        headers: dict[str, str] = {}
        for n, v in raw:  # names are lower-case (h2 checked); repeated names are joined
            k = n.decode("latin-1")
            s = header_value(v)
            headers[k] = s if k not in headers else headers[k] + ", " + s
        if authority and "host" not in headers:
            headers["host"] = authority.decode("latin-1")
        target = header_value(path)
        p, _, self.query = target.partition("?")
        cl_raw = headers.get("content-length")
        cl = int(cl_raw) if cl_raw is not None and cl_raw.isdigit() else None
        m = method.decode("latin-1")
        self.info = RequestInfo(
            Wire.HTTP, m, p, headers, peer, headers.get("host", ""), cl, client_cert
        )
        self.raw_headers: Sequence[tuple[bytes, bytes]] = raw
        self.header_bytes = size
        self.has_body = stream.has_body
        self.head_sent = False
        self.sse = False
        self.task: asyncio.Task[None] | None = stream.task  # (created before it runs)
        self.close_after = False  # a connection-wide matter in HTTP/2: the drain's GOAWAY
        self.parts: list[bytes] = []  # body taken by read_body beyond its limit
        self.taken = 0
        # As the native HTTP/1.1 engine refuses them (CONNECT, a target not in origin form).
        self.valid = m != "CONNECT" and (p[:1] == "/" or (p == "*" and m == "OPTIONS"))

    # --- request body ---

    def whole_body(self, limit: int) -> bytes | None:
        return None  # `read_body` always

    async def read_body(self, limit: int) -> bytes | None:
        stream, parts = self.stream, self.parts
        while True:
            if stream.body:
                chunk = stream.take()
                parts.append(chunk)
                self.taken += len(chunk)
            if self.taken > limit:
                return None  # kept: body_stream yields it first
            if stream.body_done:
                break
            if stream.reset:
                raise EOFError("incomplete body")
            await stream.wait()
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data

    def body_stream(self, limit: int) -> AsyncIterator[bytes]:
        return H2BodyChunks(self, limit)

    # --- response ---

    async def send_head(self, status: int, lines: bytes, length: int | None, date: bool) -> None:
        headers = _headers(status, lines, date)
        if length is not None:
            headers.append(_length(length))
        self.head_sent = True
        self.conn.send_headers(self.stream, headers, False)

    async def write(self, chunk: bytes) -> None:
        if chunk:
            await self.conn.send_data(self.stream, chunk, False)

    async def end(self) -> None:
        await self.conn.send_data(self.stream, b"", True)

    async def respond(
        self, status: int, lines: bytes, body: bytes, date: bool, length: int | None = None
    ) -> None:
        headers = _headers(status, lines, date)
        if length is not None:
            headers.append(_length(length))
        elif status >= 200 and status != 204:
            headers.append(_length(len(body)))
        self.head_sent = True
        if body:
            self.conn.send_headers(self.stream, headers, False)
            await self.conn.send_data(self.stream, body, True)
        else:
            self.conn.send_headers(self.stream, headers, True)

    def abort(self) -> None:
        self.conn.reset(self.stream, ErrorCodes.INTERNAL_ERROR)


class H2BodyChunks:
    """`H2Exchange.body_stream`: what `read_body` kept beyond its limit, then the body as it
    arrives, at most `limit` bytes in all (BodyTooLarge past it). An iterator class, not an
    async generator: mypyc compiles no async generators."""

    __slots__ = ("ex", "limit", "total")

    def __init__(self, ex: H2Exchange, limit: int) -> None:
        self.ex, self.limit = ex, limit
        self.total = 0

    def __aiter__(self) -> H2BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        ex = self.ex
        stream = ex.stream
        if ex.parts:
            chunk = b"".join(ex.parts)
            ex.parts.clear()
            return self._counted(chunk)
        while True:
            if stream.body:
                return self._counted(stream.take())
            if stream.body_done:
                raise StopAsyncIteration
            if stream.reset:
                raise EOFError("incomplete body")
            await stream.wait()

    def _counted(self, chunk: bytes) -> bytes:
        self.total += len(chunk)
        if self.total > self.limit:
            raise BodyTooLarge()
        return chunk


def _length(n: int) -> NeverIndexedHeaderTuple:
    """`content-length`, new in (nearly) every answer (`codec.UNIQUE`): a literal never
    indexed. (Typed as its class: compiled, a `tuple[bytes, bytes]` would come back a plain
    tuple.)"""
    return NeverIndexedHeaderTuple(b"content-length", b"%d" % n)


def _headers(status: int, lines: bytes, date: bool) -> list[tuple[bytes, bytes]]:
    """The HTTP/1.1-shaped header lines of the lifecycle as an HTTP/2 header list (names
    lower-case, as HTTP/2 requires). A value that is new in every answer (`codec.UNIQUE`) is
    sent as a literal never indexed."""
    out = [(b":status", _STATUS.get(status) or b"%d" % status)]
    for line in lines.split(b"\r\n"):
        if line:
            n, _, v = line.partition(b":")
            n = n.strip().lower()
            if n in UNIQUE:  # new in each answer: kept out of the HPACK table
                out.append(NeverIndexedHeaderTuple(n, v.strip()))
            else:
                out.append((n, v.strip()))
    if not date:
        out.append((b"date", date_value()))
    return out


class H2HttpHandler:
    """Serves the streams of an HTTP listener: one task and one exchange per stream, through
    the forwarding path of HTTP/1.1 (`gateway.adapters.h2.server.StreamHandler`)."""

    def __init__(self, forward: HttpForward) -> None:
        self.forward = forward

    def start(self, conn: StreamConn, stream: H2Stream) -> asyncio.Task[None]:
        return self.forward.loop.create_task(self._run(conn, stream))

    async def _run(self, conn: StreamConn, stream: H2Stream) -> None:
        stream.started = True
        try:
            ex = H2Exchange(stream, conn.peer, conn.client_cert)
            if stream.reset:  # reset before its task ran: recorded, never forwarded
                await self.forward.cancelled(ex)
            elif not ex.valid:
                metrics.REJECTED.labels("bad_request", "http").inc()
                body = error_body("bad_request", "malformed HTTP request")
                await ex.respond(400, _JSON_LINES, body, False)  # (a coroutine here)
            else:
                await self.forward.serve(ex)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the client left: the request is recorded as cancelled
        except Exception:  # a bug of ours: log it, reset this stream, keep serving others
            log.exception("HTTP/2 request failed")
        finally:
            conn.stream_done(stream)  # a stream not ended cleanly is reset
