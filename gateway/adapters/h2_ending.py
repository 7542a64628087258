"""How an HTTP/2 connection of Sluice's engine ends: the GOAWAYs (a breach's, the graceful
two-step drain of RFC 9113 §6.8, the last one), the close and the cut of a client that does
not read, and the one lazily moved deadline (`timeouts.header_read_s`, `keepalive_s`) that
ends an idle one. `H2Ending` is the ending half of `gateway.adapters.h2_conn.H2Conn`; the
module docstring there lists what a connection does and refuses.
"""

from __future__ import annotations

import asyncio
import logging
import typing

from h2.errors import ErrorCodes
from h2.exceptions import H2Error
from hyperframe.frame import GoAwayFrame

from gateway.adapters.h2_guard import MAX_STREAM_ID, Breach
from gateway.telemetry import metrics

if typing.TYPE_CHECKING:
    from h2.connection import H2Connection

    from gateway.adapters.h2_stream import H2Stream
    from gateway.policy.base import Http2Limits

log = logging.getLogger("gateway.adapters.h2_conn")

ABORT_AFTER_S = 1.0  # a closing connection whose GOAWAY the client does not read is cut


class EndingServer(typing.Protocol):
    """What ending needs of the listener (`gateway.adapters.h2_conn.Listener`)."""

    @property
    def protocol(self) -> str: ...


class H2Ending:
    """The state of a connection's end and the steps that end it."""

    loop: asyncio.AbstractEventLoop
    server: EndingServer
    limits: Http2Limits
    h2: H2Connection
    transport: asyncio.Transport | None
    peer: str
    streams: dict[int, H2Stream]
    closed: bool
    closing: bool
    write_paused: bool
    goaway: int
    last_sid: int
    deadline: float | None
    timer: asyncio.TimerHandle | None
    final_sent: int

    def flush(self) -> None: ...

    def stream_gone(self, stream: H2Stream) -> None: ...

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
        for stream in list(self.streams.values()):
            self.stream_gone(stream)
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
        self.deadline = self.loop.time() + seconds
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self.expired)

    def expired(self) -> None:
        self.timer = None
        if self.deadline is None or self.closed:
            return
        if self.loop.time() >= self.deadline:
            self.send_goaway(self.h2.highest_inbound_stream_id)  # idle, or headers not in time
            self.close()
        else:
            self.timer = self.loop.call_at(self.deadline, self.expired)
