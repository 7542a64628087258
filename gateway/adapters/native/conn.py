"""(compiled) HTTP/1.1 ingress, native engine: an `asyncio.Protocol` with the httptools (llhttp)
parser.

The default engine (`listeners.http.engine: native`); same outward behaviour as the aiohttp
engine in `gateway.adapters.aiohttp` (a differential fuzz test holds them to it), ~30 µs cheaper per
request. This module owns the connections (parsing, limits, timers, flow control); the
per-request bytes are in `gateway.adapters.native.exchange`, the request logic in
`gateway.forward.http`.

What a connection does and refuses:
- timers: one lazily moved deadline per connection (no timer per request): `header_read_s` from
  the first byte of a request head (and from accept) to its end (slowloris), `keepalive_s` while
  idle between requests; none while a request is served (the route's `total_s` covers that). An
  idle connection's timer wakes every `header_read_s` at most, so that a head begun on a kept
  connection is cut at its own deadline, not at the keep-alive one.
- refused by the parser, answered with a JSON 400/431 and closed (lingering), counted in
  `REJECTED`, never seen by the chain or `finish`: malformed requests (llhttp strict: CL+TE,
  duplicate or invalid Content-Length, bare LF, obs-fold, CR/NUL in values, bad chunks), a
  Transfer-Encoding other than exactly one `chunked`, or any in HTTP/1.0, HTTP/1.1 without Host,
  a repeated singleton header (`SINGLETONS`), a target that is not origin-form, `*` for OPTIONS
  or absolute-form, CONNECT, an upgrade request with a body; a request line or one header line
  over `max_line_bytes`, more than `max_header_count` headers (or trailers), or an incomplete
  head past `max_header_bytes + max_line_bytes` (431). The same set as the aiohttp engine
  (`tests/adapters/test_differential.py` checks it). Upgrade requests are served as plain
  requests (the Upgrade header is hop-by-hop) and the connection stays HTTP/1.1. Header values
  lose their trailing whitespace; trailers of a chunked body are dropped.
- pipelining: requests are served strictly in order, one at a time; heads that arrive early
  wait in a queue (their bodies buffered). Reading goes on while a request is served, so a
  client disconnect is seen at once and cancels the request task, but stops (pause_reading)
  once `MAX_PIPELINE` requests or `HIGH_WATER` bytes wait.
- request bodies are streamed as they arrive: past `HIGH_WATER` unread bytes the socket stops
  being read until the upstream side drains them below `LOW_WATER` (the pool stops pulling
  while its own upstream write buffer is full).
- a body that turns out malformed after its request was handed to the chain (a later read):
  the request task answers 400 `incomplete body`, as the aiohttp engine does.
- writes: `drain()` waits on a Future resolved by `resume_writing`; a small whole answer on a
  connection that stays open goes out with the loop turn's others (`messages.OutBatch`).
- one task per connection, made with its first request, serving its requests in turn
  (`H1Handler.serve`); between requests it waits on a Future that the next head resolves. A
  task per request cost more: asyncio registers each new task in its weak set of all tasks,
  a Python-level `WeakSet.add` and, when it ends, a Python-level removal callback. The task
  ends when the connection closes (cancelled by `connection_lost`) or its client leaves.
- HTTP/2: a connection whose first bytes are the HTTP/2 preface (h2c with prior knowledge), or
  whose TLS handshake selected `h2` by ALPN, is handed (with the bytes read so far) to the
  HTTP/2 engine (`gateway.adapters.h2.server.serve_h2`).
- `Expect: 100-continue` is answered with `100 Continue` when the body is first read (a request
  refused before that gets its answer and the connection is closed); another Expect gets 417.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Final, cast

import httptools

from gateway.adapters.h2 import PREFACE, serve_h2
from gateway.adapters.native.messages import (
    HIGH_WATER,
    LOW_WATER,
    SINGLETONS,
    Req,
    absolute,
    simple_response,
)
from gateway.forward.headers import lower_name
from gateway.telemetry import metrics
from gateway.tls.material import identity

if TYPE_CHECKING:
    from gateway.adapters.native.server import H1Server

__all__ = ["H1Conn"]

MAX_PIPELINE: Final = 8  # request heads waiting behind the one being served
# Lingering close (as nginx's lingering_close): after answering a request whose body was not
# read (413, an early error), half-close and discard what the client still sends for a moment;
# closing at once with unread input makes the kernel reset the connection, and the client may
# lose the answer. Bounded in time and bytes.
LINGER_S: Final = 2.0
LINGER_BYTES: Final = 16 * 1024 * 1024


class Refused(Exception):
    """Raised from a parser callback: the request is refused with this answer."""

    def __init__(self, status: int, kind: str, text: str) -> None:
        super().__init__(text)
        self.status, self.kind, self.text = status, kind, text


TOO_LARGE: Final = (431, "headers_too_large", "request header fields too large")
BAD: Final = (400, "bad_request", "malformed HTTP request")


class H1Conn(asyncio.Protocol):
    """One client connection: the head being parsed and its checks, the request queue, timers
    and flow control."""

    def __init__(self, server: H1Server) -> None:
        self.server = server
        self.loop = server.loop
        # The parser holds this connection's bound methods (its callbacks): a reference cycle,
        # broken when the connection ends (`detach`) so that its objects go at once, by their
        # reference counts. Left to the collector, the ~20 objects each closed connection held
        # made it run every ~500 connections.
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.client_cert = ""  # mTLS identity of the client (see gateway.tls.material)
        self.closed = False
        self.stopping = False  # close once the current request is answered
        self.ignore = False  # no more parsing (after `Connection: close`, an upgrade, an error)
        self.pending: tuple[int, str, str] | None = None  # refusal to send when the queue ends
        # Request being parsed, served, and waiting (pipelined).
        self.cur: Req | None = None
        self.active: Req | None = None
        self.queue: deque[Req] = deque()
        self.queued_bytes = 0
        self.task: asyncio.Task[None] | None = None  # serves the requests in turn
        self.idle: asyncio.Future[Req | None] | None = None  # the task waits for a request
        self.waiter: asyncio.Future[None] | None = None
        self.read_paused = False
        self.write_paused = False
        self.drainer: asyncio.Future[None] | None = None
        # The head being parsed.
        self.refused: Refused | None = None
        self.in_head = False
        self.head_bytes = 0
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_size = 0
        self.host_seen = False
        self.te_seen = False
        self.seen: set[bytes] = set()  # singleton header names seen in this head
        self.body_declared = False  # a non-zero Content-Length or chunked
        self.trailers = 0  # trailer fields of the chunked body being read (dropped)
        # One lazily moved deadline.
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.lingering = -1  # bytes discarded while lingering; -1: not lingering
        self.sniff: bytes | None = b""  # first bytes while they may be the HTTP/2 preface
        self.out: bytes | None = None  # an answer deferred to the loop turn's `OutBatch`
        # The head's limits, read once (a policy model's field is a generic lookup per read).
        limits = server.limits
        self.max_line: int = limits.max_line_bytes
        self.max_headers: int = limits.max_header_count
        self.max_head: int = limits.max_header_bytes + limits.max_line_bytes

    # --- transport events ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        self.server.conns.add(self)
        self.arm(self.server.header_read_s)
        sslobj = transport.get_extra_info("ssl_object")
        if sslobj is None:
            return
        if self.server.mtls:  # the handshake is over: a certificate here was verified
            # decoded once already, by the loop's SSL transport when the handshake ended
            self.client_cert = identity(transport.get_extra_info("peercert"))
        if sslobj.selected_alpn_protocol() == "h2":
            self.to_h2(b"")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.detach()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: the pool aborts the upstream request
        self.task = None
        self.queue.clear()
        self.wake()
        fut, self.drainer = self.drainer, None
        if fut is not None and not fut.done():
            fut.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        fut, self.drainer = self.drainer, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.sniff is not None:  # the connection's first bytes
            data = self.sniff + data
            n = min(len(data), len(PREFACE))
            if data[:n] != PREFACE[:n]:
                self.sniff = None
            elif n < len(PREFACE):
                self.sniff = data  # a prefix of the preface: wait for the rest
                return
            else:
                self.to_h2(data)
                return
        if self.ignore:
            if self.lingering >= 0:
                self.lingering += len(data)
                if self.lingering > LINGER_BYTES and self.transport is not None:
                    self.transport.close()
            return
        parser = self.parser
        if parser is None:  # the connection ended
            return
        try:
            while True:
                try:
                    parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as e:
                    # Served as a plain request (Upgrade is hop-by-hop and ignored, RFC 9110
                    # §7.8); llhttp stops at the end of its head, so a fresh parser reads on.
                    data = data[int(e.args[0]) :]
                    parser = self.parser = httptools.HttpRequestParser(self)
                    if self.ignore or not data:
                        return
        except httptools.HttpParserError as e:
            ref, self.refused = self.refused, None
            if ref is None and isinstance(e.__context__, Refused):
                ref = e.__context__
            self.refuse(*((ref.status, ref.kind, ref.text) if ref else BAD))
            return
        if self.in_head:
            # A head that began inside this chunk is not counted yet (one chunk is bounded).
            self.head_bytes = 0 if self.head_bytes < 0 else self.head_bytes + len(data)
            if self.head_bytes > self.max_head:
                self.refuse(*TOO_LARGE)

    def eof_received(self) -> bool:
        return False  # close; a request in flight is cancelled (as aiohttp does)

    def to_h2(self, data: bytes) -> None:
        """Hand the connection to the HTTP/2 engine (no HTTP/1.1 request was read on it)."""
        self.sniff = None
        self.ignore = True
        self.detach()
        assert self.transport is not None
        serve_h2(self.server.h2, self.transport, data, self.client_cert)

    def detach(self) -> None:
        """The socket is no longer this object's (closed, or handed to HTTP/2): out of the
        server's connections, its timer off, its parser dropped (the cycle, see __init__)."""
        self.closed = True
        self.server.conns.discard(self)
        self.parser = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # --- parser callbacks ---

    def begin_head(self) -> None:
        self.in_head = True
        self.head_bytes = -1  # began inside the chunk being parsed
        self.url = b""
        self.headers = []
        self.header_size = 0
        self.host_seen = self.te_seen = self.body_declared = False
        self.trailers = 0
        self.seen.clear()

    def refusal(self, answer: tuple[int, str, str]) -> Refused:
        """The refusal to raise from a callback, kept in `refused` too: the connection reads it
        there (the parser's error does not chain it when the callback is compiled)."""
        r = self.refused = Refused(*answer)
        return r

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.max_line:
            raise self.refusal(TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:  # a trailer of a chunked body: dropped, never a request header
            self.trailers += 1
            if self.trailers > self.max_headers:
                raise self.refusal(TOO_LARGE)
            return
        size = len(name) + len(value)
        if size + 2 > self.max_line:
            raise self.refusal(TOO_LARGE)
        if len(self.headers) >= self.max_headers:
            raise self.refusal(TOO_LARGE)
        # llhttp drops the whitespace before a value, not after (RFC 9110 §5.5: neither is part
        # of the value).
        if value and value[-1] in (32, 9):  # (rare: no method call for the others)
            value = value.rstrip(b" \t")
            size = len(name) + len(value)
        ln = lower_name(name)
        if ln in SINGLETONS:
            if ln in self.seen:
                raise self.refusal(BAD)
            self.seen.add(ln)
            if ln == b"host":
                self.host_seen = True
            elif ln == b"transfer-encoding":
                if value.lower() != b"chunked":
                    raise self.refusal(BAD)
                self.te_seen = self.body_declared = True
            elif ln == b"content-length" and value.lstrip(b"0"):
                self.body_declared = True
        self.header_size += size + 4
        self.headers.append((name, value))

    def parsed_head(self) -> Req:
        """The request of the complete head (raises Refused)."""
        parser = self.parser
        assert parser is not None  # (called by the parser)
        method = parser.get_method().decode("ascii")
        http10 = parser.get_http_version() == "1.0"
        url = self.url
        if (
            method == "CONNECT"
            or (not self.host_seen and not http10)  # RFC 9112 §3.2: 400 without Host
            or (self.te_seen and http10)  # RFC 9112 §6.1: faulty framing
            or (url[:1] != b"/" and not (url == b"*" and method == "OPTIONS") and not absolute(url))
            # llhttp would take its body for the upgraded protocol; nothing is upgraded here
            or (self.body_declared and parser.should_upgrade())
        ):
            raise self.refusal(BAD)
        req = Req(method, url, self.headers, self.header_size, parser.should_keep_alive())
        req.http10 = http10
        req.chunked = self.te_seen
        return req

    def on_message_begin(self) -> None:
        self.begin_head()
        if self.active is None:
            self.arm(self.server.header_read_s)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.deadline = None
        req = self.parsed_head()
        self.cur = req
        if self.active is None and not self.queue:
            self.start(req)
        else:
            self.queue.append(req)
            self.flow()

    def on_body(self, body: bytes) -> None:
        req = self.cur
        assert req is not None
        req.body.append(body)
        req.buffered += len(body)
        if req is not self.active:
            self.queued_bytes += len(body)
        elif self.waiter is not None:
            self.wake()
        if not self.read_paused and (
            req.buffered > req.high_water or self.queued_bytes > HIGH_WATER
        ):
            self.flow()

    def on_message_complete(self) -> None:
        req = self.cur
        assert req is not None
        req.body_done = True
        self.cur = None
        if not req.keep_alive:
            self.ignore = True  # nothing after `Connection: close` / HTTP/1.0 is parsed
        if req is self.active:
            self.wake()

    # --- requests ---

    def start(self, req: Req) -> None:
        """Hand `req` to the connection's task: wake it where it waits, or make it (its first
        request, or after it ended); a task that is finishing a request takes `active` next."""
        self.active = req
        self.deadline = None
        idle = self.idle
        if idle is not None:
            self.idle = None
            idle.set_result(req)
        elif self.task is None or self.task.done():
            self.task = self.loop.create_task(self.server.handler.serve(self))

    async def next_request(self) -> Req | None:
        """Called by the connection's task between requests: the next request once its head
        is here (`start`), or None when none will come (the connection closes)."""
        t = self.transport
        if self.closed or self.ignore or self.stopping or t is None or t.is_closing():
            return None
        idle: asyncio.Future[Req | None] = self.loop.create_future()
        self.idle = idle
        return await idle

    def request_done(self, req: Req) -> None:
        """Called by the connection's task as a request ends: next queued request, idle
        timer, or close."""
        self.active = None
        if self.closed:
            return
        assert self.transport is not None
        if not req.responded:  # nothing (or only part of an answer) went out: cut
            self.transport.abort()
            return
        if req.close or self.stopping:
            self.flush_out()
            if req.body_done:
                self.transport.close()
            else:
                self.linger_close()
            return
        if self.queue:
            nxt = self.queue.popleft()
            self.queued_bytes -= nxt.buffered
            self.start(nxt)
        elif self.pending is not None:
            self.refuse(*self.pending)
            return
        else:
            s = self.server
            self.arm(s.header_read_s if self.in_head else s.keepalive_s)
        self.flow()

    def linger_close(self) -> None:
        """Half-close after the answer, discard further input until EOF, LINGER_S or
        LINGER_BYTES, then close."""
        assert self.transport is not None
        self.flush_out()
        self.ignore = True
        self.lingering = 0
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:  # the client is gone already (ENOTCONN): nothing to linger for
            self.transport.abort()
            return
        self.transport.resume_reading()
        self.arm(LINGER_S)

    def refuse(self, status: int, kind: str, text: str) -> None:
        """A request the parser refused: answer it in the JSON shape and close."""
        self.ignore = True
        cur = self.cur
        if cur is not None and cur is self.active and not cur.started and self.task is not None:
            # Not begun yet (the error came in the same read): it never happened. The
            # connection's task ends (no request follows a refusal).
            self.task.cancel()
            self.task = self.active = self.idle = None
        elif cur is not None and cur is self.active and not cur.body_done:
            cur.body_error = True  # the request task answers 400 (incomplete body), as aiohttp
            self.wake()
            return
        elif cur is not None and self.queue and self.queue[-1] is cur:
            self.queue.pop()  # its body is malformed: it is answered by the refusal instead
            self.queued_bytes -= cur.buffered
        if self.pending is None:
            metrics.REJECTED.labels(kind, "http").inc()
        if self.active is not None or self.queue:
            self.pending = (status, kind, text)  # after the requests before it
            self.flow()
            return
        if self.transport is not None and not self.closed:
            self.flush_out()
            self.transport.write(simple_response(status, kind, text))
            self.linger_close()  # what follows the bad request must not reset the answer away

    # --- flow control and waiting ---

    def flow(self) -> None:
        """Pause reading while too much waits unread (request body, pipelined requests)."""
        if self.closed or self.transport is None:
            return
        act = self.active
        want = (
            (act is not None and act.buffered > act.high_water)
            or len(self.queue) >= MAX_PIPELINE
            or self.queued_bytes > HIGH_WATER
            or self.pending is not None
        )
        if want and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        elif self.read_paused and not want:
            if act is not None and act.buffered > LOW_WATER:
                return
            self.read_paused = False
            self.transport.resume_reading()

    def wake(self) -> None:
        fut, self.waiter = self.waiter, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self) -> None:
        """Until the active request gets more body bytes, its end, an error or a disconnect."""
        fut = self.waiter = self.loop.create_future()
        await fut

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client disconnected")
        if self.write_paused:
            fut = self.drainer = self.loop.create_future()
            await fut

    # --- timer ---

    def arm(self, seconds: float) -> None:
        """The connection's deadline is `seconds` from now. The timer is made only when none is
        pending, and never sleeps past `header_read_s` from when it is set: a head that begins
        while the connection idles on its (longer) keep-alive deadline moves the deadline nearer,
        and the timer wakes in time to see it."""
        now = self.loop.time()
        self.deadline = now + seconds
        if self.timer is None:
            at = min(self.deadline, now + self.server.header_read_s)
            self.timer = self.loop.call_at(at, self._expired)

    def _expired(self) -> None:
        self.timer = None
        if self.deadline is None or self.closed or self.active is not None:
            return
        now = self.loop.time()
        if now >= self.deadline:
            assert self.transport is not None
            self.flush_out()
            self.transport.close()  # idle keep-alive, or a head not complete in time
        else:
            at = min(self.deadline, now + self.server.header_read_s)
            self.timer = self.loop.call_at(at, self._expired)

    def shutdown(self) -> None:
        self.stopping = True
        if self.active is None and self.transport is not None:
            self.flush_out()
            self.transport.close()

    # --- deferred writes ---

    def defer(self, data: bytes) -> None:
        """Write `data` at the start of the next loop turn, with the turn's other answers."""
        if self.out is None:
            self.out = data
            self.server.out.add(self)
        else:
            self.out += data

    def flush_out(self) -> None:
        data, self.out = self.out, None
        t = self.transport
        if data is not None and not self.closed and t is not None and not t.is_closing():
            t.write(data)
