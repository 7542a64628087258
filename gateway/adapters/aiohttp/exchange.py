"""The aiohttp engine's `Exchange`: one `web.BaseRequest` and the response written for it.

Moves bytes only. The response head is written from Sluice's own header lines, byte for byte
(`SluiceResponse._write_headers`): aiohttp contributes only the framing and Connection fields
(and Date when the lines carry none), so both engines send the same head for the same answer
and no upstream header byte is re-encoded. A small whole answer on a kept HTTP/1.1 connection
(the common proxied JSON answer) is written by `respond` itself, as that head, in one transport
write, and aiohttp is handed `SENT`, a response whose EOF is already sent: no StreamResponse is
prepared and ended for it (`tests/adapters/test_differential.py` compares both engines' answers
field by field).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.streams import EmptyStreamReader, StreamReader

from gateway.adapters.common import DEFER_MAX, REASONS, date_value
from gateway.core.request import RequestInfo, Wire
from gateway.forward.exchange import BodyTooLarge

log = logging.getLogger(__name__)

_OWN = ((hdrs.CONTENT_LENGTH, b"content-length"), (hdrs.TRANSFER_ENCODING, b"transfer-encoding"))


class SluiceResponse(web.StreamResponse):
    """A StreamResponse whose head is Sluice's header lines plus aiohttp's framing; it leaves
    with the first body bytes (one write, not two)."""

    _send_headers_immediately = False

    def __init__(self, status: int, lines: bytes, date: bool) -> None:
        super().__init__(status=status)
        self.sluice_lines = lines
        self.sluice_date = date

    async def _write_headers(self) -> None:
        writer: Any = self._payload_writer
        h = self._headers
        out = bytearray(b"HTTP/1.1 %d %b\r\n" % (self.status, REASONS.get(self.status, b"")))
        out += self.sluice_lines
        for key, name in _OWN:
            v = h.get(key)
            if v is not None:
                out += b"%b: %b\r\n" % (name, v.encode("ascii"))
        conn = h.get(hdrs.CONNECTION)
        if conn is not None:
            out += b"connection: %b\r\n" % conn.encode("ascii")
        if not self.sluice_date:
            out += b"date: %b\r\n" % h[hdrs.DATE].encode("ascii")
        out += b"\r\n"
        # What StreamWriter.write_headers does with its serialised head (aiohttp 3.x).
        writer._headers_buf = bytes(out)
        writer._headers_written = False


class _Sent(web.StreamResponse):
    """What aiohttp's server is handed back for an answer the exchange wrote itself
    (`AiohttpExchange.respond`): its EOF is sent (`prepare` and `write_eof` return at once) and
    the connection is kept. One instance serves all, never changed: aiohttp reads only
    `keep_alive` off it."""

    def __init__(self) -> None:
        super().__init__()
        self._eof_sent = True
        self._keep_alive = True


SENT = _Sent()
_BODILESS = (204, 304)


class AiohttpExchange:
    """One request, read from aiohttp's parsed message once: the request's own properties are
    computed and cached per request, each a Python call (six of them were ~3 % of this
    engine's instructions a request); its public `message` warns (deprecated) on every read."""

    __slots__ = (
        "request", "info", "raw_headers", "header_bytes", "query", "has_body", "head_sent",
        "sse", "resp", "draining", "_prefix", "close_after", "task", "_content", "_protocol",
        "_kept",
    )  # fmt: skip

    def __init__(
        self,
        request: web.BaseRequest,
        protocol: Any,
        peer: str,
        draining: bool,
        client_cert: str = "",
    ) -> None:
        self.request = request
        msg = request._message  # (aiohttp 3.x: the RawRequestMessage the request wraps)
        raw = msg.raw_headers
        multi = msg.headers
        headers = {k.lower(): v for k, v in multi.items()}
        if len(headers) != len(raw):  # repeated names: join them, as RFC 9110 §5.3 allows
            headers = {}
            for k, v in multi.items():
                k = k.lower()
                headers[k] = v if k not in headers else headers[k] + ", " + v
        path, _, self.query = msg.path.partition("?")
        length = multi.get(hdrs.CONTENT_LENGTH)  # (the parser checked its digits)
        self.info = RequestInfo(
            Wire.HTTP,
            msg.method,
            path,
            headers,
            peer,
            headers.get("host", ""),
            None if length is None else int(length),
            client_cert,
        )
        self.raw_headers: Sequence[tuple[bytes, bytes]] = raw
        self.header_bytes = sum([len(n) + len(v) for n, v in raw]) + 4 * len(raw)
        content = self._content = request.content
        self.has_body = type(content) is not EmptyStreamReader
        self._protocol = protocol
        # Kept after the answer: HTTP/1.1 and no `Connection: close` (what aiohttp's
        # `keep_alive` says of the request).
        self._kept = not msg.should_close and msg.version == HttpVersion11
        self.head_sent = False
        self.sse = False
        self.task: asyncio.Task[None] | None = None
        self.close_after = draining
        self.resp: web.StreamResponse | None = None
        self.draining = draining
        self._prefix = b""

    def whole_body(self, limit: int) -> bytes | None:
        return None  # `read_body` always

    async def read_body(self, limit: int) -> bytes | None:
        content = self._content
        cl = self.info.content_length
        if cl is not None and cl > limit:
            return None
        data = content.read_nowait(-1)
        try:
            while True:
                if len(data) > limit:
                    self._prefix = data
                    return None
                if content.is_eof():
                    break
                more = await content.readany()
                if not more:
                    if not content.is_eof():
                        raise EOFError("incomplete body")
                    break
                data += more
        except BadHttpMessage as e:  # a chunked body that turned out malformed
            raise EOFError("incomplete body") from e
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise EOFError("incomplete body") from e
        _check_framing(content)
        return data

    async def body_stream(self, limit: int) -> AsyncIterator[bytes]:
        total = 0
        if self._prefix:
            chunk, self._prefix = self._prefix, b""
            total = len(chunk)
            if total > limit:
                raise BodyTooLarge()
            yield chunk
        content = self._content
        try:
            async for chunk in content.iter_any():
                total += len(chunk)
                if total > limit:
                    raise BodyTooLarge()
                yield chunk
        except BadHttpMessage as e:
            raise EOFError("incomplete body") from e
        _check_framing(content)

    async def send_head(self, status: int, lines: bytes, length: int | None, date: bool) -> None:
        resp = self.resp = SluiceResponse(status, lines, date)
        if length is not None:
            resp.content_length = length
        if self.draining:
            resp.force_close()
        self.head_sent = True
        await resp.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        assert self.resp is not None
        await self.resp.write(chunk)

    async def end(self) -> None:
        assert self.resp is not None
        await self.resp.write_eof()

    async def respond(
        self, status: int, lines: bytes, body: bytes, date: bool, length: int | None = None
    ) -> None:
        transport = self._protocol.transport
        if (
            length is None  # (given for a bodiless answer: HEAD, 204, 304)
            and status >= 200
            and status not in _BODILESS
            and len(body) < DEFER_MAX
            and not self.close_after
            and self._kept
            and self.info.method != "HEAD"
            and self._content.is_eof()
            and transport is not None
            and not transport.is_closing()
            and not transport.get_write_buffer_size()  # else aiohttp's path waits for it
        ):
            # What aiohttp's response would write for it, written at once: the head as
            # `SluiceResponse` builds it (no Connection field on a kept HTTP/1.1 connection).
            head = b"HTTP/1.1 %d %b\r\n%bcontent-length: %d\r\n" % (
                status, REASONS.get(status, b""), lines, len(body),
            )  # fmt: skip
            if not date:
                head += b"date: %b\r\n" % date_value()
            transport.write(head + b"\r\n" + body)
            self.resp = SENT
            self.head_sent = True
            return
        resp = self.resp = SluiceResponse(status, lines, date)
        if length is not None:
            resp.content_length = length
        elif status >= 200 and status != 204:
            resp.content_length = len(body)
        if self.close_after or not self._content.is_eof():
            resp.force_close()  # an answer before the whole body arrived: not waited for
        self.head_sent = True
        await resp.prepare(self.request)
        await resp.write_eof(body)

    def abort(self) -> None:
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()


def _check_framing(content: StreamReader) -> None:
    """At the end of a body: a chunked body whose framing broke after its last bytes were read
    ends with an exception on the reader (`gateway.adapters.aiohttp.server`), not a clean end: never
    forward what came as the whole body."""
    if content.exception() is not None:
        raise EOFError("incomplete body")
