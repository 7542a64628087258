"""(compiled) One HTTP/2 stream of Sluice's HTTP/2 engine, as its handler sees it: the request
head, the request body as it arrives, and the waits (more body, send window) the connection ends.

Engine-neutral within HTTP/2: the HTTP exchange (`gateway.adapters.h2.exchange`) and the gRPC
one (`gateway.adapters.h2.grpc`) use it. Window is returned to the client only when the
handler takes the bytes (`take`), so a stream whose consumer is slow holds at most its own
window.
"""

from __future__ import annotations

import asyncio
import typing
from collections import deque

import h2.errors


class StreamConn(typing.Protocol):
    """What a stream uses of its connection (`gateway.adapters.h2.conn.H2Conn`)."""

    @property
    def peer(self) -> str: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The connection's loop (asking asyncio costs a getpid() system call on 3.11)."""

    @property
    def client_cert(self) -> str:
        """The verified client certificate's identity ("" without mTLS)."""

    def consumed(self, stream: H2Stream, size: int) -> None:
        """The handler took `size` flow-controlled bytes of the request body."""

    def send_headers(self, stream: H2Stream, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        """Send a header block (response head or trailers); raises ConnectionResetError when
        the stream or the connection is gone."""

    async def send_data(self, stream: H2Stream, data: bytes, end: bool) -> None:
        """Send DATA within the send windows; waits while they are shut or the client's
        socket buffer is full. Raises ConnectionResetError when the stream is gone."""

    def reset(self, stream: H2Stream, code: h2.errors.ErrorCodes) -> None:
        """End the stream with RST_STREAM `code` (if it is still open)."""

    def stream_done(self, stream: H2Stream) -> None:
        """The handler's task ends (a stream it did not end cleanly is reset)."""


class H2Stream:
    """A stream's request side and its waits; the connection feeds it."""

    __slots__ = (
        "conn", "sid", "headers", "body", "buffered", "unacked", "body_done", "reset",
        "ended", "task", "opened_at", "waiter", "window_waiter", "started", "has_body",
    )  # fmt: skip

    def __init__(
        self,
        conn: StreamConn,
        sid: int,
        headers: list[tuple[bytes, bytes]],
        body_done: bool,
        opened_at: float,
    ) -> None:
        self.conn = conn
        self.sid = sid
        self.headers = headers  # as decoded by h2, pseudo-headers first
        self.body: deque[bytes] = deque()
        self.buffered = 0  # body bytes waiting for the handler
        self.unacked = 0  # flow-controlled bytes (padding included) waiting for the handler
        self.body_done = body_done
        self.has_body = not body_done  # the head did not end the stream
        self.reset = False  # the stream is gone (client RST_STREAM, or the connection)
        self.ended = False  # our side ended (END_STREAM sent, or reset)
        self.started = False  # the handler's task has begun to run
        self.task: asyncio.Task[None] | None = None
        self.opened_at = opened_at
        self.waiter: asyncio.Future[None] | None = None
        self.window_waiter: asyncio.Future[None] | None = None

    # --- fed by the connection ---

    def data(self, chunk: bytes, flow_controlled: int) -> None:
        if chunk:
            self.body.append(chunk)
            self.buffered += len(chunk)
        self.unacked += flow_controlled
        self.wake()

    def wake(self) -> None:
        fut, self.waiter = self.waiter, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def wake_window(self) -> None:
        fut, self.window_waiter = self.window_waiter, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def gone(self) -> None:
        """The stream can carry nothing more: wake every wait (they raise)."""
        self.reset = True
        self.ended = True
        self.wake()
        self.wake_window()

    # --- used by the handler ---

    def take(self) -> bytes:
        """What the body has buffered; returns its window to the client."""
        body = self.body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.unacked:
            n, self.unacked = self.unacked, 0
            self.conn.consumed(self, n)
        return chunk

    async def wait(self) -> None:
        """Until more body, its end, or the stream is gone."""
        if self.reset:
            raise ConnectionResetError("stream reset")
        fut = self.waiter = self.conn.loop.create_future()
        await fut

    async def wait_window(self) -> None:
        """Until the client opens this stream's (or the connection's) send window."""
        if self.reset:
            raise ConnectionResetError("stream reset")
        fut = self.window_waiter = self.conn.loop.create_future()
        await fut
        if self.reset:
            raise ConnectionResetError("stream reset")
