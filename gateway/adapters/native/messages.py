"""(compiled) Raw HTTP/1.1 pieces of the native engine: the parsed request (`Req`), complete JSON
error responses, and the header and target rules its parser applies."""

from __future__ import annotations

import asyncio
import typing
from collections import deque
from typing import Final

from gateway.adapters.common import REASONS, date_value
from gateway.forward.headers import error_body

HIGH_WATER: Final = 256 * 1024  # unread request body / queued pipeline bytes before pause_reading
LOW_WATER = 64 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class OutBatch:
    """Complete small answers of this loop turn, written at the start of the next one, one
    write per connection back to back (one per listener): the peers' wake-ups of one turn come
    together. A connection keeps its deferred bytes (`H1Conn.out`) and writes them itself
    before anything else it writes or closes, so order is kept."""

    __slots__ = ("loop", "conns")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.conns: list[Flushable] = []

    def add(self, conn: Flushable) -> None:
        conns = self.conns
        conns.append(conn)
        if len(conns) == 1:
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        conns, self.conns = self.conns, []
        for conn in conns:
            conn.flush_out()


class Flushable(typing.Protocol):
    def flush_out(self) -> None:
        """Write what was deferred (nothing if it went already, or the connection closed)."""


# Header names that may appear once (the set aiohttp's parser enforces): a second one is a 400.
SINGLETONS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)


def absolute(target: bytes) -> bool:
    """An absolute-form target with a non-empty authority (RFC 9112 §3.2.2, RFC 9110 §4.2)."""
    scheme, colon, rest = target.partition(b":")
    return (
        bool(colon)
        and scheme.isalpha()
        and rest[:2] == b"//"
        and rest[2:3] not in (b"", b"/", b"?", b"#")
    )


class Req:
    """One parsed request head, its body as it arrives, and how its answer went out."""

    __slots__ = (
        "method",
        "target",
        "headers",
        "header_size",
        "keep_alive",
        "http10",
        "chunked",
        "body",
        "buffered",
        "body_done",
        "body_error",
        "continued",
        "responded",
        "close",
        "started",
        "high_water",
    )

    def __init__(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        header_size: int,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.header_size = header_size
        self.keep_alive = keep_alive
        self.http10 = False
        self.chunked = False
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.body_done = False
        self.body_error = False
        self.continued = False
        self.responded = False
        self.close = False
        self.started = False
        self.high_water = HIGH_WATER  # raised while the whole body is being buffered


def simple_response(
    status: int, kind: str, text: str, extra: bytes = b"", close: bool = True, head: bool = False
) -> bytes:
    """A complete JSON error response (the shape of `headers.error_body`); `head`: the answer to
    a HEAD request, Content-Length of the body without the body (RFC 9110 §9.3.2)."""
    body = error_body(kind, text)
    return (
        b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"%bdate: %b\r\n%b\r\n%b"
    ) % (
        status,
        REASONS.get(status, b""),
        len(body),
        extra,
        date_value(),
        b"connection: close\r\n" if close else b"",
        b"" if head else body,
    )
