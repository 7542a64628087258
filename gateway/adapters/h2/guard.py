"""The frame guard of the HTTP/2 engine: reads frame headers ahead of python-hyper `h2` and
counts them against `limits.http2`, so a flood ends the connection before h2 buffers or answers
it.

python-hyper `h2` bounds the decoded header list, its CONTINUATION backlog (64) and the flow
windows, but buffers a frame whose header declares a huge length until the whole payload arrives,
ACKs every PING and SETTINGS into an unbounded buffer, and counts no PRIORITY, WINDOW_UPDATE or
empty DATA frame (h2 4.4: `h2/frame_buffer.py`, `h2/connection.py`). The guard reads only the 9-byte
headers (payloads are skipped, never copied) and keeps per connection: the declared length against
SETTINGS_MAX_FRAME_SIZE, CONTINUATION frames and bytes per header block, PING and SETTINGS per
second, consecutive empty DATA frames, PRIORITY frames per stream (Envoy), WINDOW_UPDATE frames
against the DATA frames sent (Envoy), new streams per read (nginx), and the allowance of streams
refused past SETTINGS_MAX_CONCURRENT_STREAMS that are not counted as early resets.
Pure: callers pass the bytes and `now`; a breach is returned, never raised. `server_h2` and
`start_h2` apply the same limits to h2's own state (the SETTINGS advertised, the windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import Event
from h2.exceptions import ProtocolError, StreamClosedError, StreamIDTooLowError
from h2.settings import SettingCodes, Settings
from h2.utilities import CONNECTION_HEADERS
from hpack.exceptions import HPACKError
from hyperframe.frame import Frame, RstStreamFrame

from gateway.adapters.h2.codec import QUIET, Config, ListDecoder, PlainEncoder
from gateway.policy.base import Http2Limits

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_STREAM_ID = 2**31 - 1
# New streams h2 takes from one connection per turn of the event loop: each costs ~0.1 ms of
# h2 (HPACK, state) and our own opening, so a read of 200 (`max_new_streams_per_read`) would
# hold every other connection for ~20 ms; split, they wait ~2 ms at most (stream exhaustion).
STREAMS_PER_TURN = 2

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


@dataclass(frozen=True, slots=True)
class Breach:
    """A limit the client went past: the connection ends with GOAWAY `code`."""

    code: ErrorCodes
    reason: str  # the metric label (sluice_rejected_total{reason="h2_<reason>"})


_CALM = ErrorCodes.ENHANCE_YOUR_CALM
FRAME_TOO_LARGE = Breach(ErrorCodes.FRAME_SIZE_ERROR, "frame_too_large")
CONTINUATION_FLOOD = Breach(_CALM, "continuation_flood")
HEADER_BLOCK_TOO_LARGE = Breach(_CALM, "header_block_too_large")
PING_FLOOD = Breach(_CALM, "ping_flood")
SETTINGS_FLOOD = Breach(_CALM, "settings_flood")
EMPTY_FRAMES = Breach(_CALM, "empty_frames")
PRIORITY_FLOOD = Breach(_CALM, "priority_flood")
WINDOW_UPDATE_FLOOD = Breach(_CALM, "window_update_flood")
NEW_STREAMS_FLOOD = Breach(_CALM, "new_streams_per_read")
RAPID_RESET = Breach(_CALM, "rapid_reset")
CONTROL_QUEUE = Breach(_CALM, "control_queue")
BAD_PREFACE = Breach(ErrorCodes.PROTOCOL_ERROR, "bad_preface")


class FrameGuard:
    """Frame headers of one connection's inbound bytes, counted against `Http2Limits`."""

    __slots__ = (
        "limits", "preface_left", "skip", "head", "highest", "streams_opened", "block_open",
        "block_frames", "block_bytes", "empty", "priority", "window_updates", "data_sent",
        "window_end", "pings", "settings", "new_streams", "acks", "refusals", "refusals_at",
        "cuts",
    )  # fmt: skip

    def __init__(self, limits: Http2Limits) -> None:
        self.limits = limits
        self.preface_left = len(PREFACE)  # the client's preface comes first, before any frame
        self.skip = 0  # payload bytes of the current frame still to come
        self.head = bytearray()  # a frame header split across reads
        self.highest = 0  # highest client stream id seen
        self.streams_opened = 0
        self.block_open = False  # a header block waits for its CONTINUATION frames
        self.block_frames = 0
        self.block_bytes = 0
        self.empty = 0
        self.priority = 0
        self.window_updates = 0
        self.data_sent = 0  # DATA frames sent: raised by the connection
        self.window_end = 0.0
        self.pings = 0
        self.settings = 0
        self.new_streams = 0  # in the current read
        self.acks = 0  # PING and SETTINGS frames in the current read (each is answered)
        self.refusals = 2.0 * limits.max_concurrent_streams  # refusals not counted, refilled
        self.refusals_at = 0.0
        # Offsets in the current read where a turn of the loop ends: before the HEADERS frame
        # of every STREAMS_PER_TURN-th new stream after the first (`H2Conn` feeds h2 the read
        # in those pieces, one per turn of the event loop).
        self.cuts: list[int] = []

    def feed(self, data: bytes, now: float) -> Breach | None:
        """Count the frames whose headers are in `data` (the next bytes of the connection)."""
        n = len(data)
        pos = 0
        self.new_streams = self.acks = 0
        self.cuts.clear()
        if now >= self.window_end:
            self.window_end = now + 1.0
            self.pings = self.settings = 0
        if self.preface_left:
            take = min(self.preface_left, n)
            start = len(PREFACE) - self.preface_left
            if data[:take] != PREFACE[start : start + take]:
                return BAD_PREFACE
            self.preface_left -= take
            pos = take
        if self.skip:
            if self.skip >= n - pos:
                self.skip -= n - pos
                return None
            pos += self.skip
            self.skip = 0
        head = self.head
        while pos < n:
            if head or n - pos < 9:
                need = 9 - len(head)
                head += data[pos : pos + need]
                pos += min(need, n - pos)
                if len(head) < 9:
                    break
                hdr, off, at = bytes(head), 0, 0
                head.clear()
            else:
                hdr, off, at = data, pos, pos
                pos += 9
            length = int.from_bytes(hdr[off : off + 3], "big")
            opened = self.new_streams
            breach = self._frame(
                length,
                hdr[off + 3],
                hdr[off + 4],
                int.from_bytes(hdr[off + 5 : off + 9], "big") & 0x7FFFFFFF,
            )
            if breach is not None:
                return breach
            if opened and opened != self.new_streams and opened % STREAMS_PER_TURN == 0:
                self.cuts.append(at)
            pos += length
        self.skip = pos - n if pos > n else 0
        return None

    def refusal_counts(self, now: float) -> bool:
        """A stream is refused (over SETTINGS_MAX_CONCURRENT_STREAMS, or after the last GOAWAY):
        whether it counts as an early reset. RFC 9113 §5.1.2 makes such a stream a stream error
        the client may retry: twice max_concurrent_streams refusals at once, refilled at
        max_concurrent_streams per second, are free (a client opening streams before our
        SETTINGS reached it, or one stream too many now and then); past them, a client that
        keeps opening streams it cannot have is judged as a rapid reset."""
        limit = self.limits.max_concurrent_streams
        if now > self.refusals_at:
            self.refusals = min(2.0 * limit, self.refusals + (now - self.refusals_at) * limit)
            self.refusals_at = now
        if self.refusals >= 1.0:
            self.refusals -= 1.0
            return False
        return True

    def _frame(self, length: int, ftype: int, flags: int, sid: int) -> Breach | None:
        lim = self.limits
        if length > lim.max_frame_bytes:
            return FRAME_TOO_LARGE
        if ftype == DATA:
            if length == 0 and not flags & END_STREAM:
                self.empty += 1
                if self.empty > lim.max_consecutive_empty_frames:
                    return EMPTY_FRAMES
            else:
                self.empty = 0
        elif ftype == HEADERS:
            if length:
                self.empty = 0
            if sid & 1 and sid > self.highest:
                self.highest = sid
                self.streams_opened += 1
                self.new_streams += 1
                if self.new_streams > lim.max_new_streams_per_read:
                    return NEW_STREAMS_FLOOD
            self.block_open = not flags & END_HEADERS
            self.block_frames = 0
            self.block_bytes = length
            if length > lim.max_header_list_bytes:
                return HEADER_BLOCK_TOO_LARGE
        elif ftype == CONTINUATION:
            self.block_frames += 1
            self.block_bytes += length
            if self.block_frames > lim.max_continuation_frames:
                return CONTINUATION_FLOOD
            if self.block_bytes > lim.max_header_list_bytes:
                return HEADER_BLOCK_TOO_LARGE
            if flags & END_HEADERS:
                self.block_open = False
        elif ftype == PING:
            if not flags & ACK:
                self.acks += 1
                self.pings += 1
                if self.pings > lim.max_pings_per_s:
                    return PING_FLOOD
        elif ftype == SETTINGS:
            if not flags & ACK:
                self.acks += 1
                self.settings += 1
                if self.settings > lim.max_settings_per_s:
                    return SETTINGS_FLOOD
        elif ftype == PRIORITY:
            self.priority += 1
            if self.priority > lim.max_priority_frames_per_stream * (1 + self.streams_opened):
                return PRIORITY_FLOOD
        elif ftype == WINDOW_UPDATE:
            self.window_updates += 1
            allowed = 5 + 2 * (
                self.streams_opened + lim.max_window_updates_per_data_frame * self.data_sent
            )
            if self.window_updates > allowed:
                return WINDOW_UPDATE_FLOOD
        return None


