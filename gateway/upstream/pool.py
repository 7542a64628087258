"""(compiled) Upstream HTTP/1.1 keep-alive connection pool: asyncio.Protocol + httptools (llhttp).

One `UpstreamHost` per backend endpoint (host, port, TLS settings) bounds its connections, keeps a
LIFO list of idle keep-alive connections and queues requests that find every connection busy; it
is made at the endpoint's first request and leaves the pool with its last connection. `request()`
streams the request body out (Content-Length when known, else chunked; waits for the transport
to drain) and returns an `UpstreamResponse` as soon as the head arrives; its body is read chunk
by chunk (`read_chunk` / `iter_chunks`) with backpressure: past `HIGH_WATER` unread bytes the
transport stops reading until the consumer drains below `LOW_WATER`.

Modules: this one owns the connections per endpoint and the retry decision; one connection and
its timer live in `gateway.upstream.conn`, request writing in `gateway.upstream.request`, the
response reader in `gateway.upstream.response`.

Timeouts need no per-request `wait_for`: each connection owns one lazily moved timer (see
`gateway.upstream.conn`); only opening a connection, or waiting for a free one, uses
`asyncio.timeout_at` (connect_s); the total deadline is the adapter's. Cancelling the awaiting
task aborts the connection (the backend sees it); so does releasing an unread response. Limits
(connections, idle list, head size) come from the gateway (`configure` after each reload).
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
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

from gateway.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.telemetry import metrics
from gateway.telemetry.requests import hist_tally
from gateway.upstream.conn import HIGH_WATER, LOW_WATER, Stale, UpstreamConn, readable
from gateway.upstream.dial import dial
from gateway.upstream.request import (
    REPLAY_LIMIT,
    ReplayStream,
    WriteBatch,
    encode_head,
    send_bytes,
    send_now,
    send_stream,
    wait_head,
)
from gateway.upstream.response import UpstreamResponse

if TYPE_CHECKING:
    from gateway.policy.compiled import Endpoint, RouteTimeouts
    from gateway.policy.model import Limits

__all__ = [
    "HIGH_WATER",
    "IDEMPOTENT",
    "LOW_WATER",
    "REPLAY_LIMIT",
    "STALE_CHECK_S",
    "Body",
    "UpstreamHost",
    "UpstreamPool",
    "UpstreamResponse",
    "encode_head",
]

STALE_CHECK_S: Final = 1.0  # idle longer than this: poll the socket for a FIN before reuse
IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

Body = AsyncIterator[bytes] | bytes | None


class UpstreamHost:
    """Connections to one endpoint: a LIFO idle list, a count, and requests waiting for one."""

    __slots__ = (
        "pool", "loop", "key", "backend", "host", "port", "tls", "idle", "total", "waiters",
        "sweeper", "fb",
    )  # fmt: skip

    def __init__(self, pool: UpstreamPool, endpoint: Endpoint) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.key = endpoint.upstream_key
        self.backend = backend = endpoint.backend
        self.host = endpoint.host
        self.port = endpoint.port
        self.tls = endpoint.tls  # built at policy load; None: plaintext
        self.idle: list[UpstreamConn] = []
        self.total = 0
        self.waiters: deque[asyncio.Future[UpstreamConn | None]] = deque()
        self.sweeper: asyncio.TimerHandle | None = None
        self.fb = hist_tally(metrics.UPSTREAM_FIRST_BYTE_SECONDS, backend, "http")
        conns = metrics.UPSTREAM_CONNECTIONS
        # Read at scrape time, over every member of the backend: nothing on the hot path.
        conns.labels(backend, "idle").set_function(lambda: pool.connections(backend, True))
        conns.labels(backend, "busy").set_function(lambda: pool.connections(backend, False))

    def take_idle(self, max_head: int) -> UpstreamConn | None:
        """An idle connection, at once (`acquire` without its coroutine), or None."""
        idle, loop = self.idle, self.loop
        while idle:
            conn = idle.pop()
            if loop.time() - conn.idle_since > STALE_CHECK_S and readable(conn.fd):
                conn.abort()  # FIN (or junk) pending: never hand it out
                continue
            conn.busy = conn.reused = True
            conn.reset(max_head)
            return conn
        return None

    async def acquire(self, connect_s: float, max_head: int) -> UpstreamConn:
        loop = self.loop
        deadline = loop.time() + connect_s
        while True:
            conn = self.take_idle(max_head)
            if conn is not None:
                return conn
            if self.total < self.pool.limits.max_connections_per_backend:
                return await self._connect(deadline, max_head)
            fut: asyncio.Future[UpstreamConn | None] = loop.create_future()
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
                got.reset(max_head)
                return got

    def _abandon(self, fut: asyncio.Future[UpstreamConn | None]) -> None:
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
            self._pass_slot()

    async def _connect(self, deadline: float, max_head: int) -> UpstreamConn:
        self.total += 1
        try:
            conn = await dial(
                self.loop, lambda: UpstreamConn(self), self.host, self.port, self.tls, deadline
            )
        except BaseException:
            self._slot_freed()
            raise
        conn.max_head = max_head
        return conn

    def put(self, conn: UpstreamConn) -> None:
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
        limits = self.pool.limits
        if len(self.idle) >= limits.max_idle_connections_per_backend:
            conn.busy = False
            conn.abort()
            return
        conn.busy = False
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(self.pool.idle_s, self._sweep)

    def forget(self, conn: UpstreamConn) -> None:
        """connection_lost: drop it from the books (once) and let a waiter connect."""
        if conn.gone:
            return
        conn.gone = True
        if not conn.busy and conn in self.idle:
            self.idle.remove(conn)
        self._slot_freed()

    def _slot_freed(self) -> None:
        self.total -= 1
        self._pass_slot()

    def _pass_slot(self) -> None:
        """A slot is free: the longest waiter may connect. With nobody waiting and no
        connection left, the host leaves the pool's table."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        if self.total <= 0:
            self.pool.forget_host(self)

    def _sweep(self) -> None:
        self.sweeper = None
        limit = self.pool.idle_s
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


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every endpoint; limits come from the live policy."""

    def __init__(self, limits: Limits, idle_s: float) -> None:
        # The live bounds (set by `configure` only): attributes, not getters, for the hot path.
        self.limits = limits
        self.idle_s = idle_s
        # By `Endpoint.upstream_key`: address and TLS settings, so a changed `tls` section opens
        # new connections while the old ones finish (idle ones close after upstream_idle_s).
        self._hosts: dict[str, UpstreamHost] = {}
        self._uploads: dict[tuple[str, int], int] = {}
        self.writes = WriteBatch()  # small requests of one loop turn, written together
        self.closed = False

    def uploads(self, endpoint: Endpoint) -> int:
        """Requests now streaming a body to this endpoint (bounded by the caller)."""
        return self._uploads.get((endpoint.host, endpoint.port), 0)

    def upload_started(self, endpoint: Endpoint) -> None:
        key = (endpoint.host, endpoint.port)
        self._uploads[key] = self._uploads.get(key, 0) + 1

    def upload_done(self, endpoint: Endpoint) -> None:
        key = (endpoint.host, endpoint.port)
        n = self._uploads.get(key, 0) - 1
        if n > 0:
            self._uploads[key] = n
        else:
            self._uploads.pop(key, None)

    def forget_host(self, host: UpstreamHost) -> None:
        """`host` has no connection left and nobody waiting for one: it leaves the table (the
        next request to its endpoint makes a new one), so that the table holds the endpoints
        with connections, not every member and TLS setting ever used (registry members come
        and go; a rotated certificate makes a new key)."""
        if self._hosts.get(host.key) is host:
            del self._hosts[host.key]
        if host.sweeper is not None:
            host.sweeper.cancel()
            host.sweeper = None

    def connections(self, backend: str, idle: bool) -> int:
        """Open connections to the members of `backend`: the idle ones, or the busy ones
        (`sluice_upstream_connections`, read at scrape time)."""
        n = 0
        for h in self._hosts.values():
            if h.backend == backend:
                n += len(h.idle) if idle else h.total - len(h.idle)
        return n

    def configure(self, limits: Limits, idle_s: float) -> None:
        """New bounds from a reload; connections in use keep going, new decisions use these."""
        self.limits = limits
        self.idle_s = idle_s

    async def request(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: Body,
        timeouts: RouteTimeouts,
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
        key = endpoint.upstream_key
        stream: ReplayStream | None = None
        chunked = False
        if body is None:
            framing = b"content-length: 0\r\n" if method in ("POST", "PUT", "PATCH") else b""
            body = b""
        elif isinstance(body, bytes | bytearray | memoryview):
            framing = b"content-length: %d\r\n" % len(body)
        else:
            stream = ReplayStream(body)
            if content_length is not None:
                framing = b"content-length: %d\r\n" % content_length
            else:
                framing = b"transfer-encoding: chunked\r\n"
                chunked = True
        head = encode_head(method, path, headers, framing)
        max_head = self.limits.max_response_header_bytes
        retried = False
        while True:
            # Looked up for each try: a stale connection that was the host's last one took the
            # host out of the table with it.
            host = self._hosts.get(key)
            if host is None:
                host = self._hosts[key] = UpstreamHost(self, endpoint)
            conn = host.take_idle(max_head) or await host.acquire(timeouts.connect_s, max_head)
            conn.head_only = method == "HEAD"
            conn.idle_s = timeouts.idle_s
            try:
                if stream is None:
                    if not send_now(conn, head, body, self.writes):  # type: ignore[arg-type]
                        await send_bytes(conn, head, body, timeouts, self.writes)  # type: ignore[arg-type]
                else:
                    await send_stream(conn, head, stream, chunked, timeouts)
                return await wait_head(conn, host.fb, timeouts)
            except asyncio.CancelledError:
                conn.abort()
                task = asyncio.current_task(conn.loop)
                if conn.timer_cancelled and task is not None and task.uncancel() == 0:
                    assert conn.exc is not None
                    raise conn.exc from None
                raise
            except Stale:
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

    def state(self) -> dict[str, dict[str, int]]:
        """Per endpoint address: open connections, idle ones, requests waiting for one (read by
        /admin/state; nothing on the request path). An address whose `tls` section changed
        counts its draining connections too."""
        out: dict[str, dict[str, int]] = {}
        for h in self._hosts.values():
            address = f"[{h.host}]:{h.port}" if ":" in h.host else f"{h.host}:{h.port}"
            st = out.setdefault(address, {"connections": 0, "idle": 0, "waiting": 0})
            st["connections"] += h.total
            st["idle"] += len(h.idle)
            st["waiting"] += len(h.waiters)
        return out

    async def aclose(self) -> None:
        """Close every idle connection; busy ones close when their response is released."""
        self.closed = True
        for host in self._hosts.values():
            host.close()
        await asyncio.sleep(0)  # let connection_lost callbacks run
