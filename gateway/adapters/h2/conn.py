"""Sluice's HTTP/2 engine: one connection as an `asyncio.Protocol` over python-hyper `h2`
(sans-IO), with the limits h2 leaves to its embedder (`limits.http2`).

The loop ("The HTTP/2 connection loop" in docs/contributing.md): `data_received` → the frame guard
counts frame headers (`gateway.adapters.h2.guard`) → `receive_data` → every event handled → one
`data_to_send()` → one write. Each new stream goes to the listener's `server.StreamHandler` (HTTP
routes: `exchange.H2HttpHandler`; gRPC calls: `grpc.H2GrpcHandler`), which runs it in a task of its
own. A TLS listener that verifies client certificates (`mtls`) and hands connections to this engine
directly has the identity read here.

What a connection does and refuses:
- concurrency: SETTINGS_MAX_CONCURRENT_STREAMS is advertised; a stream past it is refused with
  RST_STREAM REFUSED_STREAM (h2 itself would end the whole connection: its own bound is lifted).
- a share of the loop: a read that opens more than `guard.STREAMS_PER_TURN` streams is fed to h2
  in pieces, one per turn of the event loop (reading stops until the last), so the other
  connections are not held behind its HEADERS processing (stream exhaustion); while the
  connection holds all the streams it may, one piece per `REFUSING_TURN_S` (a read past
  `max_new_streams_per_read` once reading resumes ends it). A closing connection ends its
  streams `ENDS_PER_TURN` per turn (`end_streams`).
- floods (guard, rapid reset, control frames queued while the client does not read: past
  `max_queued_control_frames`, or the socket buffer full with no stream open): GOAWAY
  with the breach's code, counted in `sluice_rejected_total{reason="h2_…"}`, and the
  connection is closed (cut at once when the client does not read).
- rapid reset: streams the client resets before their answer ended and within 1 s of their
  start, or that were refused past the refusal allowance (`FrameGuard.refusal_counts`: twice
  max_concurrent_streams at once, refilled at max_concurrent_streams per second), past
  `rapid_reset_ratio` of the streams opened once `rapid_reset_min_streams` were → GOAWAY
  ENHANCE_YOUR_CALM.
- a header block HPACK cannot decode: GOAWAY COMPRESSION_ERROR (`guard.ServerH2`).
- flow control: the connection window is `initial_stream_window_bytes` × max streams, so only a
  stream's own window can fill; a stream's window is returned when its handler takes the bytes.
  Writes wait per stream on the send window, and on the socket (`pause_writing`), during which
  the connection stops reading.
- timers: one lazily moved deadline: `timeouts.header_read_s` from accept to the first request
  and while a header block is open; `timeouts.keepalive_s` with no open stream.
- drain: GOAWAY announcing 2^31-1, then after `drain_goaway_delay_s` the GOAWAY with the last
  stream taken (RFC 9113 §6.8); the connection closes once its streams end. Past
  `max_requests_per_connection` the GOAWAY naming the last stream goes out once the streams up
  to it are answered.
- a client's GOAWAY ends the connection (python-hyper h2 sends nothing after it): its streams
  are cancelled and accounted as such.
- a malformed request header block (RFC 9113 §8.2-8.3, h2's own validator run per stream) is
  a stream error: RST_STREAM PROTOCOL_ERROR, counted as an early reset and in
  `sluice_rejected_total{reason="h2_malformed_headers"}`; the connection serves on.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections import deque
from typing import cast

import h2.events as ev
from h2.errors import ErrorCodes
from h2.exceptions import H2Error, ProtocolError
from hyperframe.frame import GoAwayFrame

from gateway.adapters.h2.guard import (
    CONTROL_QUEUE,
    MAX_STREAM_ID,
    RAPID_RESET,
    Breach,
    FrameGuard,
    request_headers,
    server_h2,
    start_h2,
)
from gateway.adapters.h2.stream import H2Stream
from gateway.telemetry import metrics
from gateway.tls.material import identity

if typing.TYPE_CHECKING:
    from gateway.policy.base import Http2Limits

__all__ = ["H2Conn", "Listener"]

log = logging.getLogger(__name__)

EARLY_RESET_S = 1.0  # a client reset this soon after the stream began counts as early (Envoy)
ABORT_AFTER_S = 1.0  # a closing connection whose GOAWAY the client does not read is cut
# A connection holding all the streams it may (each new one is refused) has the rest of a read
# fed to h2 one piece (`guard.STREAMS_PER_TURN` streams) per this many seconds, not per turn of
# the loop: refusing is all such a client gets, and it waits for it (stream exhaustion).
REFUSING_TURN_S = 0.001
ENDS_PER_TURN = 10  # streams a closing connection ends per turn of the loop (`end_streams`)


class Listener(typing.Protocol):
    """What a connection uses of its listener (`gateway.adapters.h2.server.H2Server`)."""

    loop: asyncio.AbstractEventLoop
    limits: Http2Limits
    header_read_s: float
    keepalive_s: float
    conns: set[H2Conn]
    draining: bool
    mtls: bool  # a TLS listener verifying client certificates: read the identity at accept
    protocol: str  # the metric label of its refusals: "http" or "grpc"

    def start(self, conn: H2Conn, stream: H2Stream) -> asyncio.Task[None]:
        """Hand a new stream to the listener's stream handler."""
        ...