def request_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
    """A request's header block as h2 validates it (RFC 9113 §8.2-8.3: names, values, pseudo
    headers, connection-specific fields), or None when it is malformed. A value's surrounding
    spaces and tabs are dropped first, as an HTTP/1.1 parser drops them (grpc core accepts such
    values too): a client's `Bearer ` is a bad token, not a bad connection.

    h2 checks inbound headers inside `receive_data` and ends the whole connection on a malformed
    block (GOAWAY PROTOCOL_ERROR, every other stream of it lost); RFC 9113 §8.1.1 makes it a
    stream error, so the connection turns h2's own check off and runs it here, per stream.

    The decisions are those of h2's `validate_headers` for a request received by a server
    (h2 4.4), taken in one pass instead of its chain of generators (24 → 3.5 µs for an 11-field
    gRPC call); `tests/adapters/test_h2_request_headers.py` holds the two to the same answers:
    - a name is `[!-~]` without upper case, and a colon only as the first byte of one of the
      six pseudo-header names; a value holds no NUL, CR or LF;
    - `te` is `trailers` (any case); no connection-specific name (`CONNECTION_HEADERS`);
    - pseudo headers come before the others, once each; `:method` is required; ordinary
      CONNECT has neither `:scheme` nor `:path`, other requests (and extended CONNECT, with
      `:protocol`) have both; `:protocol` only with CONNECT; no `:status`; `:path` not empty
      (its form, `/…` or `*`, is not checked, nor is `:scheme`'s value);
    - `:authority` or `host` is present, at most one `host`, equal to `:authority` if both.
    Cookies are joined by h2 before (its inbound normalisation), not here."""
    out: list[tuple[bytes, bytes]] = []
    seen = 0  # the pseudo headers met, as their bits in _NAMES
    regular = False  # a regular header met: no pseudo header may follow
    method: bytes | None = None
    authority: bytes | None = None
    host: bytes | None = None
    for n, v in raw:
        v = v.strip(b" \t")  # the same object when there is nothing to strip
        if 13 in v or 10 in v or 0 in v:  # an int is found without a substring search's set-up
            return None
        kind = _NAMES.get(n, _OTHER)
        if kind > 0:  # a pseudo header
            if regular or seen & kind:
                return None
            seen |= kind
            if kind == _METHOD:
                method = v
            elif kind == _AUTHORITY:
                authority = v
            elif kind == _PATH:
                if not v:
                    return None
            elif kind == _STATUS:
                return None
        else:
            regular = True
            if kind:
                if kind == _OTHER:
                    if not n or n.translate(None, _NAME_BYTES):
                        return None
                elif kind == _HOST:
                    if host is not None:
                        return None
                    host = v
                elif kind == _TE:
                    if v.lower() != b"trailers":
                        return None
                else:  # _CONNECTION_SPECIFIC
                    return None
        out.append((n, v))
    if not seen & _METHOD:
        return None
    if method == b"CONNECT":
        if not seen & _PROTOCOL:
            if seen & (_SCHEME | _PATH):
                return None
        elif seen & (_SCHEME | _PATH) != _SCHEME | _PATH:
            return None
    elif seen & (_SCHEME | _PATH | _PROTOCOL) != _SCHEME | _PATH:
        return None
    if authority is None:
        if host is None:
            return None
    elif host is not None and host != authority:
        return None
    return out


