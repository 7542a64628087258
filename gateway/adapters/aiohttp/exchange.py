"""(compiled) The aiohttp engine's `Exchange`: one `web.BaseRequest` and the response written for
it; `Handle`, aiohttp's request handler, which wraps each request in one; and `refusal`, what
the native engine's parser refuses in a message aiohttp's parser accepted.

Moves bytes only. The response head is written from Sluice's own header lines, byte for byte
(`gateway.adapters.aiohttp.response.SluiceResponse`): aiohttp contributes only the framing and
Connection fields (and Date when the lines carry none), so both engines send the same head for
the same answer and no upstream header byte is re-encoded. A small whole answer on a kept
HTTP/1.1 connection (the common proxied JSON answer) is written by `respond` itself, as that
head, in one transport write, and aiohttp is handed `SENT`, a response whose EOF is already
sent: no StreamResponse is prepared and ended for it (`tests/adapters/test_differential.py`
compares both engines' answers field by field).

aiohttp's objects are typed `Any` here: compiled code checks the runtime type of what it is
declared to hold, and aiohttp's runtime types (its C parser's message, `istr` names) are not
the ones its stubs name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EmptyStreamReader

from gateway.adapters.aiohttp.response import SENT, SluiceResponse
from gateway.adapters.common import DEFER_MAX, REASONS, date_value
from gateway.core.request import RequestInfo, Wire
from gateway.forward.exchange import BodyTooLarge
from gateway.forward.headers import error_body

if TYPE_CHECKING:
    from gateway.forward.http import HttpForward

_BODILESS: Final = (204, 304)
_CONTENT_LENGTH: Final = hdrs.CONTENT_LENGTH
_TRANSFER_ENCODING: Final = "Transfer-Encoding"
_HTTP11: Final[Any] = HttpVersion11
_HTTP10: Final[Any] = HttpVersion10
_EMPTY: Final[Any] = EmptyStreamReader


class Handle:
    """aiohttp's request handler: wraps the request in an exchange for the forwarding path."""

    def __init__(self, forward: HttpForward) -> None:
        self.forward = forward

    async def __call__(self, request: Any) -> Any:
        proto: Any = request.protocol
        ex = AiohttpExchange(
            request, proto, proto.sluice_peer, self.forward.gateway.draining, proto.sluice_cert
        )
        await self.forward.serve(ex)
        resp = ex.resp
        if resp is None:  # every path answers; this is a bug guard, not a code path
            return web.Response(status=500, body=error_body("internal", "gateway error"))
        return resp


def refusal(msg: Any, max_line: int) -> BadHttpMessage | None:
    """What the native engine's parser refuses in a message aiohttp's parser accepted:
    - CONNECT (nothing is tunnelled);
    - a Transfer-Encoding other than one `chunked` in HTTP/1.1 (RFC 9112 §6.1: a transfer
      coding we do not apply would reach the upstream undone; HTTP/1.0 has none);
    - an upgrade request with a body (nothing is upgraded: the request is served as a plain one,
      and the native engine's llhttp would not read its body);
    - a header line (name, ": ", value) over `max_line_bytes` (aiohttp checks the value alone
      for every header but the first; its own limit is set above ours)."""
    headers: Any = msg.headers
    if msg.method == "CONNECT":
        return BadHttpMessage("CONNECT is not supported")
    if _TRANSFER_ENCODING in headers:
        te: Any = headers.getall(_TRANSFER_ENCODING)
        if len(te) != 1 or te[0].lower() != "chunked" or msg.version == _HTTP10:
            return BadHttpMessage("unsupported Transfer-Encoding")
    if msg.upgrade and (msg.chunked or headers.get(_CONTENT_LENGTH, "0").lstrip("0")):
        return BadHttpMessage("upgrade request with a body")
    for n, v in msg.raw_headers:
        if len(n) + len(v) + 2 > max_line:
            return LineTooLong(n[:100], max_line)
    return None


