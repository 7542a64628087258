"""(compiled) `Exchange`: what an HTTP engine offers the forwarding path for one request, nothing
more.

Both engines (native asyncio.Protocol + httptools, aiohttp's low-level server) implement it;
everything that is not moving bytes (admission, deadlines, the failure table, events) lives in
`gateway.forward.http`. Header lines handed to `send_head` / `respond` are complete
`name: value\r\n` lines, already validated; the engine adds only framing (Content-Length or
chunked), Connection and Date.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol

from gateway.core.request import RequestInfo


class BodyTooLarge(Exception):
    """The client body grew past the limit while it was streamed (→ 413)."""


class Exchange(Protocol):
    info: RequestInfo
    raw_headers: Sequence[tuple[bytes, bytes]]  # as received, for the upstream request
    header_bytes: int  # total size of the request head's header fields
    query: str  # the raw query string (without "?"), "" if none
    has_body: bool  # Content-Length > 0 or chunked
    head_sent: bool  # a response head went out: only `write`/`end`/`abort` may follow
    sse: bool  # the response is an SSE stream of unknown length (it can end with an event)
    close_after: bool  # set by the forwarding path: close the connection after this answer
    # The task serving the request when the engine knows it (None: the forwarding path asks
    # asyncio, a Python-level call on 3.11).
    task: asyncio.Task[None] | None

    def whole_body(self, limit: int) -> bytes | None:
        """The whole body, taken at once, if it is all here and at most `limit` bytes; else None
        and nothing is taken (`read_body` then). Saves `read_body`'s coroutine."""
        ...

    async def read_body(self, limit: int) -> bytes | None:
        """The whole body if it is at most `limit` bytes; None if it is larger (what was read
        stays buffered and `body_stream` yields it first). Raises EOFError on a cut body."""
        ...

    def body_stream(self, limit: int) -> AsyncIterator[bytes]:
        """The (rest of the) body as it arrives; raises BodyTooLarge past `limit` bytes in all
        and EOFError on a cut body."""
        ...

    async def send_head(self, status: int, lines: bytes, length: int | None, date: bool) -> None:
        """Start the response: `lines` are the header lines; `length` None = unknown (chunked,
        or close-delimited for HTTP/1.0); `date`: the lines carry a Date already."""
        ...

    async def write(self, chunk: bytes) -> None:
        """Send body bytes; returns once the client's buffer has room (may wait: the caller
        bounds that wait)."""
        ...

    async def end(self) -> None:
        """The body is complete (the last chunk marker for chunked responses)."""
        ...

    def respond(
        self, status: int, lines: bytes, body: bytes, date: bool, length: int | None = None
    ) -> Awaitable[None] | None:
        """A whole response (head and body) at once. Content-Length is `len(body)`, or `length`
        when given (a bodiless answer to HEAD or a 304 announces the upstream's); none for
        1xx/204. The connection closes afterwards when `close_after` is set. None: done (an
        engine that never waits to write it); else the caller awaits what it returns."""
        ...

    def abort(self) -> None:
        """Cut the connection (an answer that cannot be finished cleanly)."""
        ...