# `request_headers`' names: a pseudo header is a bit (> 0); a regular name is 0 when it is known
# valid (the common ones, spared the check of its bytes), negative when it has a rule of its
# own, _OTHER when its bytes are to be checked: each in _NAME_BYTES (0x21-0x7e but the colon and
# the upper case).
_METHOD, _SCHEME, _AUTHORITY, _PATH, _STATUS, _PROTOCOL = 1, 2, 4, 8, 16, 32
_HOST, _TE, _CONNECTION_SPECIFIC, _OTHER = -1, -2, -3, -4
_COMMON = (
    "accept accept-encoding accept-language authorization cache-control content-length "
    "content-type cookie grpc-accept-encoding grpc-encoding grpc-timeout openai-organization "
    "origin referer traceparent tracestate user-agent x-api-key x-forwarded-for x-request-id"
)
_NAMES: dict[bytes, int] = {
    **dict.fromkeys(_COMMON.encode().split(), 0),
    b":method": _METHOD,
    b":scheme": _SCHEME,
    b":authority": _AUTHORITY,
    b":path": _PATH,
    b":status": _STATUS,
    b":protocol": _PROTOCOL,
    b"host": _HOST,
    b"te": _TE,
    **dict.fromkeys(CONNECTION_HEADERS, _CONNECTION_SPECIFIC),
}
_NAME_BYTES = bytes(c for c in range(0x21, 0x7F) if c != 0x3A and not 0x41 <= c <= 0x5A)


