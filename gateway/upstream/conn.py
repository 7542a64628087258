"""(compiled) One upstream HTTP/1.1 connection: the asyncio.Protocol, its httptools callbacks, its
timer.

`UpstreamConn` owns the transport and the state of the response being read on it (head, body
chunks, backpressure, the first error); `gateway.upstream.pool` owns the set of connections.

Timeouts need no per-request `wait_for`: each connection owns at most one `call_at` timer whose
deadline moves lazily (first byte; idle = silence between chunks either way, so a stalled
streamed request body also ends in UpstreamTimeout("idle")). Past `HIGH_WATER` unread body bytes
the transport stops reading until the consumer drains below `LOW_WATER`.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from typing import Any, Final, Protocol, cast

import httptools

from gateway.errors import UpstreamProtocolError, UpstreamTimeout

HIGH_WATER: Final = 256 * 1024  # unread response bytes before pause_reading()
LOW_WATER = 64 * 1024  # resume_reading() once the consumer is back under this

# Connection phases, used as the timer's meaning and as UpstreamTimeout.phase.
SEND, FIRST_BYTE, IDLE = "send", "first_byte", "idle"


class Stale(Exception):
    """A reused connection died before any response byte: the caller may retry."""


class ConnOwner(Protocol):
    """Who keeps a connection's books (`gateway.upstream.pool.UpstreamHost`): it takes the
    connection back after a response and forgets it once the transport is lost."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def put(self, conn: UpstreamConn) -> None: ...

    def forget(self, conn: UpstreamConn) -> None: ...