class AiohttpExchange:
    """One request, read from aiohttp's parsed message once: the request's own properties are
    computed and cached per request, each a Python call (six of them were ~3 % of this
    engine's instructions a request); its public `message` warns (deprecated) on every read."""

    def __init__(
        self,
        request: Any,
        protocol: Any,
        peer: str,
        draining: bool,
        client_cert: str = "",
    ) -> None:
        self.request: Any = request
        msg: Any = request._message  # (aiohttp 3.x: the RawRequestMessage the request wraps)
        raw: Any = msg.raw_headers
        multi: Any = msg.headers
        headers: dict[str, str] = {k.lower(): v for k, v in multi.items()}
        if len(headers) != len(raw):  # repeated names: join them, as RFC 9110 §5.3 allows
            headers = {}
            for k, v in multi.items():
                k = k.lower()
                headers[k] = v if k not in headers else headers[k] + ", " + v
        path, _, query = msg.path.partition("?")
        self.query: str = query
        length: str | None = multi.get(_CONTENT_LENGTH)  # (the parser checked its digits)
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
        total = 0
        for n, v in raw:
            total += len(n) + len(v)
        self.header_bytes = total + 4 * len(raw)
        content: Any = request.content
        self._content: Any = content
        self.has_body = type(content) is not _EMPTY
        self._protocol: Any = protocol
        # Kept after the answer: HTTP/1.1 and no `Connection: close` (what aiohttp's
        # `keep_alive` says of the request).
        self._kept: bool = not msg.should_close and msg.version == _HTTP11
        self.head_sent = False
        self.sse = False
        self.task: asyncio.Task[None] | None = None
        self.close_after = draining
        self.resp: Any = None
        self.draining = draining
        self._prefix = b""

    def whole_body(self, limit: int) -> bytes | None:
        return None  # `read_body` always

    async def read_body(self, limit: int) -> bytes | None:
        content = self._content
        cl = self.info.content_length
        if cl is not None and cl > limit:
            return None
        data: bytes = content.read_nowait(-1)
        try:
            while True:
                if len(data) > limit:
                    self._prefix = data
                    return None
                if content.is_eof():
                    break
                more: bytes = await content.readany()
                if not more:
                    if not content.is_eof():
                        raise EOFError("incomplete body")
                    break
                data += more
        except BadHttpMessage as e:  # a chunked body that turned out malformed
            raise EOFError("incomplete body") from e
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise EOFError("incomplete body") from e
        check_framing(content)
        return data

    def body_stream(self, limit: int) -> BodyChunks:
        return BodyChunks(self, limit)

    async def send_head(self, status: int, lines: bytes, length: int | None, date: bool) -> None:
        resp: Any = SluiceResponse(status, lines, date)
        self.resp = resp
        if length is not None:
            resp.content_length = length
        if self.draining:
            resp.force_close()
        self.head_sent = True
        await resp.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        resp: Any = self.resp
        assert resp is not None
        await resp.write(chunk)

    async def end(self) -> None:
        resp: Any = self.resp
        assert resp is not None
        await resp.write_eof()

    async def respond(
        self, status: int, lines: bytes, body: bytes, date: bool, length: int | None = None
    ) -> None:
        transport: Any = self._protocol.transport
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
        resp: Any = SluiceResponse(status, lines, date)
        self.resp = resp
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
        transport: Any = self._protocol.transport
        if transport is not None:
            transport.abort()


class BodyChunks:
    """`AiohttpExchange.body_stream`: the (rest of the) body as it arrives, at most `limit`
    bytes (BodyTooLarge past it). An iterator class, not an async generator: mypyc compiles no
    async generators."""

    def __init__(self, ex: AiohttpExchange, limit: int) -> None:
        self.ex = ex
        self.limit = limit
        self.total = 0

    def __aiter__(self) -> BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        ex = self.ex
        if ex._prefix:  # what `read_body` read past its limit comes first
            chunk = ex._prefix
            ex._prefix = b""
        else:
            content = ex._content
            try:
                chunk = await content.readany()
            except BadHttpMessage as e:
                raise EOFError("incomplete body") from e
            if not chunk:
                check_framing(content)
                raise StopAsyncIteration
        self.total += len(chunk)
        if self.total > self.limit:
            raise BodyTooLarge()
        return chunk


def check_framing(content: Any) -> None:
    """At the end of a body: a chunked body whose framing broke after its last bytes were read
    ends with an exception on the reader (`gateway.adapters.aiohttp.server`), not a clean end: never
    forward what came as the whole body."""
    if content.exception() is not None:
        raise EOFError("incomplete body")