class ServerH2(H2Connection):
    """h2's connection state with a bound on the closed streams it remembers, and HPACK
    decoding errors answered with GOAWAY COMPRESSION_ERROR.

    h2 keeps how each closed stream ended, so that a frame arriving late on it gets the right
    answer (RST_STREAM for a reset stream, a connection error otherwise). Its default is the last
    65,536 per connection: a long-lived connection carrying many short streams (gRPC channels)
    filled that table, and its resizes held tens of MB per connection that the allocator never
    gave back. A frame can only arrive late by about a round trip, during which a connection
    closes at most a few times its concurrent streams; older ones are forgotten."""

    def __init__(self, config: H2Configuration, closed_kept: int) -> None:
        self.MAX_CLOSED_STREAMS = closed_kept  # read by H2Connection.__init__
        self.sweep_at = SWEEP_MIN
        super().__init__(config)

    def _receive_frame(self, frame: Frame) -> list[Event]:
        """h2's (4.4), but for two things:
        - h2's first line formats `repr(frame)` for a trace log, whatever the logger does with
          it: ~2 µs for every frame received (a tenth of a stream-exhaustion flood's CPU, a few
          µs of each HTTP/2 request). Not here.
        - a header block HPACK cannot decode (a dynamic table size update after a field, a bad
          index, bad Huffman...) ends the connection with COMPRESSION_ERROR (RFC 9113 §4.3, RFC
          7541 §4.2): h2 raises a plain ProtocolError from the HPACKError, whose code its
          `receive_data` puts in the GOAWAY. An oversized header list stays h2's
          DenialOfServiceError (ENHANCE_YOUR_CALM): the block decoded, it was too large."""
        events: list[Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as e:
            # A frame on a stream closed by RST_STREAM is a stream error (RST_STREAM again);
            # on one closed otherwise, a connection error.
            if not self._stream_is_closed_by_reset(e.stream_id):
                raise
            reset = RstStreamFrame(e.stream_id)
            reset.error_code = e.error_code
            self._prepare_for_sending([reset])
            return cast("list[Event]", e._events)
        except StreamIDTooLowError as e:
            # A stream forgotten since (or closed implicitly by a higher one): a stream error
            # when it was reset, a connection error otherwise.
            if self._stream_is_closed_by_reset(e.stream_id):
                reset = RstStreamFrame(e.stream_id)
                reset.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([reset])
                return []
            if self._stream_is_closed_by_end(e.stream_id):
                raise StreamClosedError(e.stream_id) from e
            raise
        except ProtocolError as e:
            if type(e) is ProtocolError and isinstance(e.__cause__, HPACKError):
                e.error_code = ErrorCodes.COMPRESSION_ERROR
            raise
        self._prepare_for_sending(frames)
        return events

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        """h2's, without its generator and its `assert` over the frames (h2 built them itself,
        within the peer's frame size): h2 calls this for every frame it sends, a few per
        request, and its two generators were ~1 µs of each call."""
        out = self._data_to_send
        for f in frames:
            out += f.serialize()

    def release(self) -> None:
        """The connection is closed: no frame will be received. h2's table of frame handlers
        holds bound methods of this object, a reference cycle that kept each closed connection's
        h2 state (~50 objects: HPACK tables, settings, windows, streams) for the collector;
        emptied, they go at once, by their reference counts. Sending still works (streams that
        are ending may still ask to), receiving does not."""
        self._frame_dispatch_table = {}

    @property
    def open_inbound_streams(self) -> int:
        """At most this many inbound streams are open: h2 asks on every new stream, to hold
        them under its SETTINGS bound (lifted by `start_h2`: the connection refuses past it
        itself), and walks every stream it holds to count them, moving the closed ones out as
        it goes: a seventh of what a new stream costs with 100 open (stream exhaustion). The
        walk runs once the table has doubled since the last one; in between, the table's size
        is the answer (closed streams still in it answer late frames as h2 does)."""
        n = len(self.streams)
        if n < self.sweep_at:
            return n
        open_now = self._open_streams(1)
        self.sweep_at = max(SWEEP_MIN, 2 * len(self.streams))
        return open_now


SWEEP_MIN = 64  # h2's stream table is walked for closed streams from this size on


def closed_streams_kept(limits: Http2Limits) -> int:
    """How many closed streams a connection remembers: 4 × SETTINGS_MAX_CONCURRENT_STREAMS, at
    least 256."""
    return max(256, 4 * limits.max_concurrent_streams)


def server_h2(limits: Http2Limits) -> ServerH2:
    """h2's server state for one connection, with `limits`' SETTINGS. Inbound request headers
    are checked per stream (`request_headers`) rather than by h2. Outbound headers come from
    the lifecycle already checked (`forward.headers`: values, hop-by-hop names dropped) and
    lower-cased by the exchange: h2's second pass over them is skipped. The configuration and
    the header encoder and decoder are `codec`'s (the same frames and fields, less CPU)."""
    h2c = ServerH2(
        Config(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            logger=QUIET,
        ),
        closed_streams_kept(limits),
    )
    h2c.local_settings = Settings(
        client=False,
        initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            SettingCodes.INITIAL_WINDOW_SIZE: limits.initial_stream_window_bytes,
            SettingCodes.MAX_FRAME_SIZE: limits.max_frame_bytes,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
        },
    )
    h2c.encoder = PlainEncoder()  # before any SETTINGS could size its table
    h2c.max_inbound_frame_size = limits.max_frame_bytes
    h2c.decoder = ListDecoder(limits.max_header_list_bytes)
    return h2c


def start_h2(h2c: H2Connection, limits: Http2Limits) -> None:
    """Queue the server preface (SETTINGS) and open the connection window."""
    h2c.initiate_connection()
    # h2 would end the connection on the stream past the advertised bound; the connection
    # refuses it instead (REFUSED_STREAM), so h2's own bound is lifted once the SETTINGS are out.
    h2c.local_settings.max_concurrent_streams = MAX_STREAM_ID
    h2c.local_settings.acknowledge()
    # Only a stream's own window can fill: the connection's holds every stream's.
    window = min(MAX_STREAM_ID, limits.initial_stream_window_bytes * limits.max_concurrent_streams)
    if window > 65535:
        h2c.increment_flow_control_window(window - 65535)