class UpstreamConn(asyncio.Protocol):
    """One upstream TCP connection and the state of the response being read on it."""

    __slots__ = (
        "host", "loop", "transport", "fd", "parser", "closed", "busy", "reused", "idle_since",
        "head_done", "status", "reason", "headers", "head_bytes", "feeding", "max_head",
        "keep_alive", "complete", "informational", "got_byte", "chunks", "buffered", "paused",
        "write_paused", "waiter", "exc", "timer", "phase", "deadline", "idle_s", "task",
        "sent_all", "head_only", "gone", "timer_cancelled",
    )  # fmt: skip

    def __init__(self, host: ConnOwner) -> None:
        self.host = host
        self.loop = host.loop
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.closed = False
        self.busy = True
        self.reused = False
        self.idle_since = 0.0
        self.write_paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[Any] | None = None
        self.gone = False
        self.phase = SEND
        self.deadline = 0.0
        # llhttp starts over after each complete message: one parser per connection suffices.
        # It holds this connection's bound methods (its callbacks): a reference cycle, broken in
        # `connection_lost` so that a closed connection is freed at once, not by the collector.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.chunks: deque[bytes] = deque()
        self.reset(65536)

    def reset(self, max_head: int) -> None:
        """Fresh response state for the next request (only clean connections are reused)."""
        self.head_done = False
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0  # of the chunks before the one being parsed, while in the head
        self.feeding = 0  # bytes of the chunk being parsed (while in the head)
        self.max_head = max_head
        self.keep_alive = False
        self.complete = False
        self.informational = False
        self.got_byte = False
        self.buffered = 0
        self.paused = False
        self.exc: Exception | None = None
        self.idle_s = 60.0
        self.sent_all = False
        self.head_only = False
        self.timer_cancelled = False

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.attach(transport)

    def attach(self, transport: asyncio.BaseTransport) -> None:
        """Take the transport (once). uvloop may call connection_made after
        create_connection() returned: the pool attaches too, so both orders work."""
        if self.transport is None:
            self.transport = cast(asyncio.Transport, transport)
            sock = transport.get_extra_info("socket")
            self.fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:  # bytes after the response: framing lost, never reuse
            self.keep_alive = False
            self.abort()
            return
        self.got_byte = True
        head_done = self.head_done
        if not head_done:
            self.feeding = len(data)
        parser = self.parser
        if parser is None:  # closed
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"bad upstream response: {e}"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("upstream switched protocols: not supported"))
            return
        if self.exc is not None:  # a parser callback failed (header size)
            self._fail(self.exc)
            return
        if not head_done:
            if not self.head_done:  # head still incomplete: bound what it may grow to
                self.head_bytes += len(data)
                if self.head_bytes > self.max_head:
                    self._fail(UpstreamProtocolError("upstream response head too large"))
                    return
        elif self.phase is IDLE:
            self.deadline = self.loop.time() + self.idle_s
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too: HTTP/1.1 has no use for a half-closed connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.busy:
            if self.head_done and not self.complete and self.exc is None:
                if self._close_delimited():
                    self.complete = True
                    self.keep_alive = False
                else:
                    self.exc = UpstreamProtocolError("upstream closed mid-response")
            elif not self.head_done and self.exc is None:
                self.exc = (
                    Stale()
                    if self.reused and not self.got_byte
                    else UpstreamProtocolError("upstream closed before the response head")
                )
            self._wake()
        self.host.forget(self)
        self.parser = None  # the cycle (see __init__)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: framing lost, never reuse
            self.keep_alive = False

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        parser = self.parser
        assert parser is not None  # (called by the parser)
        status = parser.get_status_code()
        if status < 200 and status != 101:  # 1xx interim (e.g. 103): drop, wait for the real head
            self.informational = True
            self.headers = []
            self.reason = b""
            return
        # Each field counts as `name: value` + CRLF, at most 2 more than its bytes on the wire
        # (`name:value` + LF): a head whose bytes so far bound that below the limit needs no sum.
        headers = self.headers
        if self.head_bytes + self.feeding + 2 * len(headers) > self.max_head:
            size = 0
            for n, v in headers:  # a loop, not sum() of a generator: no extra frame
                size += len(n) + len(v) + 4
            if size > self.max_head:
                self.exc = UpstreamProtocolError("upstream response headers too large")
                return
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        self.head_done = True
        if self.head_only:  # HEAD: llhttp cannot skip the announced body, so never reuse
            self.complete = True
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.complete:
            return
        if self.informational:
            self.informational = False
            return
        self.complete = True  # the timer stays: it lapses by itself (see arm)

    # -- helpers ----------------------------------------------------------------------------
    def _close_delimited(self) -> bool:
        for n, _ in self.headers:
            ln = n.lower()
            if ln == b"content-length" or ln == b"transfer-encoding":
                return False
        return True

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.exc is None or isinstance(self.exc, Stale):
            self.exc = exc
        self.abort()
        self._wake()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True

    def arm(self, phase: str, delay: float) -> None:
        """Set the phase deadline. One TimerHandle serves all phases and requests: it is only
        replaced when the new deadline is earlier; when it fires early it re-arms itself, and
        when the connection is idle or done it lapses. So back-to-back requests on a kept-alive
        connection cost no timer at all (a uvloop call_at + cancel costs ~2.5 µs)."""
        self.phase = phase
        self.deadline = deadline = self.loop.time() + delay
        timer = self.timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self.timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.complete or self.closed or not self.busy:
            return
        now = self.loop.time()
        if self.paused and self.phase is IDLE:  # our consumer is slow, not the backend
            self.deadline = now + self.idle_s
        if now < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._on_timer)
            return
        # Silence while sending counts as "idle" too: Timeouts.idle_s is "either way".
        self._fail(UpstreamTimeout(IDLE if self.phase is SEND else self.phase))
        if self.phase is SEND and self.task is not None:
            self.timer_cancelled = True
            self.task.cancel()  # it may be awaiting the client's body: stop that too

    def failed(self) -> bool:
        """`exc` is set. A call, not `exc is None` in a loop around an await: mypy would keep
        that narrowing across the await, and mypyc would check it (a TypeError)."""
        return self.exc is not None

    async def wait(self) -> None:
        """Wait for the next event on this connection; cancellation aborts the connection."""
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        except asyncio.CancelledError:
            self.abort()
            raise
        finally:
            self.waiter = None


def readable(fd: int) -> bool:
    """Input (a FIN, or junk) waits on an idle connection's socket: never hand it out. True
    also when it cannot be told (no descriptor, a closed one)."""
    if fd < 0:
        return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True