class H2Conn(asyncio.Protocol):
    """One client connection: h2's state, the guard, the streams and flow control, and how it
    ends (GOAWAYs, drain, close, its timer)."""

    server: Listener

    def __init__(self, server: Listener) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = lim = server.limits
        self.h2 = server_h2(lim)
        self.guard = FrameGuard(lim)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.client_cert = ""  # the verified client certificate's identity (mTLS), set by serve_h2
        self.streams: dict[int, H2Stream] = {}
        self.closed = False
        self.closing = False
        self.write_paused = False
        self.drainer: asyncio.Future[None] | None = None
        self.queued_control = 0
        self.goaway = 0  # 1: first GOAWAY sent (drain), 2: the last stream is fixed
        self.last_sid = MAX_STREAM_ID
        self.requests = 0
        self.early = 0  # early resets and refused streams
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.flushing = False  # a flush is scheduled for the end of this loop iteration
        self.final_sent = -1  # the last stream id of the last GOAWAY sent
        self.answered = False  # response frames were written since the socket last drained
        self.backlog: deque[bytes] = deque()  # pieces of a read for the next turns of the loop
        self.ending = False  # the open streams are being ended (end_streams)

    # --- transport events ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        self.server.conns.add(self)
        if self.server.mtls and not self.client_cert:  # accepted by this engine directly
            # the handshake is over: a certificate here was verified (and decoded by the loop's
            # SSL transport; None on a plaintext connection)
            self.client_cert = identity(transport.get_extra_info("peercert"))
        start_h2(self.h2, self.limits)
        self.flush()
        self.arm(self.server.header_read_s)
        if self.server.draining:
            self.drain()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.server.conns.discard(self)
        self.h2.release()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.end_streams()
        fut, self.drainer = self.drainer, None
        if fut is not None and not fut.done():
            fut.set_result(None)  # the waiters see `closed` and raise

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()  # no more frames to answer while nothing leaves
        if not self.streams and not self.answered and not self.closing:
            # Only answers to the client's own frames (ACKs, RST_STREAM, WINDOW_UPDATE) fill the
            # socket buffer: a client that floods and does not read (Twisted cuts at 17 KiB).
            self.calm(CONTROL_QUEUE)

    def resume_writing(self) -> None:
        self.write_paused = False
        self.answered = False
        self.queued_control = 0
        if self.transport is not None and not self.closing and not self.backlog:
            self.transport.resume_reading()
        fut, self.drainer = self.drainer, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def eof_received(self) -> bool:
        return False

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        guard = self.guard
        breach = guard.feed(data, self.loop.time())
        if breach is None and self.write_paused:
            self.queued_control += guard.acks
            if self.queued_control > self.limits.max_queued_control_frames:
                breach = CONTROL_QUEUE
        if breach is not None:
            self.calm(breach)
            return
        backlog = self.backlog
        refusing = guard.new_streams > 0 and self._full()
        if not guard.cuts and not backlog and not refusing:
            self._receive(data)
            return
        # Many new streams: h2 takes them STREAMS_PER_TURN at a time, one piece per turn of the
        # loop, so that the other connections' events run in between; reading waits meanwhile.
        idle = not backlog
        ends = [0, *guard.cuts, len(data)]
        backlog.extend(data[a:b] for a, b in zip(ends, ends[1:], strict=False))
        if idle:
            if self.transport is not None:
                self.transport.pause_reading()
            if refusing:
                self._schedule_turn()
            else:
                self._next_turn()

    def _next_turn(self) -> None:
        """The next piece of a read split by new streams (`guard.STREAMS_PER_TURN`)."""
        if self.closing or self.closed:
            self.backlog.clear()
            return
        self._receive(self.backlog.popleft())
        if self.backlog:
            self._schedule_turn()
        elif self.transport is not None and not self.write_paused and not self.closing:
            self.transport.resume_reading()

    def _schedule_turn(self) -> None:
        """The next piece in the next turn of the loop, or REFUSING_TURN_S from now while the
        connection holds all the streams it may."""
        if self._full():
            self.loop.call_later(REFUSING_TURN_S, self._next_turn)
        else:
            self.loop.call_soon(self._next_turn)

    def _full(self) -> bool:
        """The connection holds all the streams it may: a new one is refused."""
        return len(self.streams) >= self.limits.max_concurrent_streams

    def _receive(self, data: bytes) -> None:
        """Feed h2 `data` (counted by the guard already), handle its events, flush once."""
        if self.closing or self.closed:  # (a closed connection's h2 receives no more: release)
            return
        guard = self.guard
        try:
            events = self.h2.receive_data(data)
        except ProtocolError as e:  # h2 has queued its GOAWAY
            log.debug("HTTP/2 protocol error from %s: %s", self.peer, e)
            reason = (
                "h2_compression_error"
                if e.error_code == ErrorCodes.COMPRESSION_ERROR
                else "h2_protocol_error"
            )
            metrics.REJECTED.labels(reason, self.server.protocol).inc()
            self.close()
            return
        for event in events:
            self._event(event)
        if (
            guard.streams_opened >= self.limits.rapid_reset_min_streams
            and self.early > self.limits.rapid_reset_ratio * guard.streams_opened
        ):
            self.calm(RAPID_RESET)
            return
        if guard.block_open:
            read_s = self.server.header_read_s
            # (nearer than an idle connection's keep-alive deadline; a block already timed keeps
            # its own)
            if self.deadline is None or self.deadline > self.loop.time() + read_s:
                self.arm(read_s)
        elif self.streams and self.deadline is not None:
            self.deadline = None
        self.flush()

    def _event(self, event: ev.Event) -> None:
        t = type(event)
        if t is ev.DataReceived:
            e = cast("ev.DataReceived", event)
            stream = self.streams.get(e.stream_id or 0)
            if stream is not None:
                stream.data(e.data or b"", e.flow_controlled_length or 0)
            elif e.flow_controlled_length:  # a stream we finished: its window is not ours
                self.h2.acknowledge_received_data(e.flow_controlled_length, e.stream_id or 0)
        elif t is ev.RequestReceived:
            self._open(cast("ev.RequestReceived", event))
        elif t is ev.StreamEnded:
            stream = self.streams.get(cast("ev.StreamEnded", event).stream_id or 0)
            if stream is not None:
                stream.body_done = True
                stream.wake()
        elif t is ev.WindowUpdated:
            sid = cast("ev.WindowUpdated", event).stream_id
            if sid:
                stream = self.streams.get(sid)
                if stream is not None:
                    stream.wake_window()
            else:
                for stream in self.streams.values():
                    stream.wake_window()
        elif t is ev.StreamReset:
            self._reset(cast("ev.StreamReset", event))
        elif t is ev.RemoteSettingsChanged:
            for stream in self.streams.values():
                stream.wake_window()
        elif t is ev.ConnectionTerminated:  # the client's GOAWAY: h2 takes no more frames
            self.closing = True
            self.end_streams()
            if self.transport is not None:
                self.transport.close()

    # --- streams ---

    def _open(self, e: ev.RequestReceived) -> None:
        sid = e.stream_id or 0
        self.requests += 1
        if self._full() or sid > self.last_sid or self.goaway == 2:
            if self.guard.refusal_counts(self.loop.time()):
                self.early += 1
            metrics.REJECTED.labels("h2_refused_stream", self.server.protocol).inc()
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        headers = request_headers(cast("list[tuple[bytes, bytes]]", e.headers or []))
        if headers is None:  # malformed: a stream error, the connection serves on
            self.early += 1
            metrics.REJECTED.labels("h2_malformed_headers", self.server.protocol).inc()
            self.h2.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
            return
        stream = H2Stream(self, sid, headers, e.stream_ended is not None, self.loop.time())
        self.streams[sid] = stream
        self.deadline = None
        stream.task = self.server.start(self, stream)
        if self.requests >= self.limits.max_requests_per_connection:
            # The last stream is this one; its GOAWAY goes out once the streams up to it are
            # answered (clients over python-hyper h2, httpx among them, fail a stream still
            # waiting for its answer when a GOAWAY arrives), later streams are refused.
            self.goaway = 2
            self.last_sid = sid

    def _reset(self, e: ev.StreamReset) -> None:
        stream = self.streams.get(e.stream_id or 0)
        if stream is None:
            return
        if not stream.ended and self.loop.time() - stream.opened_at < EARLY_RESET_S:
            self.early += 1
        self.stream_gone(stream)

    def stream_gone(self, stream: H2Stream) -> None:
        """The stream is over for the client: its task, if running, is cancelled."""
        stream.gone()
        task = stream.task
        if task is not None and not task.done() and stream.started:
            task.cancel()  # the pool aborts the upstream request
        # A task that has not run yet runs and finds the stream gone: it is still accounted.

    def end_streams(self) -> None:
        """Every open stream is over for the client (the connection closes): ENDS_PER_TURN of
        them per turn of the loop. Each wakes its task, whose unwinding (the lifecycle's
        accounting, the upstream request's abort) costs ~10 µs: a connection closed with 100
        streams held would otherwise hold every other connection for a millisecond or more."""
        if not self.ending:
            self.ending = True
            self._end_some(deque(self.streams.values()))

    def _end_some(self, streams: deque[H2Stream]) -> None:
        for _ in range(min(ENDS_PER_TURN, len(streams))):
            self.stream_gone(streams.popleft())
        if streams:
            self.loop.call_soon(self._end_some, streams)

    def stream_done(self, stream: H2Stream) -> None:
        """Called by the stream's task as it ends."""
        self.streams.pop(stream.sid, None)
        if self.closed:
            return
        if not stream.ended:  # no clean end went out: never a truncated success
            stream.ended = True
            self._send_reset(stream.sid, ErrorCodes.CANCEL)
        elif not stream.body_done and not stream.reset:
            # Answered before the body was read: the rest is not wanted (RFC 9113 §8.1).
            self._send_reset(stream.sid, ErrorCodes.NO_ERROR)
        if stream.unacked:
            self.h2.acknowledge_received_data(stream.unacked, stream.sid)
            stream.unacked = 0
        if not self.streams:
            if self.goaway == 2:
                self.send_goaway(self.last_sid)
                self.close()
                return
            self.arm(self.server.keepalive_s)
        self.flush_soon()

    def _send_reset(self, sid: int, code: ErrorCodes) -> None:
        try:
            self.h2.reset_stream(sid, code)
        except H2Error:
            pass  # closed on both sides already

    # --- ending: GOAWAYs (a breach's, the graceful two-step drain of RFC 9113 §6.8, the last
    # one), the close and the cut of a client that does not read, and the idle deadline ---

    def calm(self, breach: Breach) -> None:
        """A limit was passed: GOAWAY with its code, then close."""
        log.info("HTTP/2 connection from %s ended: %s", self.peer, breach.reason)
        metrics.REJECTED.labels("h2_" + breach.reason, self.server.protocol).inc()
        try:
            self.h2.close_connection(breach.code)
        except H2Error:
            pass
        self.close()

    def close(self) -> None:
        """Flush, close, and cut if the client does not take the rest within ABORT_AFTER_S."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.flush()
        self.end_streams()
        transport = self.transport
        if self.write_paused:  # the client does not read: nothing more will reach it
            transport.abort()
            return
        transport.close()
        if transport.get_write_buffer_size():
            self.loop.call_later(ABORT_AFTER_S, transport.abort)

    def send_goaway(self, last: int) -> None:
        if last == self.final_sent:
            return
        self.final_sent = last
        self.flush()  # frames h2 queued go first
        if self.transport is not None and not self.closed and not self.transport.is_closing():
            frame = GoAwayFrame(0)
            frame.last_stream_id = last
            frame.error_code = ErrorCodes.NO_ERROR
            self.transport.write(frame.serialize())

    def drain(self) -> None:
        """The graceful two-step GOAWAY (the listener drains)."""
        if self.goaway or self.closing:
            return
        self.goaway = 1
        self.send_goaway(MAX_STREAM_ID)
        self.loop.call_later(self.limits.drain_goaway_delay_s, self.final_goaway)

    def final_goaway(self, last: int | None = None) -> None:
        if self.goaway == 2 or self.closing or self.closed:
            return
        self.goaway = 2
        self.last_sid = self.h2.highest_inbound_stream_id if last is None else last
        self.send_goaway(self.last_sid)
        if not self.streams:
            self.close()

    def shutdown(self) -> None:
        """The drain is over: the last GOAWAY and a close when no stream is left, else a cut
        (its streams are cancelled)."""
        if self.transport is None or self.closed:
            return
        if self.streams:
            self.transport.abort()
            return
        self.final_goaway()
        self.send_goaway(self.last_sid)
        self.close()

    # --- timer ---

    def arm(self, seconds: float) -> None:
        """The deadline is `seconds` from now; the timer is made only when none is pending and
        never sleeps past `header_read_s` (a header block opened on an idle connection moves the
        deadline nearer than its keep-alive one)."""
        now = self.loop.time()
        self.deadline = now + seconds
        if self.timer is None:
            at = min(self.deadline, now + self.server.header_read_s)
            self.timer = self.loop.call_at(at, self.expired)

    def expired(self) -> None:
        self.timer = None
        if self.deadline is None or self.closed:
            return
        now = self.loop.time()
        if now >= self.deadline:
            self.send_goaway(self.h2.highest_inbound_stream_id)  # idle, or headers not in time
            self.close()
        else:
            at = min(self.deadline, now + self.server.header_read_s)
            self.timer = self.loop.call_at(at, self.expired)

    # --- what streams call (`gateway.adapters.h2.stream.StreamConn`) ---

    def consumed(self, stream: H2Stream, size: int) -> None:
        if not self.closed and not stream.reset:
            self.h2.acknowledge_received_data(size, stream.sid)
            self.flush_soon()

    def send_headers(self, stream: H2Stream, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        if stream.reset or self.closed:
            raise ConnectionResetError("stream reset")
        self.answered = True
        try:
            self.h2.send_headers(stream.sid, headers, end_stream=end)
        except H2Error as e:  # the stream or the connection ended under it
            raise ConnectionResetError(str(e)) from e
        if end:
            stream.ended = True
        self.flush_soon()

    async def send_data(self, stream: H2Stream, data: bytes, end: bool) -> None:
        h2c, sid = self.h2, stream.sid
        view = memoryview(data)
        while True:
            if stream.reset or self.closed:
                raise ConnectionResetError("stream reset")
            room = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size)
            if room <= 0 and view:
                await stream.wait_window()
                continue
            part = view[:room]
            view = view[room:]
            last = end and not view
            self.answered = True
            try:
                h2c.send_data(sid, part.tobytes(), end_stream=last)
            except H2Error as e:
                raise ConnectionResetError(str(e)) from e
            self.guard.data_sent += 1
            if last:
                stream.ended = True
            self.flush_soon()
            if self.write_paused:
                await self.drain_writes()
            if not view:
                return

    def reset(self, stream: H2Stream, code: ErrorCodes) -> None:
        if not stream.ended and not self.closed:
            stream.ended = True
            self._send_reset(stream.sid, code)
            self.flush_soon()

    async def drain_writes(self) -> None:
        if self.closed:
            raise ConnectionResetError("client disconnected")
        if self.write_paused:
            if self.drainer is None:
                self.drainer = self.loop.create_future()
            await self.drainer
            if self.closed:
                raise ConnectionResetError("client disconnected")

    # --- writing ---

    def flush_soon(self) -> None:
        """What streams send goes out in one write at the end of this loop iteration, with the
        other streams' (one response of many streams: one write, not three each)."""
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """One write of everything h2 has queued."""
        self.flushing = False
        data = self.h2.data_to_send()
        transport = self.transport
        if data and transport is not None and not self.closed and not transport.is_closing():
            transport.write(data)
