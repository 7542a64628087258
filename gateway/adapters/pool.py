"""Upstream HTTP/1.1 keep-alive connection pool: asyncio.Protocol + httptools (llhttp).

One `_Host` per backend endpoint (host, port) bounds its connections, keeps a LIFO list of idle
keep-alive connections and queues requests that find every connection busy. `request()` streams
the request body out (Content-Length when known, else chunked; waits for the transport to drain)
and returns an `UpstreamResponse` as soon as the head arrives; its body is read chunk by chunk
(`read_chunk` / `iter_chunks`) with backpressure: past `HIGH_WATER` unread bytes the transport stops
reading until the consumer drains below `LOW_WATER`.

Timeouts need no per-request `wait_for`: each connection owns at most one `call_at` timer whose
deadline moves lazily (first byte; idle = silence between chunks either way, so a stalled
streamed request body also ends in UpstreamTimeout("idle")). Only opening a new connection, or
waiting for a free one, uses `asyncio.timeout_at` (connect_s). The total deadline belongs to the
adapter. Cancelling the awaiting task aborts the connection at once (the backend sees the
disconnect); so does releasing a response that was not read to its end.

Limits (connections, idle list, response head size) are read from the live policy per request.
Hop-by-hop headers are the caller's business (the HTTP adapter strips them both ways); the pool
adds only the framing header. A response to HEAD, a 1xx interim head (skipped) or extra bytes
after a response never leave a connection in the idle list in an unknown state: HEAD and extra
bytes close it. Upgrades (101) are not supported.

Stale keep-alive retry (what we chose): a request is retried once on a fresh connection when it
went out on a *reused* connection that closed before any response byte arrived, every byte sent
is still at hand (bytes body, or a streamed body whose sent part fits `REPLAY_LIMIT`), and either
the method is idempotent or the connection was lost before the request was completely written (a
server never acts on an incomplete request). A POST fully written to a connection the server had
just closed is therefore *not* retried (like Go's net/http); to make that race rare, a connection
idle for more than `STALE_CHECK_S` is polled for a pending FIN before it is reused.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import httptools

from gateway.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from gateway.telemetry import metrics

if TYPE_CHECKING:
    from gateway.app import Active
    from gateway.policy.compiled import Endpoint
    from gateway.policy.holder import PolicyHolder
    from gateway.policy.model import Limits, Timeouts

HIGH_WATER = 256 * 1024  # unread response bytes before pause_reading()
LOW_WATER = 64 * 1024  # resume_reading() once the consumer is back under this
REPLAY_LIMIT = 64 * 1024  # streamed request bytes kept for a stale-connection retry
STALE_CHECK_S = 1.0  # idle longer than this: poll the socket for a FIN before reuse
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

Body = AsyncIterator[bytes] | bytes | None

# Connection phases, used as the timer's meaning and as UpstreamTimeout.phase.
_SEND, _FIRST_BYTE, _IDLE = "send", "first_byte", "idle"
_CRLF = b"\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class _Stale(Exception):
    """A reused connection died before any response byte: the caller may retry."""


class _Stream:
    """A streamed request body and the bytes of it already sent, kept for one replay while they
    fit in REPLAY_LIMIT (`sent` is None past that: no retry is possible any more)."""

    __slots__ = ("source", "sent", "size")

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self.source = source
        self.sent: list[bytes] = []
        self.size = 0

    @property
    def replayable(self) -> bool:
        return self.size <= REPLAY_LIMIT

    def keep(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size <= REPLAY_LIMIT:
            self.sent.append(piece)
        elif self.sent:
            self.sent = []


class _Conn(asyncio.Protocol):
    """One upstream TCP connection and the state of the response being read on it."""

    __slots__ = (
        "host", "loop", "transport", "fd", "parser", "closed", "busy", "reused", "idle_since",
        "head_done", "status", "reason", "headers", "head_bytes", "max_head", "keep_alive",
        "complete", "informational", "got_byte", "chunks", "buffered", "paused", "write_paused",
        "waiter", "exc", "timer", "phase", "deadline", "idle_s", "task", "sent_all", "head_only",
        "gone", "timer_cancelled",
    )  # fmt: skip

    def __init__(self, host: _Host) -> None:
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
        self.phase = _SEND
        self.deadline = 0.0
        # llhttp starts over after each complete message: one parser per connection suffices.
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: deque[bytes] = deque()
        self._reset(65536)

    def _reset(self, max_head: int) -> None:
        """Fresh response state for the next request (only clean connections are reused)."""
        self.head_done = False
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
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
        self._attach(transport)

    def _attach(self, transport: asyncio.BaseTransport) -> None:
        # uvloop may call connection_made after create_connection() returned: attach from both.
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
        try:
            self.parser.feed_data(data)
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
        elif self.phase is _IDLE:
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
                    _Stale()
                    if self.reused and not self.got_byte
                    else UpstreamProtocolError("upstream closed before the response head")
                )
            self._wake()
        self.host.forget(self)

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
        status = self.parser.get_status_code()
        if status < 200 and status != 101:  # 1xx interim (e.g. 103): drop, wait for the real head
            self.informational = True
            self.headers = []
            self.reason = b""
            return
        size = sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_head:
            self.exc = UpstreamProtocolError("upstream response headers too large")
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
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
        if self.exc is None or isinstance(self.exc, _Stale):
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
        if self.paused and self.phase is _IDLE:  # our consumer is slow, not the backend
            self.deadline = now + self.idle_s
        if now < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._on_timer)
            return
        # Silence while sending counts as "idle" too: Timeouts.idle_s is "either way".
        self._fail(UpstreamTimeout(_IDLE if self.phase is _SEND else self.phase))
        if self.phase is _SEND and self.task is not None:
            self.timer_cancelled = True
            self.task.cancel()  # it may be awaiting the client's body: stop that too

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


class UpstreamResponse:
    """Status, reason and raw headers of an upstream response; its body is read in chunks.

    Call `release()` (or `await aclose()`) exactly when done: the connection goes back to the
    pool only if the body was read to its end and keep-alive holds, otherwise it is closed.
    """

    __slots__ = ("status", "reason", "headers", "_conn")

    def __init__(self, conn: _Conn) -> None:
        self.status = conn.status
        self.reason = conn.reason.decode("latin-1")
        self.headers = conn.headers
        self._conn: _Conn | None = conn

    async def read_chunk(self) -> bytes:
        """The next body chunk as it arrived; b"" at the end of the body."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            if conn.chunks:
                chunk = conn.chunks.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered <= LOW_WATER and not conn.closed:
                    conn.paused = False
                    assert conn.transport is not None
                    conn.transport.resume_reading()
                return chunk
            if conn.complete:
                self.release()
                return b""
            exc = conn.exc
            if exc is not None:
                self.release()
                raise exc if not isinstance(exc, _Stale) else UpstreamProtocolError("closed")
            await conn.wait()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.read_chunk():
            yield chunk

    @property
    def complete(self) -> bool:
        return self._conn is None or (self._conn.complete and not self._conn.chunks)

    def release(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.host.put(conn)

    async def aclose(self) -> None:
        self.release()


class _Host:
    """Connections to one endpoint: a LIFO idle list, a count, and requests waiting for one."""

    __slots__ = ("pool", "loop", "host", "port", "idle", "total", "waiters", "sweeper", "fb")

    def __init__(self, pool: UpstreamPool, endpoint: Endpoint) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.host = endpoint.host
        self.port = endpoint.port
        self.idle: list[_Conn] = []
        self.total = 0
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self.sweeper: asyncio.TimerHandle | None = None
        self.fb = metrics.UPSTREAM_FIRST_BYTE_SECONDS.labels(endpoint.backend, "http")
        conns = metrics.UPSTREAM_CONNECTIONS
        # Read at scrape time: nothing on the hot path.
        conns.labels(endpoint.backend, "idle").set_function(lambda: len(self.idle))
        conns.labels(endpoint.backend, "busy").set_function(lambda: self.total - len(self.idle))

    async def acquire(self, connect_s: float, max_head: int) -> _Conn:
        loop = self.loop
        deadline = loop.time() + connect_s
        while True:
            idle = self.idle
            while idle:
                conn = idle.pop()
                if loop.time() - conn.idle_since > STALE_CHECK_S and _readable(conn.fd):
                    conn.abort()  # FIN (or junk) pending: never hand it out
                    continue
                conn.busy = True
                conn.reused = True
                conn._reset(max_head)
                return conn
            if self.total < self.pool.limits().max_connections_per_backend:
                return await self._connect(deadline, max_head)
            fut: asyncio.Future[_Conn | None] = loop.create_future()
            self.waiters.append(fut)
            try:
                async with asyncio.timeout_at(deadline):
                    got = await fut
            except BaseException as e:
                self._abandon(fut)
                if isinstance(e, TimeoutError):
                    raise UpstreamConnectError(
                        f"no free connection to {self.host}:{self.port} within {connect_s}s"
                    ) from None
                raise
            if got is not None and not got.closed:
                got.reused = True
                got._reset(max_head)
                return got

    def _abandon(self, fut: asyncio.Future[_Conn | None]) -> None:
        """A waiter gave up (timeout/cancel): pass on whatever it was handed, or unqueue it."""
        if not fut.done():
            fut.cancel()
        if fut.cancelled():
            try:
                self.waiters.remove(fut)
            except ValueError:
                pass
            return
        got = fut.result()
        if got is not None:
            self.put(got)
        else:
            self._wake_waiter()

    async def _connect(self, deadline: float, max_head: int) -> _Conn:
        self.total += 1
        try:
            async with asyncio.timeout_at(deadline):
                transport, proto = await self.loop.create_connection(
                    lambda: _Conn(self), self.host, self.port
                )
        except TimeoutError:
            self._slot_freed()
            raise UpstreamTimeout("connect") from None
        except OSError as e:
            self._slot_freed()
            raise UpstreamConnectError(f"connect to {self.host}:{self.port}: {e}") from e
        except BaseException:
            self._slot_freed()
            raise
        conn = proto
        conn._attach(transport)
        conn.max_head = max_head
        return conn

    def put(self, conn: _Conn) -> None:
        """Take a connection back after a response; keep it only if it is clean and alive."""
        conn.task = None
        if (
            conn.closed
            or self.pool.closed
            or not (conn.complete and conn.keep_alive and not conn.chunks)
        ):
            conn.abort()
            return
        if conn.paused:
            conn.paused = False
            assert conn.transport is not None
            conn.transport.resume_reading()
        while self.waiters:  # hand it straight to the longest waiter
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        limits = self.pool.limits()
        if len(self.idle) >= limits.max_idle_connections_per_backend:
            conn.busy = False
            conn.abort()
            return
        conn.busy = False
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(self.pool.idle_s(), self._sweep)

    def forget(self, conn: _Conn) -> None:
        """connection_lost: drop it from the books (once) and let a waiter connect."""
        if conn.gone:
            return
        conn.gone = True
        if not conn.busy and conn in self.idle:
            self.idle.remove(conn)
        self._slot_freed()

    def _slot_freed(self) -> None:
        self.total -= 1
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _sweep(self) -> None:
        self.sweeper = None
        limit = self.pool.idle_s()
        cutoff = self.loop.time() - limit
        for conn in [c for c in self.idle if c.idle_since <= cutoff]:
            conn.abort()  # connection_lost follows and removes it; remove now for accounting
            if conn in self.idle:
                self.idle.remove(conn)
        if self.idle:
            oldest = min(c.idle_since for c in self.idle)
            self.sweeper = self.loop.call_at(oldest + limit, self._sweep)

    def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        for conn in list(self.idle):
            conn.abort()
        self.idle.clear()


def _check_open(conn: _Conn) -> None:
    if conn.closed:  # handed over, then closed before we wrote anything
        raise _Stale() if conn.reused else UpstreamProtocolError("upstream closed")


def _readable(fd: int) -> bool:
    if fd < 0:
        return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def encode_head(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> bytearray:
    """Request line + headers, without the final CRLF (the framing header comes last).

    Raises ValueError on CR/LF inside a name, value or the target (header injection): each
    header line adds exactly one CRLF, so two counts over the joined block check them all.
    """
    if "\r" in path or "\n" in path or " " in path:
        raise ValueError("CR/LF/SP in the upstream request target")
    lines = [n + b": " + v for n, v in headers]
    block = b"\r\n".join(lines)
    n = len(lines) - 1 if lines else 0
    if block.count(b"\n") != n or block.count(b"\r") != n:
        raise ValueError("CR/LF in an upstream header")
    head = bytearray(method.encode("ascii"))
    head += (
        b" %b HTTP/1.1\r\n%b\r\n" % (path.encode("latin-1"), block)
        if lines
        else (b" %b HTTP/1.1\r\n" % path.encode("latin-1"))
    )
    return head


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every endpoint; limits come from the live policy."""

    def __init__(self, holder: PolicyHolder[Active]) -> None:
        self._holder = holder
        self._hosts: dict[tuple[str, int], _Host] = {}
        self.closed = False

    def limits(self) -> Limits:
        return self._holder.active.policy.policy.limits

    def idle_s(self) -> float:
        return float(self._holder.active.policy.policy.timeouts.upstream_idle_s)

    async def request(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: Body,
        timeouts: Timeouts,
        *,
        content_length: int | None = None,
    ) -> UpstreamResponse:
        """Send one request and return once the response head is in.

        `headers` must not carry framing (Content-Length / Transfer-Encoding): the pool adds it
        from `body` (bytes → its length; iterator → `content_length` if given, else chunked).
        Raises UpstreamConnectError, UpstreamTimeout(connect|idle|first_byte) or
        UpstreamProtocolError; if the task is cancelled the connection is aborted.
        """
        if self.closed:
            raise UpstreamConnectError("pool closed")
        key = (endpoint.host, endpoint.port)
        host = self._hosts.get(key)
        if host is None:
            host = self._hosts[key] = _Host(self, endpoint)
        head = encode_head(method, path, headers)
        stream: _Stream | None = None
        chunked = False
        if body is None:
            if method in ("POST", "PUT", "PATCH"):
                head += b"content-length: 0\r\n"
            body = b""
        elif isinstance(body, bytes | bytearray | memoryview):
            head += b"content-length: %d\r\n" % len(body)
        else:
            stream = _Stream(body)
            if content_length is not None:
                head += b"content-length: %d\r\n" % content_length
            else:
                head += b"transfer-encoding: chunked\r\n"
                chunked = True
        head += _CRLF
        max_head = self.limits().max_response_header_bytes
        retried = False
        while True:
            conn = await host.acquire(timeouts.connect_s, max_head)
            conn.head_only = method == "HEAD"
            conn.idle_s = timeouts.idle_s
            try:
                if stream is None:
                    await self._send_bytes(conn, head, body, timeouts)  # type: ignore[arg-type]
                else:
                    await self._send_stream(conn, head, stream, chunked, timeouts)
                return await self._wait_head(conn, host, timeouts)
            except asyncio.CancelledError:
                conn.abort()
                task = asyncio.current_task(conn.loop)
                if conn.timer_cancelled and task is not None and task.uncancel() == 0:
                    assert conn.exc is not None
                    raise conn.exc from None
                raise
            except _Stale:
                conn.abort()
                if (
                    retried
                    or (method not in IDEMPOTENT and conn.sent_all)
                    or (stream is not None and not stream.replayable)
                ):
                    raise UpstreamProtocolError(
                        "upstream closed the connection before responding"
                    ) from None
                retried = True
            except BaseException:
                conn.abort()
                raise

    async def _send_bytes(self, conn: _Conn, head: bytearray, body: bytes, t: Timeouts) -> None:
        assert conn.transport is not None
        _check_open(conn)
        if len(body) < 65536:  # one write, one syscall (a copy: `head` may be sent again)
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
            conn.transport.write(body)
        if conn.write_paused:
            conn.arm(_SEND, t.idle_s)
            await self._drain(conn)
        self._check_stale(conn)
        conn.sent_all = True

    async def _send_stream(
        self, conn: _Conn, head: bytearray, stream: _Stream, chunked: bool, t: Timeouts
    ) -> None:
        """Write the head, replay what a stale connection lost, then pull the stream through."""
        transport = conn.transport
        assert transport is not None
        _check_open(conn)
        conn.task = asyncio.current_task(conn.loop)
        conn.arm(_SEND, t.idle_s)
        transport.write(head)
        for piece in stream.sent:
            transport.write(piece)
        async for chunk in stream.source:
            if not chunk:
                continue
            piece = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk
            stream.keep(piece)  # before the checks below: a pulled chunk must never be lost
            if conn.closed or conn.head_done:  # lost, or an early answer (e.g. 413): stop
                break
            transport.write(piece)
            if conn.write_paused:
                await self._drain(conn)
                conn.arm(_SEND, t.idle_s)
            else:
                conn.deadline = conn.loop.time() + t.idle_s
        else:
            if chunked and not conn.closed:
                transport.write(_LAST_CHUNK)
            self._check_stale(conn)
            conn.sent_all = True
        conn.task = None
        if conn.exc is not None:
            raise conn.exc  # a _Stale instance included: the caller decides on a retry
        if not conn.sent_all:  # early answer: the rest of the body never went out
            conn.keep_alive = False

    @staticmethod
    def _check_stale(conn: _Conn) -> None:
        if conn.exc is not None:
            raise conn.exc

    @staticmethod
    async def _drain(conn: _Conn) -> None:
        while conn.write_paused and conn.exc is None and not conn.closed:
            await conn.wait()
        if conn.exc is not None:
            raise conn.exc

    async def _wait_head(self, conn: _Conn, host: _Host, t: Timeouts) -> UpstreamResponse:
        loop = conn.loop
        sent_at = loop.time()
        if not conn.head_done and conn.exc is None:
            conn.arm(_FIRST_BYTE, t.first_byte_s)
            while not conn.head_done and conn.exc is None:
                await conn.wait()
        if not conn.head_done:
            assert conn.exc is not None
            raise conn.exc
        host.fb.observe(loop.time() - sent_at)
        if not conn.complete:
            conn.arm(_IDLE, t.idle_s)
        return UpstreamResponse(conn)

    async def aclose(self) -> None:
        """Close every idle connection; busy ones close when their response is released."""
        self.closed = True
        for host in self._hosts.values():
            host.close()
        await asyncio.sleep(0)  # let connection_lost callbacks run
